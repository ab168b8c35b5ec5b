"""Scripts and commands of the checkout run in a fresh interpreter, as a user starts them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_python(cwd: Path, *argv: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``python ARGV`` in ``cwd`` with only the checkout on PYTHONPATH (and ``env`` set), its output
    captured as text."""
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        timeout=timeout,
    )
