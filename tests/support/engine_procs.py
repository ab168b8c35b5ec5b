"""Process checks for the engine launcher tests, read from /proc (Linux): who is in a process
group, and whether a process is still alive (a zombie counts as gone: it runs nothing)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
    return text[text.rindex(")") + 2 :].split()


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """The live processes whose process group is ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """Wait until none of ``pids`` is alive; returns those still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)
