"""``r3lightning-train ARGS`` in the test's own process, as the console script runs it."""

from __future__ import annotations

import sys


def train_cli(*args: str) -> None:
    """Run the job's console entry point with ``args`` as its command line (Hydra reads
    ``sys.argv``); a failure raises ``SystemExit`` with the exit status, as the script exits."""
    from r3lightning.app.job.main import main

    saved = sys.argv
    sys.argv = ["r3lightning-train", *args]
    try:
        main()
    finally:
        sys.argv = saved
