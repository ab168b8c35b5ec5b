"""``correction/*`` metrics: exact ratios of sums over micro-batches and ranks, never means of
ratios, accumulated on device with no host sync."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from r3lightning.correction.importance import (
    MASK_MODES,
    TIS_MODES,
    CorrectionConfig,
    Tokens,
    tokens_of,
)

__all__ = ["CorrectionMetrics", "correction_sums"]


def correction_sums(weights: Tokens, mask: Tokens, config: CorrectionConfig) -> tuple[Tensor, Tensor]:
    """float64 ``[5]`` sums (loss tokens, sum w, sum w^2, tokens at the TIS cap, tokens dropped) and
    ``[]`` max weight of one micro-batch."""
    w, keep, _ = tokens_of(weights, mask)
    zero = torch.zeros((), dtype=torch.float64, device=w.device)
    truncated = masked = zero
    if config.mode in TIS_MODES:  # compared in the weights' own dtype: the cap as it was stored
        truncated = (keep & (w >= torch.tensor(config.threshold, dtype=w.dtype))).sum().double()
    if config.mode in MASK_MODES:
        masked = (keep & (w == 0)).sum().double()
    w = torch.where(keep, w.double(), 0.0)
    sums = torch.stack([keep.sum().double(), w.sum(), (w * w).sum(), truncated, masked])
    return sums, (w.amax() if w.numel() else zero)


class CorrectionMetrics:
    """The ``correction/*`` metrics of one step, accumulated over its micro-batches."""

    def __init__(self, config: CorrectionConfig | None = None) -> None:
        self.config = config or CorrectionConfig()
        self.reset()

    def reset(self) -> None:
        self._sums: Tensor | None = None  # [5] float64 on the weights' device
        self._max: Tensor | None = None  # [] float64

    def update(self, weights: Tokens, mask: Tokens) -> None:
        sums, top = correction_sums(weights, mask, self.config)
        if self._sums is None or self._max is None:  # the first micro-batch
            self._sums, self._max = sums, top
        else:
            self._sums = self._sums + sums.to(self._sums.device)
            self._max = torch.maximum(self._max, top.to(self._max.device))

    def compute(self, *, sync_dist: bool = False) -> dict[str, Tensor]:
        """Float64 scalars ``correction/<name>``; ``sync_dist``: reduced over the default process
        group first (two small collectives every rank must join)."""
        sums = torch.zeros(5, dtype=torch.float64) if self._sums is None else self._sums.clone()
        top = torch.zeros((), dtype=torch.float64) if self._max is None else self._max.clone()
        if sync_dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        n, total, squares, truncated, masked = sums.unbind(0)
        tokens = n.clamp(min=1)
        spread = n * squares
        out = {
            "weight_mean": total / tokens,
            "weight_max": top,
            "ess": torch.where(spread > 0, total * total / spread.clamp(min=1e-300), 0.0),
            "truncated_fraction": truncated / tokens,
            "masked_fraction": masked / tokens,
            "loss_tokens": n,
        }
        return {f"correction/{name}": value for name, value in out.items()}
