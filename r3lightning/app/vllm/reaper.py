"""Stops an engine's process group when the process that owns it dies, however it dies.

``python reaper.py OWNER_PID PGID GRACE_S``, started by the launcher next to the engine: it
checks every half second whether ``OWNER_PID`` still runs; once it is gone (even killed with
``SIGKILL``, which runs no code in the owner), it sends the group ``SIGTERM``, then ``SIGKILL``
after ``GRACE_S`` seconds. It exits by itself when the group is gone. Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(owner: int, pgid: int, grace_s: float) -> None:
    """Wait while ``owner`` lives, then end the process group ``pgid``: SIGTERM, then SIGKILL.

    Returns early once the group is gone. Polls every 0.5 s (0.1 s while waiting for the group).

    Args:
        owner: the pid of the process that started the engine (this reaper's parent).
        pgid: the engine's process group.
        grace_s: how long each signal is given before the next.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the owner's death ends the engine
    # the owner is our parent: once it dies we are re-parented, and its pid may be reused
    while os.getppid() == owner and _exists(owner):
        if not _group_exists(pgid):
            return
        time.sleep(0.5)
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace_s
        while _group_exists(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
