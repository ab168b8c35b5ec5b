"""What a test needs from the machine, said once: ``@run_if(cuda=True)`` on a test or class,
``pytestmark = run_if(megatron=True)`` for a module. A test that cannot run is skipped with a reason
naming every missing need. (A module whose own top-level imports need an optional package guards
them with ``pytest.importorskip`` before importing.)"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

PACKAGES = {"megatron": "megatron.core", "transformers": "transformers", "pyarrow": "pyarrow"}


def _missing(
    *,
    cuda: bool | None = None,
    min_cpus: int = 1,
    fork: bool = False,
    megatron: bool = False,
    transformers: bool = False,
    pyarrow: bool = False,
) -> list[str]:
    """The needs this machine does not meet, in words. ``cuda=False`` needs a machine without a GPU."""
    missing = []
    if cuda and not torch.cuda.is_available():
        missing.append("a CUDA device")
    if cuda is False and (torch.cuda.is_available() or torch.backends.mps.is_available()):
        missing.append("a machine without a GPU")
    if min_cpus > 1 and len(os.sched_getaffinity(0)) < min_cpus:
        missing.append(f"{min_cpus} usable CPUs")
    if fork and not hasattr(os, "register_at_fork"):
        missing.append("fork()")
    wanted = {"megatron": megatron, "transformers": transformers, "pyarrow": pyarrow}
    for name, needed in wanted.items():
        if needed and importlib.util.find_spec(PACKAGES[name]) is None:
            missing.append(f"{name} ({PACKAGES[name]})")
    return missing


def run_if(**needs: object) -> pytest.MarkDecorator:
    """A skip mark that applies when any of ``needs`` (see :func:`_missing`) is unmet."""
    missing = _missing(**needs)  # type: ignore[arg-type]
    return pytest.mark.skipif(bool(missing), reason="needs " + ", ".join(missing))
