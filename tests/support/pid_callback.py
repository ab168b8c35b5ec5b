"""A Lightning callback that writes the id of the process that built it (which process ran a job)."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class RecordPid(Callback):
    """Writes ``os.getpid()`` to ``path`` when built."""

    def __init__(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(str(os.getpid()))
