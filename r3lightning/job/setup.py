"""Checks the main job's config and builds a run's pieces, each from its ``_target_``.

What the job builds itself and passes on (everything else comes from the config as it is): the
``ReplayBuffer`` (the data module's ``buffer``: it needs the model's vocabulary and expert
count); the replay backend named by the replay callback's ``backend`` key (``hf`` /
``megatron``), with ``mode`` = ``replay.mode``; the model (``model._target_``; on the meta device
when ``model.sharded_weights`` is set, the module then loads each FSDP2 rank's shards), passed to
the LightningModule with ``grpo`` and ``optim`` from ``algorithm`` and ``recompute_old_logprobs``
(``replay=r2``); and the ``Trainer``'s ``max_epochs`` (= ``steps``: one epoch is one RL step),
``reload_dataloaders_every_n_epochs=1`` and ``callbacks`` (refused under ``trainer.*``). Any
other ``trainer.*`` key goes to ``Trainer`` as it is, and wins over the job's ``logger`` (the
``loggers`` list), ``gradient_clip_val`` (``algorithm.optim.grad_clip``), ``default_root_dir``,
``num_sanity_val_steps=0`` and ``enable_model_summary=false``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from r3lightning.job.build import (
    MEGATRON_HINT,
    dataclass_from,
    import_problem,
    instantiate_node,
    one_line,
    plain,
    target_of,
)
from r3lightning.job.common import JobError, is_global_zero

if TYPE_CHECKING:
    from r3lightning.job.rollout_loop import Engine

__all__ = ["CONF_DIR", "JobError", "build_model", "check_config", "is_global_zero", "train_one"]

# A wheel carries the configs inside the package (setup.py copies them at build time); a source
# checkout or an editable install reads the repository's top-level conf/.
_PACKAGED_CONF = Path(__file__).resolve().parents[1] / "conf"
CONF_DIR = _PACKAGED_CONF if _PACKAGED_CONF.is_dir() else Path(__file__).resolve().parents[2] / "conf"

_EMBEDDED_PROTOCOLS = ("skyrl", "sglang")  # what the embedded engine speaks
# Trainer keywords the job must set itself: the key, and what to use instead
_JOB_TRAINER_KEYS = {
    "max_epochs": "steps (one epoch is one RL step)",
    "reload_dataloaders_every_n_epochs": "nothing: every RL step reloads the data (it is 1)",
    "callbacks": "callbacks.<name>._target_ entries",
}

# ${product:a,b} in conf/config.yaml (e.g. the batch size of one whole RL step)
OmegaConf.register_new_resolver("product", lambda a, b: int(a) * int(b), replace=True)

# ---------------------------------------------------------------------------- validation

Rule = tuple[str, Callable[[Any], bool]]  # (what the value must be, the check)


def _integer(low: int, high: int | None = None) -> Rule:
    text = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    return text, lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= (high or v)


def _number(low: float, *, strict: bool = True, high: float | None = None) -> Rule:
    text = (
        f"a number {'>' if strict else '>='} {low:g}" if high is None else f"a number in [{low:g}, {high:g}]"
    )

    def ok(v: Any) -> bool:
        real = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        return real and (v > low if strict else v >= low) and (high is None or v <= high)

    return text, ok


def _null(rule: Rule) -> Rule:
    return f"{rule[0]} or null", lambda v: v is None or rule[1](v)


def _one_of(*options: str) -> Rule:
    return f"one of {list(options)}", lambda v: v in options


_BOOL: Rule = ("true or false", lambda v: isinstance(v, bool))
_DTYPE: Rule = (
    "a floating torch dtype name (float32, bfloat16, float16)",
    lambda v: (
        isinstance(getattr(torch, str(v), None), torch.dtype) and getattr(torch, str(v)).is_floating_point
    ),
)
# Every value the job reads itself, checked where present before anything is built. Values that
# go to a _target_ are checked by it: the data module is built once here, the rest at their build.
_RULES: dict[str, Rule] = {
    "seed": _integer(0, 2**32 - 1),  # Lightning's seed_everything range
    "steps": _integer(1),
    "prompts_per_step": _integer(1),
    "reward_threads": _integer(0),
    "resume": _BOOL,
    "plot": _BOOL,
    "reward.timeout_s": _null(_number(0)),
    "task.vocab_size": _null(_integer(1)),
    "task.num_classes": _integer(2),
    "task.prompt_length": _integer(1),
    "task.response_length": _integer(1),
    "task.first_token": _integer(0),
    "task.max_prompt_length": _integer(1),
    "task.overlong": _one_of("drop", "truncate_left", "truncate_right"),
    "task.shuffle": _BOOL,
    "model.dtype": _DTYPE,
    "replay.mode": _one_of("r3", "r2", "off"),
    "replay.request_routes": _BOOL,
    "replay.strict": _null(_BOOL),
    "compare": (
        "a list of replay modes ['r3', 'r2', 'off']",
        lambda v: all(m in ("r3", "r2", "off") for m in v),
    ),
    "rollout.protocol": _one_of("skyrl", "vllm", "sglang", "openai"),
    "rollout.url": (
        "null (embedded engine), http(s)://host:port or a list of them",
        lambda v: (
            v is None or (v != [] and all(str(u).startswith(("http://", "https://")) for u in _as_list(v)))
        ),
    ),
    "rollout.require_url": _BOOL,
    "rollout.request_timeout_s": _number(0),
    "rollout.max_in_flight": _integer(1),
    "rollout.sync_weights": _BOOL,
    "rollout.server.port": _integer(0, 65535),
    "rollout.server.dtype": _DTYPE,
    "rollout.server.max_batch_size": _integer(1),
    "rollout.server.simulated_disagreement": _null(_number(0, high=1)),
    "algorithm.group_size": _integer(2),
    "algorithm.clip_low": _number(0),
    "algorithm.clip_high": _number(0),
    "algorithm.std_eps": _number(0),
    "algorithm.ratio_band": _number(1, strict=False),
    "algorithm.mismatch_every_n_steps": _integer(0),
    "algorithm.optim.lr": _number(0),
    "algorithm.optim.weight_decay": _number(0, strict=False),
    "algorithm.optim.betas": ("two numbers in [0, 1)", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v)),
    "algorithm.optim.grad_clip": _null(_number(0)),
}
_ABSENT = object()


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, list | tuple | ListConfig) else [value]


def _check_rules(cfg: DictConfig, rules: dict[str, Rule]) -> None:
    for key, (expected, ok) in rules.items():
        value = plain(OmegaConf.select(cfg, key, default=_ABSENT))
        if value is _ABSENT:
            continue
        try:
            good = ok(value)
        except (TypeError, ValueError):
            good = False
        if not good:
            raise JobError(f"{key} must be {expected}, got {value!r}")


def _missing_key(values: Any, prefix: str) -> str | None:
    """The first ``???`` (mandatory, unset) key of a config's plain, unresolved values."""
    for key, value in values.items() if isinstance(values, dict) else enumerate(values):
        found = (prefix + str(key)) if value == "???" else None
        if found is None and isinstance(value, dict | list):
            found = _missing_key(value, f"{prefix}{key}.")
        if found is not None:
            return found
    return None


def replay_callback_settings(cfg: DictConfig) -> tuple[str, DictConfig] | None:
    """``(name, node)`` of the ``callbacks`` entry building a ``RouterReplayCallback`` (None if removed)."""
    from r3lightning.replay.callback import RouterReplayCallback

    for name, node in cfg.callbacks.items():
        target = None if node is None else target_of(node, f"callbacks.{name}")
        if isinstance(target, type) and issubclass(target, RouterReplayCallback):
            return str(name), node
    return None


def _megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no parent package, or one set to None in sys.modules
        return False


def check_config(cfg: DictConfig) -> None:
    """Reject bad values before anything is built: one :class:`JobError` naming the key and what
    it expects. Cost: imports the ``_target_`` modules and builds the data module once."""
    from r3lightning.correction.grpo import GRPOConfig
    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.job.module import OptimConfig
    from r3lightning.rollout.prompts import SamplingConfig

    _check_rules(cfg, _RULES)
    missing = _missing_key(OmegaConf.to_container(cfg, resolve=False), "")
    if missing is not None:
        raise JobError(f"{missing} must be set (add {missing}=... to the command line)")
    for key in _JOB_TRAINER_KEYS:
        if key in cfg.trainer:
            raise JobError(f"trainer.{key} is set by the job; use {_JOB_TRAINER_KEYS[key]}")
    dataclass_from(GRPOConfig, cfg.algorithm, "algorithm", skip=("optim",))
    dataclass_from(OptimConfig, cfg.algorithm.optim, "algorithm.optim")
    dataclass_from(SamplingConfig, cfg.rollout.sampling, "rollout.sampling")
    if cfg.rollout.url is None and cfg.rollout.protocol not in _EMBEDDED_PROTOCOLS:
        raise JobError(
            f"rollout.protocol={cfg.rollout.protocol} needs rollout.url (the engine's http://host:port); "
            f"the embedded engine speaks {list(_EMBEDDED_PROTOCOLS)}"
        )
    if cfg.rollout.url is None and cfg.rollout.require_url:
        raise JobError("rollout.url must be set to the engine's http://host:port (rollout.require_url=true)")
    path = OmegaConf.select(cfg, "task.path")
    if path is not None and not Path(str(path)).expanduser().is_file():
        raise JobError(f"task.path: no such file: {path}")
    # before a checkpoint is loaded: Lightning would only find out when building the Trainer
    if cfg.trainer.get("accelerator") == "gpu" and not (
        torch.cuda.is_available() or torch.backends.mps.is_available()
    ):
        raise JobError(
            f"trainer.accelerator=gpu but no GPU is visible here; use trainer=cpu, or trainer=cpu_fsdp "
            f"for FSDP2 on CPU processes (got trainer.devices={cfg.trainer.get('devices')!r})"
        )
    if cfg.loggers is not None and not OmegaConf.is_list(cfg.loggers):
        raise JobError(
            f"loggers must be a list of {{_target_: ...}} entries (or null), got {plain(cfg.loggers)!r}"
        )
    targets = [(f"callbacks.{name}", node) for name, node in cfg.callbacks.items() if node is not None]
    targets += [(key, cfg[key]) for key in ("model", "task", "reward", "module", "data")]
    for key, node in targets + [(f"loggers[{i}]", node) for i, node in enumerate(cfg.loggers or [])]:
        target_of(node, key)
    replay = replay_callback_settings(cfg)
    if replay is not None and replay[1].get("backend") == "megatron" and not _megatron_installed():
        raise JobError(
            f"callbacks.{replay[0]}.backend=megatron needs megatron-core, which is not installed: {MEGATRON_HINT}"
        )
    if replay is not None:  # the callback reads it only at the first training batch, far from here
        _check_rules(cfg, {f"callbacks.{replay[0]}.pad_to_multiple": _integer(1)})
    instantiate_node(cfg.data, "data", buffer=ReplayBuffer())  # the data module's own checks


def replay_settings(cfg: DictConfig, mode: str) -> DictConfig:
    """``cfg`` with the ``replay`` group swapped for ``conf/replay/<mode>.yaml``."""
    path = CONF_DIR / "replay" / f"{mode}.yaml"
    if not path.exists():
        raise JobError(f"no replay config for mode {mode!r} ({path})")
    out = OmegaConf.merge(cfg, {"replay": OmegaConf.load(path)})
    assert isinstance(out, DictConfig)
    return out


# ---------------------------------------------------------------------------- model and task


@contextlib.contextmanager
def model_runtime(model_cfg: DictConfig) -> Iterator[None]:
    """The process setup the model needs around the whole run (``model.runtime``: a ``_target_``
    returning a context manager, e.g. megatron-core's process group and device shims)."""
    node = model_cfg.get("runtime")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(
                contextlib.nullcontext() if node is None else instantiate_node(node, "model.runtime")
            )
        except ModuleNotFoundError as exc:
            raise JobError(f"model.runtime: {import_problem(exc)}") from None
        yield


def build_model(model_cfg: DictConfig, *, trainer: bool = False) -> torch.nn.Module:
    """The policy from ``model._target_`` (its keys but ``runtime`` and ``sharded_weights`` are the
    factory's keywords). ``trainer=True`` with ``sharded_weights`` set: ``model.path``'s model
    with parameters on the meta device, for FSDP2 ranks that read only their shards (an embedded
    engine needs weights, so it builds from the factory)."""
    values = plain(model_cfg)
    values.pop("runtime", None)
    if trainer and values.pop("sharded_weights", None) is not None:
        path = Path(str(values.get("path"))).expanduser()
        if values.get("path") is None or not (path / "config.json").is_file():
            raise JobError(
                f"model.sharded_weights needs model.path: a checkpoint directory with a config.json, got {values.get('path')}"
            )
        from r3lightning.job.models import torch_dtype
        from r3lightning.job.sharded import meta_model

        return meta_model(path, dtype=torch_dtype(values.get("dtype", "float32"), "model.dtype"))
    values.pop("sharded_weights", None)
    model = instantiate_node(values, "model")
    if not isinstance(model, torch.nn.Module):
        raise JobError(
            f"model._target_ {values['_target_']!r} must return a torch.nn.Module, got {type(model).__name__}"
        )
    return model


def replay_backend(cfg: DictConfig, model: torch.nn.Module):
    """The router replay backend of ``model`` named by the replay callback's ``backend`` key."""
    from r3lightning.replay.hf.replay import HFRouterReplay

    replay = replay_callback_settings(cfg)
    kind = "hf" if replay is None else replay[1].get("backend", "hf")
    try:
        if kind == "megatron":
            from r3lightning.replay.megatron.replay import MegatronRouterReplay

            own = getattr(model, "router_replay_backend", None)
            return own() if callable(own) else MegatronRouterReplay(model, validate=False)
        if kind in ("hf", None):
            return HFRouterReplay.for_model(model)
    except (TypeError, ValueError, LookupError) as exc:
        hint = " (a Hugging Face model: use callbacks=router_replay)"
        if kind != "megatron":
            megatron = callable(getattr(model, "router_replay_backend", None))
            hint = (
                " (this model routes with megatron-core: use callbacks=router_replay_megatron)"
                if megatron
                else ""
            )
        raise JobError(f"callbacks.router_replay.backend={kind}: {one_line(exc)}{hint}") from None
    raise JobError(f"callbacks.router_replay.backend must be hf or megatron, got {kind!r}")


def build_task(cfg: DictConfig, vocab_size: int | None):
    """The task (``task._target_``) with its reward (``reward._target_``; ``reward.timeout_s``
    bounds each scorer call)."""
    from r3lightning.rollout.tasks import ScoredTask

    extra = {}
    if "vocab_size" in cfg.task and cfg.task.vocab_size is None:
        if vocab_size is None:
            raise JobError("task.vocab_size must be set: the model has no config.vocab_size")
        extra["vocab_size"] = vocab_size
    prompts = instantiate_node(cfg.task, "task", **extra)
    reward = plain(cfg.reward)
    timeout_s = reward.pop("timeout_s", 60.0)
    try:
        return ScoredTask(prompts, instantiate_node(reward, "reward"), timeout_s=timeout_s)
    except (TypeError, ValueError) as exc:
        raise JobError(f"reward.{exc}" if str(exc).startswith("timeout_s") else str(exc)) from None


# ---------------------------------------------------------------------------- trainer


def _trainer_kwargs(trainer_cfg: DictConfig) -> dict[str, Any]:
    """``trainer.*`` as ``Trainer`` keywords; values with a ``_target_`` (strategy, plugins, a
    logger, ...) are instantiated."""
    kwargs = plain(trainer_cfg)
    for key, value in kwargs.items():
        if isinstance(value, dict) and "_target_" in value:
            kwargs[key] = instantiate_node(value, f"trainer.{key}")
    return kwargs


def _callbacks(cfg: DictConfig, backend, mode: str) -> list:
    """The ``callbacks`` dict, in order (``null`` drops an entry); the replay callback gets the
    job's backend and mode, and ``strict`` from ``replay.strict`` when set (null: strict for r3
    with an external engine, which must return routes, else the callback's own ``strict``)."""
    replay = replay_callback_settings(cfg)
    out = []
    for name, node in cfg.callbacks.items():
        if node is None:
            continue
        extra: dict[str, Any] = {}
        if replay is not None and name == replay[0]:
            extra = {"backend": backend, "mode": mode}
            strict = cfg.replay.get("strict")
            if strict is None and cfg.rollout.url is not None and mode == "r3":
                strict = True  # an external engine without routes is misconfigured: never train natively
            if strict is not None:
                extra["strict"] = bool(strict)
        values = plain(node)
        values.pop("backend", None)  # built by the job from this key
        out.append(instantiate_node(values, f"callbacks.{name}", **extra))
    return out


def build_trainer(cfg: DictConfig, out_dir: Path, callbacks: list, grad_clip: float | None):
    import lightning.pytorch as pl
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    kwargs = _trainer_kwargs(cfg.trainer)
    if "logger" not in kwargs:  # the loggers list (save_dir: the run's folder; None entries dropped)
        loggers = [
            instantiate_node(
                node, f"loggers[{i}]", **({} if "save_dir" in node else {"save_dir": str(out_dir)})
            )
            for i, node in enumerate(cfg.loggers or [])
        ]
        kwargs["logger"] = [logger for logger in loggers if logger is not None] or False
    defaults = {"gradient_clip_val": grad_clip, "default_root_dir": str(out_dir), "num_sanity_val_steps": 0}
    kwargs = {**defaults, "enable_model_summary": False, **kwargs}
    try:
        return pl.Trainer(
            **kwargs, max_epochs=int(cfg.steps), reload_dataloaders_every_n_epochs=1, callbacks=callbacks
        )
    except (MisconfigurationException, TypeError, ValueError) as exc:
        raise JobError(f"trainer: {one_line(exc)}") from None


# ---------------------------------------------------------------------------- one run


def train_one(cfg: DictConfig, out_dir: Path, engine: Engine) -> list[dict[str, float]]:
    """Train one run (one replay mode) into ``out_dir``; returns its per-step history."""
    import lightning.pytorch as pl

    from r3lightning.correction.grpo import GRPOConfig
    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.job.checkpoint import RunCheckpoint, resume_checkpoint
    from r3lightning.job.module import OptimConfig
    from r3lightning.job.rollout_loop import on_policy_loop
    from r3lightning.wire.request import RouteSchema

    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    model = build_model(cfg.model, trainer=True)
    mode = str(cfg.replay.mode)
    backend = replay_backend(cfg, model)
    schema = RouteSchema(backend.num_layers, backend.top_k, backend.num_experts)
    vocab_size = cfg.task.get("vocab_size") or getattr(getattr(model, "config", None), "vocab_size", None)
    task = build_task(cfg, vocab_size)
    grpo = dataclass_from(GRPOConfig, cfg.algorithm, "algorithm", skip=("optim",))
    optim = dataclass_from(OptimConfig, cfg.algorithm.optim, "algorithm.optim")
    buffer = ReplayBuffer(vocab_size=vocab_size, num_experts=schema.num_experts)
    datamodule = instantiate_node(cfg.data, "data", buffer=buffer)
    sharded = cfg.model.get("sharded_weights")  # a meta-device model: the module loads its shards
    extra = {} if sharded is None else {"sharded_weights": str(sharded)}
    module = instantiate_node(
        cfg.module,
        "module",
        model=model,
        grpo=grpo,
        optim=optim,
        recompute_old_logprobs=mode == "r2",
        **extra,
    )
    if not isinstance(module, pl.LightningModule):
        raise JobError(f"module._target_ must build a LightningModule, got {type(module).__name__}")
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = out_dir / "metrics.csv"
    loop = on_policy_loop(
        cfg, engine, task, schema, buffer, normalize_std=grpo.normalize_std, metrics_path=metrics
    )
    callbacks = [*_callbacks(cfg, backend, mode), loop, RunCheckpoint(out_dir, cfg)]
    trainer = build_trainer(cfg, out_dir, callbacks, optim.grad_clip)
    ckpt_path = resume_checkpoint(cfg, out_dir, module)
    if ckpt_path is not None and is_global_zero():
        print(f"resuming {out_dir.name} from {ckpt_path}")
    with warnings.catch_warnings():
        # Lightning's own deprecated pytree call; the expected note when resuming into the same
        # checkpoint folder; the GRPO module's paired mismatch in on_after_batch_transfer (intended)
        for message in (
            r".*isinstance\(treespec, LeafSpec\).*",
            r"Checkpoint directory .* exists and is not empty",
            r".*overridden `on_after_batch_transfer`.*",
        ):
            warnings.filterwarnings("ignore", message=message)
        if trainer.world_size == 1:  # a process group of one (megatron's runtime) has nothing to sync
            warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\(.*sync_dist=True")
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        except SystemExit:  # Lightning turns Ctrl-C into a graceful shutdown and exit status 1
            if trainer.interrupted:
                raise KeyboardInterrupt from None
            raise
    if trainer.interrupted:
        raise KeyboardInterrupt
    return loop.history
