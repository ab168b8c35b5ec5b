"""Importance-sampling corrections that compose with router replay: per-token weights and masks
of `log p_trainer - log p_engine`, their combination as steps, and their metrics.

Names resolve on first use, so the job reads ``CorrectionConfig`` (``r3lightning.correction.config``,
its config schema) without importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from r3lightning._lazy import LazyExports

# ruff: noqa: F401
if TYPE_CHECKING:  # the one list of public names: type checkers read it, LazyExports parses it
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

_EXPORTS = LazyExports(globals(), __file__)
__all__ = _EXPORTS.names
__getattr__ = _EXPORTS.getattr
__dir__ = _EXPORTS.dir
