"""The patches megatron-core 0.16 needs to run MoE layers off CUDA + Transformer Engine, undone on
exit (tests, ``scripts/gpu_check.py``, the megatron example, the job's CPU rehearsal):

* without Transformer Engine, router gating raises ``NameError`` on ``moe_utils.te_general_gemm``:
  ``None`` selects megatron's own ``torch.mm`` path (any device);
* on the CPU, ``torch.cuda.current_device()`` (router weights, expert-bias buffers) is ``"cpu"``,
  the activation checkpoint's CUDA RNG save/restore are no-ops, and the pipeline schedules' token
  count tensor made on ``"cuda"`` is made on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["megatron_device_shims"]

_MISSING = object()


@contextmanager
def megatron_device_shims(device: torch.device | str = "cpu") -> Iterator[None]:
    """Patch megatron-core for MoE forward, backward and recompute on ``device``; undone on exit.
    Not thread-safe (it patches module attributes): enter it once, around the whole run."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    device = torch.device(device)
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, value)

    if not getattr(moe_utils, "HAVE_TE", False):
        patch(moe_utils, "te_general_gemm", None)
    if device.type == "cpu":
        patch(torch.cuda, "current_device", lambda: "cpu")
        patch(tp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.empty(0))
        patch(tp_random, "_set_cuda_rng_state", lambda *args, **kwargs: None)
        patch(schedules, "torch", _HostTorch())
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


class _HostTorch:
    """``torch`` for megatron's schedules module, with ``zeros(device="cuda")`` made on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)
