"""The patches megatron-core 0.16 needs to run MoE layers without Transformer Engine (torch.mm
gating) or CUDA (``current_device()`` is ``"cpu"``, no CUDA RNG state, the pipeline schedules'
``"cuda"`` tensors on the CPU): tests, ``scripts/gpu_check.py``, the megatron example."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch

__all__ = ["megatron_device_shims"]


@contextmanager
def megatron_device_shims(device: torch.device | str = "cpu") -> Iterator[None]:
    """Patches megatron-core for MoE forward, backward and recompute on ``device``, for as long as
    the ``with`` block runs.

    Not thread-safe (it patches module attributes): enter it once, around the whole run.

    Args:
        device: The device the layers run on. Without Transformer Engine, the MoE gating uses
            ``torch.mm`` on any device; on the CPU, megatron's CUDA calls are also redirected.

    Yields:
        Nothing; every patched attribute is restored (or deleted, if it was missing) on exit.
    """
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    patches = []  # (module, attribute, replacement)
    if not getattr(moe_utils, "HAVE_TE", False):
        patches.append((moe_utils, "te_general_gemm", None))  # None: the gating falls back to torch.mm
    if torch.device(device).type == "cpu":
        patches.append((torch.cuda, "current_device", lambda: "cpu"))
        patches.append((schedules, "torch", _HostTorch()))  # the schedules' "cuda" tensors on the CPU
        patches.append((tp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.empty(0)))
        patches.append((tp_random, "_set_cuda_rng_state", lambda *args, **kwargs: None))
    with ExitStack() as stack:  # each attribute restored (or deleted if it was missing) on exit
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value, create=True))
        yield


class _HostTorch:
    """``torch`` for megatron's schedules module, with ``zeros(device="cuda")`` made on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)
