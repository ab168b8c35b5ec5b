"""The job config's checks, in two passes: `check_values` builds every settings dataclass
from the composed config and runs the shipped tasks' checks (a bad value is reported before
torch, Lightning, transformers or a model is imported: in about a second), `check_targets` then
imports the ``_target_`` nodes and builds the data module and callbacks once. Each failure is one
`JobError` naming the key. Also `check_bool_overrides` (a true/false key takes only ``true`` or
``false`` on the command line), the one table of moved keys, and the one-line form of Hydra's
own composition errors."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from r3lightning.app.job.algorithm import GRPOAdvantages, GRPOConfig
from r3lightning.app.job.common import JobError
from r3lightning.app.job.rollout_settings import launch_settings, launched
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
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.tasks.settings import TASK_CHECKS
from r3lightning.checks import check_setting
from r3lightning.data.options import DataOptions
from r3lightning.rollout.config import AheadConfig, CollectorConfig, RetryPolicy
from r3lightning.rollout.prompts import SamplingConfig

__all__ = [
    "MOVED_KEYS",
    "Settings",
    "check_bool_overrides",
    "check_config",
    "check_targets",
    "check_values",
    "error_line",
]

# Keys that moved: old -> (new, how to set it when the value does not carry over as it is)
MOVED_KEYS: dict[str, tuple[str, str | None]] = {
    "rollout.request_timeout_s": ("rollout.retry.timeout_s", None),
    "rollout.max_in_flight": ("rollout.collector.max_in_flight", None),
    "data.shard": ("data.options.shard", None),
    "data.pad_token_id": ("data.options.pad_token_id", None),
    "data.width_multiple": ("data.options.width_multiple", None),
    "data.layers": ("data.options.layers", None),
    "data.eval_buffer": ("data.options.eval_buffer", "an R3DataModule built in Python takes it"),
    "task.prompt_key": ("task.columns.prompt", None),
    "task.data_source_key": ("task.columns.data_source", None),
    "task.ground_truth_key": ("task.columns.ground_truth", None),
    "task.extra_info_key": ("task.columns.extra_info", None),
    "callbacks.router_replay.log_per_layer": (
        "callbacks.router_replay.log_agreement",
        "per_layer (totals and each layer), true (totals) or false",
    ),
    "callbacks.router_replay.pad_to_multiple": (
        "callbacks.router_replay.layout_fn",
        "{_target_: r3lightning.align.layout.TokenMetadataLayout.padded, _partial_: true, pad_to_multiple: N}",
    ),
}
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
_OMEGACONF_TYPES = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}


def _yaml(value: Any) -> str:
    """``value`` as it is written on the command line (``true``, ``null``, ``[1, 2]``)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, list | tuple):
        return f"[{','.join(_yaml(v) for v in value)}]"
    return str(value)


def moved(key: str, value: Any = None, *, known: bool = True) -> str:
    """The message for the moved ``key`` set to ``value`` (``known=False``: the value is not known)."""
    new, how = MOVED_KEYS[key]
    if how is not None:
        return f"{key} moved to {new}; set {new} to {how}"
    shown = _yaml(value) if known else "..."
    return f"{key} moved to {new}; set {new}={shown} instead"


def _omegaconf_line(exc: BaseException) -> str:
    """``key must be ..., got ...`` (or ``key: problem``) from an OmegaConf error."""
    text = str(exc).split("\n    full_key:")[0]
    key = getattr(exc, "full_key", None) or ""
    found = re.fullmatch(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", text, re.S)
    if key in MOVED_KEYS:
        return moved(key, known=False)
    if found and found.group(3) in _OMEGACONF_TYPES:
        got = repr(found.group(1)) if found.group(2) == "str" else found.group(1)
        return f"{key} must be {_OMEGACONF_TYPES[found.group(3)]}, got {got}"
    schema = re.fullmatch(r"Key '(\w+)' not in '(\w+)'", text)
    if schema:
        return f"{key} is not a setting of {schema.group(2)} (a typo, or a key of another group?)"
    if re.fullmatch(r"Invalid value assigned: \w+ is not a ListConfig, list or tuple\.", text):
        return f"{key} must be a list, got {_yaml(getattr(exc, 'value', '?'))}"
    if re.fullmatch(r"Cannot assign \w+ to Dict\[.*\]", text):
        return f"{key} must be a mapping, got {_yaml(getattr(exc, 'value', '?'))}"
    if re.fullmatch(r"field '[\w.\[\]]+' is not Optional", text):
        return f"{key} must not be null"
    found = re.fullmatch(r"Invalid type assigned: \w+ is not a subclass of (\w+)\. value: (.*)", text, re.S)
    if found:
        return f"{key} must be a mapping of {found.group(1)} settings, got {found.group(2)}"
    found = re.fullmatch(r"Value '(.*)' is not a valid bool \(type \w+\)", text, re.S)
    if found:
        return f"{key} must be true or false, got {found.group(1)!r}"
    return f"{key}: {text}" if key else text


def error_line(exc: BaseException) -> str:
    """One line for a Hydra composition error or an OmegaConf error: the key, what is wrong, and
    for a moved key where it went (never Hydra's ``+key`` hint for it)."""
    cause = exc.__cause__
    text = str(exc)
    appended = re.search(r"To append to your config use \+([\w.]+)=(.*)$", text, re.S)
    if appended and appended.group(1) in MOVED_KEYS:
        return moved(appended.group(1), appended.group(2).strip())
    if cause is not None and getattr(cause, "full_key", None):
        line = _omegaconf_line(cause)
        typed = getattr(cause, "object_type", None) not in (None, dict)  # a schema node: no new keys
        return line if appended is None or typed else f"{line}; add a new key with +{appended.group(1)}=..."
    if getattr(exc, "full_key", None):
        return _omegaconf_line(exc)
    text = text.split("Config search path")[0].split("full_key:")[0]
    return " ".join(text.replace(":\n\t", ": ").replace("\n\t", ", ").split())


@dataclass(frozen=True)
class Settings:
    """Every settings object of one run's config (what `check_values` built)."""

    run: RunSettings
    replay: ReplaySettings
    rollout: RolloutSettings
    address: ServerAddress
    sampling: SamplingConfig
    collector: CollectorConfig
    retry: RetryPolicy
    engine: EngineConfig
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
    """Every value a settings dataclass holds, checked by building it, and the keys that depend on
    each other. Imports no Lightning, transformers or model, and torch only once every value but
    a good ``rollout.server`` passed (its ``EngineConfig`` holds a torch dtype); returns what it built.

    Raises:
        JobError: the first refused value, naming its key.
    """
    for key in MOVED_KEYS:
        value = OmegaConf.select(cfg, key, default=_absent, throw_on_missing=False)
        if value is not _absent:
            raise JobError(moved(key, OmegaConf.to_container(value) if OmegaConf.is_config(value) else value))
    try:  # the first ``???`` (mandatory, unset) key
        OmegaConf.to_container(
            OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), throw_on_missing=True
        )
    except MissingMandatoryValue as exc:
        raise JobError(f"{exc.full_key} must be set (add {exc.full_key}=... to the command line)") from None
    for key, instead in _JOB_TRAINER_KEYS.items():
        if key in cfg.trainer:
            raise JobError(f"trainer.{key} is set by the job; use {instead}")
    rollout = cfg.rollout
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
    try:  # last: a built EngineConfig holds a torch dtype, so a good one imports torch
        engine = build(EngineConfig, rollout.server, "rollout.server", skip=("host", "port"))
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


def check_bool_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Every command-line value of a true/false setting is ``true`` or ``false``. OmegaConf turns
    ``plot=1`` or ``plot=yes`` into true; Hydra's own override parser tells what was written (the
    integer 1, the string ``yes``), so a value that is not a boolean literal is refused. Each value
    of a sweep (``plot=true,1``) is checked.

    Args:
        cfg: The composed config: a key whose value is a bool there is a true/false setting.
        overrides: The command line's overrides (``hydra.overrides.task``).

    Raises:
        JobError: The first such override, naming its key and value.
    """
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if override.is_delete() or not isinstance(OmegaConf.select(cfg, key, default=None), bool):
            continue
        try:
            values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        except Exception:  # an interval sweep has no values to list: its sweeper's range is numeric
            values = [override.value()]
        for value in values:
            if not isinstance(value, bool):
                raise JobError(f"{key} must be true or false, got {value!r}")


def check_targets(cfg: DictConfig) -> None:
    """Every ``_target_`` importable, the trainer's accelerator present, the callbacks and the data
    module built once (their own checks). Imports Lightning and the targets' modules.

    Raises:
        JobError: the first problem, naming its key.
    """
    import torch

    from r3lightning.app.job import build
    from r3lightning.data.buffer import ReplayBuffer

    gpu = torch.cuda.is_available() or torch.backends.mps.is_available()
    if cfg.trainer.get("accelerator") == "gpu" and not gpu:  # else found only when the Trainer is built
        raise JobError(
            f"trainer.accelerator=gpu but no GPU is visible here; use trainer=cpu, or trainer=cpu_fsdp "
            f"for FSDP2 on CPU processes (got trainer.devices={cfg.trainer.get('devices')!r})"
        )
    targets = [(f"callbacks.{name}", node) for name, node in cfg.callbacks.items() if node is not None]
    targets += [(key, cfg[key]) for key in ("model", "task", "reward", "module", "data")]
    for key, node in targets + [(f"loggers[{i}]", node) for i, node in enumerate(cfg.loggers or [])]:
        build.target_of(node, key)
    replay = build.replay_callback_settings(cfg)
    if replay is not None and replay[1].get("backend") == "megatron" and not build.megatron_installed():
        raise JobError(
            f"callbacks.{replay[0]}.backend=megatron needs megatron-core, which is not installed: {build.MEGATRON_HINT}"
        )
    build.build_callbacks(cfg, None, str(cfg.replay.mode))  # their own checks (the backend is built later)
    build.instantiate_node(cfg.data, "data", buffer=ReplayBuffer())  # the data module's own checks


def check_config(cfg: DictConfig) -> Settings:
    """`check_values`, then `check_targets`; returns the settings."""
    settings = check_values(cfg)
    check_targets(cfg)
    return settings


def check_layers_held(layers: tuple[int, ...] | None, backend: Any) -> None:
    """``data.options.layers`` must be MoE layers the model's routers hold (checked once the model
    is built, before any rollout).

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
