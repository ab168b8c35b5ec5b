"""The quiet CPU ``Trainer`` the tests fit with."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

QUIET = {
    "accelerator": "cpu",
    "log_every_n_steps": 1,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def cpu_trainer(**settings: Any) -> pl.Trainer:
    """A CPU ``Trainer`` logging every step, without checkpoints, progress bar or model summary;
    ``settings`` add to or replace those."""
    return pl.Trainer(**(QUIET | settings))
