"""The run's ``lightning.Trainer``, from the ``trainer`` and ``loggers`` groups."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from r3lightning.app.job.build import instantiate_node
from r3lightning.app.job.common import JobError, one_line, plain

__all__ = ["build_trainer", "tensorboard_if_installed", "trainer_kwargs"]


def trainer_kwargs(trainer_cfg: DictConfig) -> dict[str, Any]:
    """The ``trainer`` group as ``lightning.Trainer`` keywords.

    Args:
        trainer_cfg: The ``trainer`` node.

    Returns:
        Its keys and values; a value with a ``_target_`` (a strategy, a plugin) is built.

    Raises:
        JobError: A ``_target_`` value cannot be built; the message names ``trainer.<key>``.
    """
    kwargs = {}
    for key, value in plain(trainer_cfg).items():
        if isinstance(value, dict) and "_target_" in value:
            value = instantiate_node(value, f"trainer.{key}")
        kwargs[key] = value
    return kwargs


def build_trainer(cfg: DictConfig, out_dir: Path, callbacks: list, grad_clip: float | None):
    """The run's ``lightning.Trainer``: ``trainer.*`` over the job's defaults.

    One epoch is one RL step (``max_epochs = steps``), and every epoch reloads its data.

    Args:
        cfg: The job's config (``trainer``, ``loggers``, ``steps``).
        out_dir: The run's directory: the default root and the loggers' ``save_dir``.
        callbacks: Every callback of the run.
        grad_clip: The default ``gradient_clip_val`` (None: no clipping).

    Returns:
        The trainer.

    Raises:
        JobError: A logger cannot be built, or Lightning refuses the keywords.
    """
    import lightning.pytorch as pl
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    kwargs = trainer_kwargs(cfg.trainer)
    if "logger" not in kwargs:  # None entries (tensorboard_if_installed without it) are dropped
        logs = [  # checked by check_config: mappings with a _target_; their own save_dir wins
            instantiate_node({"save_dir": str(out_dir), **plain(node)}, f"loggers[{i}]")
            for i, node in enumerate(cfg.loggers or [])
        ]
        kwargs["logger"] = [logger for logger in logs if logger is not None] or False
    defaults = {
        "gradient_clip_val": grad_clip,
        "default_root_dir": str(out_dir),
        "num_sanity_val_steps": 0,
        "enable_model_summary": False,
    }
    try:
        return pl.Trainer(
            **{**defaults, **kwargs},
            max_epochs=int(cfg.steps),
            reload_dataloaders_every_n_epochs=1,
            callbacks=callbacks,
        )
    except (MisconfigurationException, TypeError, ValueError) as exc:
        raise JobError(f"trainer: {one_line(exc)}") from None


def tensorboard_if_installed(save_dir: str, name: str = "tensorboard", **kwargs: Any):
    """A TensorBoard logger where TensorBoard is installed: the ``loggers`` default, optional.

    Args:
        save_dir: The logs' root directory.
        name: The experiment's subdirectory.
        **kwargs: More ``TensorBoardLogger`` keywords.

    Returns:
        A ``TensorBoardLogger`` if ``tensorboard`` or ``tensorboardX`` can be imported, else
        None (the job then drops the entry).
    """
    if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
        return None
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(save_dir, name=name, **kwargs)
