"""Importance-sampling corrections that compose with router replay: per-token weights and masks
of `log p_trainer - log p_engine`, their combination as steps, and their metrics."""

from r3lightning.correction.importance import (
    geometric_mask,
    k3_mask,
    sequence_tis,
    token_mask,
    token_tis,
    veto_mask,
)
from r3lightning.correction.metrics import CorrectionMetrics
from r3lightning.correction.steps import (
    MODES,
    STEP_KINDS,
    CorrectionConfig,
    CorrectionStep,
    correction_weights,
)

__all__ = [
    "MODES",
    "STEP_KINDS",
    "CorrectionConfig",
    "CorrectionMetrics",
    "CorrectionStep",
    "correction_weights",
    "geometric_mask",
    "k3_mask",
    "sequence_tis",
    "token_mask",
    "token_tis",
    "veto_mask",
]
