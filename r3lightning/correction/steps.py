"""Corrections as a list of steps: at most one TIS weight times any masks (docs/concepts/corrections.md).

``CorrectionConfig(steps=(CorrectionStep("token_tis", cap=2.0), CorrectionStep("veto", floor=1e-3)))``
weights each loss token by the product of its steps' values; ``CorrectionConfig(mode=...)`` is the
single-step form kept from before steps existed."""

from __future__ import annotations

from torch import Tensor

# the settings live in r3lightning.correction.config (the job checks them without torch)
from r3lightning.correction.config import (
    MASK_KINDS,
    MODES,
    STEP_KINDS,
    TIS_KINDS,
    CorrectionConfig,
    CorrectionStep,
)
from r3lightning.correction.importance import Tokens, _like, tokens_of
from r3lightning.packed import PackedTensor

__all__ = [
    "MASK_KINDS",
    "MODES",
    "STEP_KINDS",
    "TIS_KINDS",
    "CorrectionConfig",
    "CorrectionStep",
    "correction_weights",
    "step_values",
]


def correction_weights(log_ratio: Tokens, mask: Tokens, config: CorrectionConfig) -> Tokens:
    """The per-token loss weights of a correction.

    Args:
        log_ratio: ``log p_trainer - log p_engine`` per token: padded ``[B, T]`` or a
            ``PackedTensor`` of ``[]`` rows, computed from the forward the loss uses.
        mask: The loss mask (nonzero on loss tokens), ``log_ratio``'s shape or packed alike.
        config: The correction (its ``plan``).

    Returns:
        The product of the steps' values (no step: the mask as 0/1 weights), in ``log_ratio``'s
        form and dtype, detached, 0 off the mask. One evaluation per step, elementwise products;
        no host sync.

    Raises:
        ValueError: ``log_ratio`` / ``mask`` of the wrong form.
    """
    plan = config.plan
    if not plan:
        _, keep, _ = tokens_of(log_ratio, mask)
        return _like(log_ratio, keep)
    weights = step_values(plan[0].apply(log_ratio, mask))
    for step in plan[1:]:
        weights = weights * step_values(step.apply(log_ratio, mask))  # a 0/1 mask: exact
    return _like(log_ratio, weights)


def step_values(values: Tokens) -> Tensor:
    """The per-token tensor of a step's result.

    Args:
        values: A padded tensor, or a ``PackedTensor``.

    Returns:
        The tensor itself, or the ``PackedTensor``'s ``values`` (``[rows]``).
    """
    return values.values if isinstance(values, PackedTensor) else values
