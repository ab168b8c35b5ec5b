"""Importance-sampling corrections that compose with router replay, and the GRPO loss they weight."""

from r3lightning.correction.importance import (
    MODES,
    CorrectionConfig,
    correction_weights,
    geometric_mask,
    sequence_tis,
    token_mask,
    token_tis,
)
from r3lightning.correction.metrics import CorrectionMetrics

__all__ = ["MODES", "CorrectionConfig", "CorrectionMetrics", "correction_weights", "geometric_mask",
           "sequence_tis", "token_mask", "token_tis"]  # fmt: skip
