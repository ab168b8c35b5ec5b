"""Trains one run (one arm, one seed) from its checked config: `train_one`."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from r3lightning.app.job import build
from r3lightning.app.job.build import build_model, instantiate_node
from r3lightning.app.job.common import JobError, is_global_zero
from r3lightning.app.job.store import CONF_DIR, replay_settings  # moved to store: no torch there
from r3lightning.app.job.trainer import build_trainer
from r3lightning.app.job.validate import check_layers_held, check_values
from r3lightning.data.stream import StreamingReplayBuffer
from r3lightning.wire.request import RouteSchema

if TYPE_CHECKING:
    from r3lightning.app.job.rollout_loop import Engine

__all__ = [
    "CONF_DIR",
    "JobError",
    "build_model",
    "is_global_zero",
    "model_runtime",
    "replay_settings",
    "train_one",
]


@contextlib.contextmanager
def model_runtime(model_cfg: DictConfig) -> Iterator[None]:
    """Enters ``model.runtime`` around the run: a context manager the model needs, such as
    megatron-core's process groups.

    Args:
        model_cfg: The ``model`` node; without a ``runtime`` key nothing is entered.

    Raises:
        JobError: The runtime's ``_target_`` cannot be built, or its module needs a package
            that is not installed (megatron-core names its extra).
    """
    node = model_cfg.get("runtime")
    with contextlib.ExitStack() as stack:
        if node is not None:
            try:  # entering imports too: megatron_runtime imports megatron-core there
                stack.enter_context(instantiate_node(node, "model.runtime"))
            except ModuleNotFoundError as exc:
                raise JobError(f"model.runtime: {build.import_problem(exc)}") from None
        yield


_EXPECTED_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\).*",  # Lightning's own deprecated pytree call
    r"Checkpoint directory .* exists and is not empty",  # resuming into the same folder
    r".*overridden `on_after_batch_transfer`.*",  # the GRPO module's paired mismatch (intended)
)


def train_one(cfg: DictConfig, out_dir: Path, engine: Engine) -> list[dict[str, float]]:
    """Trains one run (one arm, one seed) from its checked config.

    Builds the model, replay backend, task, buffer, data module, GRPO module, rollout loop and
    ``Trainer``, then fits; with ``resume`` set, a run directory holding a ``last.ckpt``
    continues from it.

    Args:
        cfg: The run's checked config (one arm of `arms`, its ``seed`` set).
        out_dir: The run's directory: ``metrics.csv``, checkpoints and logs.
        engine: Where rollouts come from and how weights reach it (`embedded_server`).

    Returns:
        The run's history: one ``{metric: value}`` record per RL step, as in ``metrics.csv``.

    Raises:
        JobError: A part cannot be built, a checkpoint does not fit, or every group of a step
            was dropped (exit status 2).
        RemoteGenerateError: The engine failed every group of a step (exit status 3).
        KeyboardInterrupt: The run was interrupted (Ctrl-C); its last checkpoint stays.
    """
    import lightning.pytorch as pl

    from r3lightning.app.job.checkpoint import RunCheckpoint, refuse_bad_data_state, resume_checkpoint
    from r3lightning.app.job.rollout_loop import rollout_failure, rollout_loop
    from r3lightning.rollout.stats import GroupsDroppedError

    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    model = build_model(cfg.model, trainer=True)
    mode = str(cfg.replay.mode)
    backend = build.replay_backend(cfg, model)
    missing = str(cfg.rollout.get("missing_rows", "error"))
    schema = RouteSchema(backend.num_layers, backend.top_k, backend.num_experts, missing_rows=missing)
    model_config = getattr(model, "config", None)  # a Hugging Face-style config, where the model has one
    vocab_size = cfg.task.get("vocab_size") or getattr(model_config, "vocab_size", None)
    task = build.build_task(cfg, vocab_size)
    settings = check_values(cfg)
    grpo = settings.grpo
    optim = settings.optim
    check_layers_held(settings.data_options.layers, backend)
    buffer = StreamingReplayBuffer(
        settings.ahead.ahead, vocab_size=vocab_size, num_experts=schema.num_experts
    )
    datamodule = instantiate_node(cfg.data, "data", buffer=buffer)
    extra = {"model": model, "grpo": grpo, "optim": optim, "recompute_old_logprobs": mode == "r2"}
    if cfg.model.get("sharded_weights") is not None:  # a meta-device model: the module loads its shards
        extra["sharded_weights"] = str(cfg.model.sharded_weights)
    module = instantiate_node(cfg.module, "module", **extra)
    if not isinstance(module, pl.LightningModule):
        raise JobError(f"module._target_ must build a LightningModule, got {type(module).__name__}")
    out_dir.mkdir(parents=True, exist_ok=True)
    loop = rollout_loop(cfg, engine, task, schema, buffer, metrics_path=out_dir / "metrics.csv")
    callbacks = [*build.build_callbacks(cfg, backend, mode), loop, RunCheckpoint(out_dir, cfg)]
    trainer = build_trainer(cfg, out_dir, callbacks, optim.grad_clip)
    ckpt_path = resume_checkpoint(cfg, out_dir, module)
    if ckpt_path is not None:
        refuse_bad_data_state(datamodule, ckpt_path)
    if ckpt_path is not None and is_global_zero():
        print(f"resuming {out_dir.name} from {ckpt_path}")
    with warnings.catch_warnings():
        for message in _EXPECTED_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        if trainer.world_size == 1:  # a process group of one (megatron's runtime) has nothing to sync
            warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\(.*sync_dist=True")
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        except GroupsDroppedError as exc:  # raised by the rollout worker, at the trainer's next step
            raise rollout_failure(exc) from None
        except SystemExit:  # Lightning turns Ctrl-C into a graceful shutdown and exit status 1
            if trainer.interrupted:
                raise KeyboardInterrupt from None
            raise
    if trainer.interrupted:
        raise KeyboardInterrupt
    return loop.history
