"""``correction/*`` metrics: exact ratios of sums over micro-batches and ranks, never means of
ratios, accumulated on device with no host sync."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from r3lightning.correction.importance import Tokens, tokens_of
from r3lightning.correction.steps import TIS_KINDS, CorrectionConfig, CorrectionStep

__all__ = ["CorrectionMetrics", "correction_sums", "step_sums"]


def correction_sums(weights: Tokens, mask: Tokens, config: CorrectionConfig) -> tuple[Tensor, Tensor]:
    """The sums behind the ``correction/*`` metrics, for one micro-batch's combined weights.

    Args:
        weights: `correction_weights` of the micro-batch: padded ``[B, T]`` or packed.
        mask: Its loss mask, in the form `tokens_of` accepts.
        config: The correction that made ``weights`` (which steps truncate and which drop).

    Returns:
        ``(sums, top)`` on the weights' device: float64 ``sums [5]`` (loss tokens, sum w, sum w^2,
        loss tokens at the TIS cap, loss tokens at 0 when a mask step applies) and float64 ``top
        []``, the largest weight on a loss token (0 when there are none). No host sync.

    Raises:
        ValueError: ``weights`` / ``mask`` of the wrong form.
    """
    w, keep, _ = tokens_of(weights, mask)
    plan = config.plan
    zero = torch.zeros((), dtype=torch.float64, device=w.device)
    truncated = zero
    masked = zero
    tis = [step for step in plan if step.kind in TIS_KINDS]
    if tis:  # compared in the weights' own dtype: the cap as it was stored
        truncated = (keep & (w >= torch.tensor(tis[0].cap, dtype=w.dtype))).sum().double()
    if len(tis) < len(plan):
        masked = (keep & (w == 0)).sum().double()
    w = torch.where(keep, w.double(), 0.0)
    sums = torch.stack([keep.sum().double(), w.sum(), (w * w).sum(), truncated, masked])
    return sums, (w.amax() if w.numel() else zero)


def step_sums(step: CorrectionStep, log_ratio: Tokens, mask: Tokens) -> Tensor:
    """The sums behind one step's own ``correction/<kind>/*`` metrics, for one micro-batch.

    Args:
        step: The step, applied here once more.
        log_ratio: The micro-batch's ``log p_trainer - log p_engine``, padded ``[B, T]`` or packed.
        mask: Its loss mask.

    Returns:
        float64 ``[3]`` on the log-ratios' device: for a TIS step (sum of its weights, loss tokens
        at the cap, loss tokens at or below the lower clip), for a mask step (loss tokens it
        dropped, 0, 0). One evaluation of the step; no host sync.

    Raises:
        ValueError: ``log_ratio`` / ``mask`` of the wrong form.
    """
    values, keep, _ = tokens_of(step.apply(log_ratio, mask), mask)
    if step.kind not in TIS_KINDS:
        zero = torch.zeros((), dtype=torch.float64, device=values.device)
        return torch.stack([(keep & (values == 0)).sum().double(), zero, zero])
    at_cap = keep & (values >= torch.tensor(step.cap, dtype=values.dtype))
    at_floor = torch.zeros_like(keep)
    if step.lower_clip is not None:
        at_floor = keep & (values <= torch.tensor(step.lower_clip, dtype=values.dtype))
    total = torch.where(keep, values.double(), 0.0).sum()
    return torch.stack([total, at_cap.sum().double(), at_floor.sum().double()])


class CorrectionMetrics:
    """The ``correction/*`` metrics of one training step, accumulated over its micro-batches.

    Call `update` once per micro-batch, `compute` once per step (in ``training_step`` or
    ``on_train_batch_end``), then `reset`. Sums stay on device; nothing syncs until the metrics
    are read.

    Args:
        config: The correction whose weights `update` receives (default: none, where the weights
            are the loss mask).
    """

    def __init__(self, config: CorrectionConfig | None = None) -> None:
        self.config = config or CorrectionConfig()
        self.reset()

    def reset(self) -> None:
        """Forget the micro-batches added so far (at the start of each step)."""
        self._sums: Tensor | None = None  # [5 + 3 * steps] float64 on the weights' device
        self._max: Tensor | None = None  # [] float64

    def update(self, weights: Tokens, mask: Tokens, log_ratio: Tokens | None = None) -> None:
        """Adds one micro-batch.

        Args:
            weights: Its combined `correction_weights`, padded ``[B, T]`` or packed.
            mask: Its loss mask.
            log_ratio: Its ``log p_trainer - log p_engine``: with it, each step's own metrics
                too (``correction/<kind>/*``), at the cost of one more evaluation of every step.
                Pass it on every micro-batch of a step or on none.

        Raises:
            ValueError: ``log_ratio`` given on some micro-batches of the step but not others,
                or tensors of the wrong form.
        """
        sums, top = correction_sums(weights, mask, self.config)
        if log_ratio is not None:
            sums = torch.cat(
                [sums, *(step_sums(s, log_ratio, mask).to(sums.device) for s in self.config.plan)]
            )
        if self._sums is None or self._max is None:  # the first micro-batch
            self._sums = sums
            self._max = top
        else:
            if self._sums.shape != sums.shape:
                raise ValueError("update must pass log_ratio on every micro-batch of a step or on none")
            self._sums = self._sums + sums.to(self._sums.device)
            self._max = torch.maximum(self._max, top.to(self._max.device))

    def compute(self, *, sync_dist: bool = False) -> dict[str, Tensor]:
        """The step's metrics so far, as exact ratios of the summed counts.

        Args:
            sync_dist: Sum the counts (and take the max weight) over the default process group
                first: two small collectives every rank must join.

        Returns:
            float64 ``[]`` tensors on the sums' device: ``correction/weight_mean``, ``weight_max``,
            ``ess`` (``(sum w)^2 / (n sum w^2)``), ``truncated_fraction``, ``masked_fraction`` and
            ``loss_tokens``, plus ``correction/<kind>/...`` per step when `update` had the
            log-ratios. Zeros before any `update`. No host sync.
        """
        sums = torch.zeros(5, dtype=torch.float64) if self._sums is None else self._sums.clone()
        top = torch.zeros((), dtype=torch.float64) if self._max is None else self._max.clone()
        if sync_dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        n, total, squares, truncated, masked = sums[:5].unbind(0)
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
        per_step = sums[5:].view(-1, 3)  # [steps, 3]
        for step, (first, second, third) in zip(self.config.plan, per_step.unbind(0), strict=False):
            if step.kind in TIS_KINDS:
                out[f"{step.kind}/weight_mean"] = first / tokens
                out[f"{step.kind}/truncated_fraction"] = second / tokens
                if step.lower_clip is not None:
                    out[f"{step.kind}/lower_clipped_fraction"] = third / tokens
            else:
                out[f"{step.kind}/masked_fraction"] = first / tokens
        return {f"correction/{name}": value for name, value in out.items()}
