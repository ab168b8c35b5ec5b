"""The job config's checks, in two passes: `check_values` builds every settings dataclass
from the composed config and runs the shipped tasks' checks (a bad value is reported before
torch, Lightning, transformers or a model is imported: in about a second), `check_targets` then
imports the ``_target_`` nodes and builds the data module and callbacks once. Each failure is one
`JobError` naming the key. The true/false literals as written are checked
in `r3lightning.app.job.literals`. The table
of moved keys and the one-line form of Hydra's own
composition errors live in `r3lightning.app.job.config_errors` (``MOVED_KEYS`` and `error_line`
are also importable from here)."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from r3lightning.app.job.algorithm import GRPOAdvantages, GRPOConfig
from r3lightning.app.job.common import JobError
from r3lightning.app.job.config_errors import MOVED_KEYS, error_line, moved
from r3lightning.app.job.rollout_settings import launch_settings, launched, server_settings
from r3lightning.app.job.schema import SettingsError, build
from r3lightning.app.job.settings import (
    FLOAT_DTYPES,
    OptimConfig,
    ReplaySettings,
    RolloutSettings,
    RunSettings,
    ServerAddress,
    WeightSyncSettings,
)
from r3lightning.app.serve.config import EngineSettings, ServerLimits
from r3lightning.app.tasks.settings import TASK_CHECKS
from r3lightning.checks import check_setting
from r3lightning.data.options import DataOptions
from r3lightning.rollout.config import AheadConfig, CollectorConfig, RetryPolicy
from r3lightning.rollout.prompts import SamplingConfig

__all__ = [
    "MOVED_KEYS",
    "Settings",
    "check_config",
    "check_layers_held",
    "check_targets",
    "check_values",
    "error_line",
]

_JOB_TRAINER_KEYS = {  # Trainer keywords the job sets itself, and what to use instead
    "max_epochs": "steps (one epoch is one RL step)",
    "reload_dataloaders_every_n_epochs": "nothing: every RL step reloads the data (it is 1)",
    "callbacks": "callbacks.<name>._target_ entries",
}
_ADVANTAGE_KEYS = [f.name for f in dataclasses.fields(GRPOAdvantages)]
_AHEAD_KEYS = [f.name for f in dataclasses.fields(AheadConfig)]
_SYNC_KEYS = [f.name for f in dataclasses.fields(WeightSyncSettings)]


def _resolved_keys(node: DictConfig, keys: list[str]) -> DictConfig:
    """The ``keys`` of ``node`` resolved where they stand, so an interpolation relative to ``node``
    (``weight_sync_dtype: ${.launch.dtype}``) still finds its target."""
    return OmegaConf.create({key: node[key] for key in keys if key in node})


_MODEL_DTYPES = (*FLOAT_DTYPES, "float64")  # the trainer's weights may also be float64 (the engine casts)
_RUN_KEYS = [f.name for f in dataclasses.fields(RunSettings)]


@dataclass(frozen=True)
class Settings:
    """Every settings object of one run's config (what `check_values` built).

    Args:
        run: the top-level keys.
        replay: the ``replay`` group.
        rollout: the ``rollout`` group's own keys (the engine the job talks to).
        address: ``rollout.server.host`` and ``.port``.
        sampling: ``rollout.sampling``.
        collector: ``rollout.collector``.
        retry: ``rollout.retry``.
        engine: ``rollout.server`` but ``host`` and ``port`` (``dtype`` by name: built without
            torch; the job builds the `EngineConfig` from it when it starts the engine).
        limits: ``rollout.limits``.
        grpo: ``algorithm`` but ``std_eps`` and ``optim``.
        advantages: ``algorithm.normalize_std`` and ``algorithm.std_eps``.
        optim: ``algorithm.optim``.
        data_options: ``data.options``.
        ahead: ``rollout.max_staleness``.
        weight_sync: the ``rollout`` group's ``*weight*`` keys.
    """

    run: RunSettings
    replay: ReplaySettings
    rollout: RolloutSettings
    address: ServerAddress
    sampling: SamplingConfig
    collector: CollectorConfig
    retry: RetryPolicy
    engine: EngineSettings
    limits: ServerLimits
    grpo: GRPOConfig
    advantages: GRPOAdvantages
    optim: OptimConfig
    data_options: DataOptions
    ahead: AheadConfig
    weight_sync: WeightSyncSettings


def _absent() -> None:
    return None


def check_values(cfg: DictConfig) -> Settings:
    """Check every value a settings dataclass holds, by building it, and the keys that depend on
    each other; then the values of the nodes the job builds later (`_check_built_later`) and
    ``task.path``.

    Cost: about a second. Imports no torch, Lightning, transformers or model: `arms` runs it on
    every arm of ``compare`` before anything heavy is imported (``rollout.server``'s dtype and
    device are resolved by `check_targets`).

    Args:
        cfg: one run's composed config (one arm of ``compare``).

    Returns:
        What it built.

    Raises:
        JobError: the first refused value (a moved key, a ``???`` left unset, a Trainer keyword
            the job sets, a value a settings class refuses, a missing ``task.path``), naming its key.
    """
    for key in MOVED_KEYS:
        value = OmegaConf.select(cfg, key, default=_absent, throw_on_missing=False)
        if value is not _absent:
            plain = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            raise JobError(moved(key, plain))
    try:  # the first ``???`` (mandatory, unset) key
        without_hydra = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        OmegaConf.to_container(without_hydra, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        raise JobError(f"{exc.full_key} must be set (add {exc.full_key}=... to the command line)") from None
    for key, instead in _JOB_TRAINER_KEYS.items():
        if key in cfg.trainer:
            raise JobError(f"trainer.{key} is set by the job; use {instead}")
    rollout = cfg.rollout
    # the rollout group's keys that belong to other settings classes than RolloutSettings
    groups = ("sampling", "collector", "retry", "server", "limits", "launch", *_AHEAD_KEYS, *_SYNC_KEYS)
    server_keys = [k for k in rollout.server if k not in ("host", "port")]
    try:
        parts = {
            "run": build(RunSettings, OmegaConf.masked_copy(cfg, _RUN_KEYS), ""),
            "replay": build(ReplaySettings, cfg.replay, "replay"),
            "grpo": build(GRPOConfig, cfg.algorithm, "algorithm", skip=("optim", "std_eps")),
            "advantages": build(
                GRPOAdvantages, OmegaConf.masked_copy(cfg.algorithm, _ADVANTAGE_KEYS), "algorithm"
            ),
            "optim": build(OptimConfig, cfg.algorithm.optim, "algorithm.optim"),
            "rollout": build(RolloutSettings, rollout, "rollout", skip=groups),
            "address": build(ServerAddress, rollout.server, "rollout.server", skip=server_keys),
            "sampling": build(SamplingConfig, rollout.sampling, "rollout.sampling"),
            "collector": build(CollectorConfig, rollout.collector, "rollout.collector"),
            "retry": build(RetryPolicy, rollout.retry, "rollout.retry"),
            "limits": build(ServerLimits, rollout.limits, "rollout.limits"),
            "data_options": build(DataOptions, cfg.data.options, "data.options"),
            "ahead": build(AheadConfig, _resolved_keys(rollout, _AHEAD_KEYS), "rollout"),
            "weight_sync": build(WeightSyncSettings, _resolved_keys(rollout, _SYNC_KEYS), "rollout"),
        }
        parts["rollout"].check_engine(launched(rollout))
    except SettingsError as exc:
        raise JobError(str(exc)) from None
    except ValueError as exc:  # check_engine
        raise JobError(f"rollout.{exc}") from None
    if launched(rollout):
        launch_settings(rollout, model="(the job's model)")
    _check_built_later(cfg)
    path = OmegaConf.select(cfg, "task.path")
    if path is not None and not Path(str(path)).expanduser().is_file():
        raise JobError(f"task.path: no such file: {path}")
    try:  # its values by name: a built EngineConfig holds a torch dtype (check_targets builds one)
        engine = build(EngineSettings, rollout.server, "rollout.server", skip=("host", "port"))
    except SettingsError as exc:
        raise JobError(str(exc)) from None
    return Settings(**parts, engine=engine)


def _check_built_later(cfg: DictConfig) -> None:
    """The values of nodes the job builds once the model is built, checked now: a shipped task's
    keywords (`TASK_CHECKS`, its constructor's own check), ``model.dtype`` and
    ``reward.timeout_s`` (the job's bound on each scorer call).

    Raises:
        JobError: The first refused value, naming its key.
    """
    task = OmegaConf.to_container(cfg.task, resolve=True) if OmegaConf.is_dict(cfg.task) else {}
    check = TASK_CHECKS.get(str(task.get("_target_")))
    try:
        if check is not None:  # a user's task checks its own keywords when the job builds it
            accepted = inspect.signature(check).parameters
            check(**{key: value for key, value in task.items() if key in accepted})
        if OmegaConf.is_dict(cfg.reward) and "timeout_s" in cfg.reward:
            check_setting("reward.timeout_s", cfg.reward.timeout_s, low=0, above=True, optional=True)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    dtype = cfg.model.get("dtype") if OmegaConf.is_dict(cfg.model) else None
    if dtype is not None and dtype not in _MODEL_DTYPES:
        raise JobError(f"model.dtype must be one of {list(_MODEL_DTYPES)}, got {dtype!r}")


def check_targets(cfg: DictConfig) -> None:
    """Check that ``rollout.server`` builds as an `EngineConfig` (a torch dtype, a device present
    here), that every ``_target_`` imports, that the trainer's accelerator is present, and that the
    callbacks and the data module build (their own checks run; the objects are dropped).

    Cost: imports torch, Lightning and the targets' modules; builds no model.

    Args:
        cfg: one run's composed config, whose values `check_values` passed.

    Raises:
        JobError: the first problem (``rollout.server.device=cuda:3`` on a machine without it,
            ``trainer.accelerator=gpu`` without a GPU, a target that does not import,
            ``backend=megatron`` without megatron-core, a refused keyword), naming its key.
    """
    import torch

    from r3lightning.app.job import build
    from r3lightning.data.buffer import ReplayBuffer

    server_settings(cfg.rollout)  # the EngineConfig: a torch dtype, a device present here
    gpu = torch.cuda.is_available() or torch.backends.mps.is_available()
    if cfg.trainer.get("accelerator") == "gpu" and not gpu:  # else found only when the Trainer is built
        raise JobError(
            f"trainer.accelerator=gpu but no GPU is visible here; use trainer=cpu, or trainer=cpu_fsdp "
            f"for FSDP2 on CPU processes (got trainer.devices={cfg.trainer.get('devices')!r})"
        )
    targets = [(f"callbacks.{name}", node) for name, node in cfg.callbacks.items() if node is not None]
    targets += [(key, cfg[key]) for key in ("model", "task", "reward", "module", "data")]
    targets += [(f"loggers[{i}]", node) for i, node in enumerate(cfg.loggers or [])]
    for key, node in targets:
        build.target_of(node, key)
    replay = build.replay_callback_settings(cfg)  # (its name in callbacks, its node), or None
    if replay is not None:
        name, node = replay
        if node.get("backend") == "megatron" and not build.megatron_installed():
            raise JobError(
                f"callbacks.{name}.backend=megatron needs megatron-core, which is not installed: "
                f"{build.MEGATRON_HINT}"
            )
    build.build_callbacks(cfg, None, str(cfg.replay.mode))  # their own checks (the backend is built later)
    build.instantiate_node(cfg.data, "data", buffer=ReplayBuffer())  # the data module's own checks


def check_config(cfg: DictConfig) -> Settings:
    """`check_values`, then `check_targets` (see their costs).

    Args:
        cfg: one run's composed config.

    Returns:
        The settings `check_values` built.

    Raises:
        JobError: the first refused value or target, naming its key.
    """
    settings = check_values(cfg)
    check_targets(cfg)
    return settings


def check_layers_held(layers: tuple[int, ...] | None, backend: Any) -> None:
    """Check that ``data.options.layers`` are MoE layers the model's routers hold (once the model
    is built, before any rollout).

    Args:
        layers: ``data.options.layers``; None (every MoE layer) passes.
        backend: the replay backend, whose ``moe_layers`` and ``num_layers`` describe the model; a
            backend without ``moe_layers`` passes.

    Raises:
        JobError: a layer id the model has no router for, with the model's MoE layers.
    """
    held = tuple(getattr(backend, "moe_layers", ()) or ())
    if layers is None or not held:
        return
    stray = [layer for layer in layers if layer not in held]
    if stray:
        total = getattr(backend, "num_layers", "?")
        raise JobError(
            f"data.options.layers {list(layers)}: {stray} are not MoE layers of the model, which has "
            f"{total} decoder layers and routers on {list(held)}"
        )
