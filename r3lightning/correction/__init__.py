"""Importance-sampling corrections that compose with router replay: per-token weights and masks
of `log p_trainer - log p_engine`, their combination as steps, and their metrics.

Names resolve on first use, so the job reads ``CorrectionConfig`` (``r3lightning.correction.config``,
its config schema) without importing torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from r3lightning.correction.config import MODES, STEP_KINDS, CorrectionConfig, CorrectionStep
    from r3lightning.correction.importance import (
        geometric_mask,
        k3_mask,
        sequence_tis,
        token_mask,
        token_tis,
        veto_mask,
    )
    from r3lightning.correction.metrics import CorrectionMetrics
    from r3lightning.correction.steps import correction_weights

_MODULES = {
    "MODES": "config",
    "STEP_KINDS": "config",
    "CorrectionConfig": "config",
    "CorrectionMetrics": "metrics",
    "CorrectionStep": "config",
    "correction_weights": "steps",
    "geometric_mask": "importance",
    "k3_mask": "importance",
    "sequence_tis": "importance",
    "token_mask": "importance",
    "token_tis": "importance",
    "veto_mask": "importance",
}
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


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
