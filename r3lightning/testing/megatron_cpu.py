"""The few patches megatron-core 0.16 needs to run MoE layers off its usual CUDA + Transformer Engine setup.

Used by the tests, ``scripts/gpu_check.py``, the megatron example and the main job's CPU rehearsal,
always as a context manager so every patch is undone on exit:

* without Transformer Engine, ``moe_utils`` never defines ``te_general_gemm`` and router gating
  raises ``NameError``; ``None`` selects megatron's own ``torch.mm`` path (any device);
* on the CPU, ``Router.gating`` moves router weights to ``torch.cuda.current_device()`` (and
  ``TopKRouter`` builds expert-bias buffers there): that device becomes ``"cpu"``;
* on the CPU, megatron's activation checkpoint saves and restores the CUDA RNG state: both calls
  become no-ops (megatron still saves and restores the CPU RNG state);
* on the CPU, the pipeline schedules (``forward_backward_func``) count tokens in a tensor made on
  ``"cuda"``: the schedules module sees a ``torch`` whose ``zeros`` puts it on the CPU.

On a CUDA device only the Transformer Engine patch applies: the others would be wrong there.
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

    Not thread-safe (it patches module attributes): enter it once per process, around the whole
    run that builds and uses megatron modules.
    """
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
