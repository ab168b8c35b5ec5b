"""Scripts and commands of the checkout run in a fresh interpreter, as a user starts them."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


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


@contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    """``benchmarks/<name>.py`` imported for the ``with`` block, with benchmarks/ on ``sys.path``
    while it lasts (a benchmark imports its siblings, e.g. ``_common``, by name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
