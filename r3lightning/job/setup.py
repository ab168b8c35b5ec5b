"""Checks the main job's config and builds its pieces, each from its ``_target_``.

What the job builds itself, and why (everything else comes from the config as it is):

* the ``ReplayBuffer`` (it needs the model's vocabulary and expert count) passed to the data module
  as ``buffer``;
* the router replay backend named by the replay callback's ``backend`` key (``hf`` / ``megatron``),
  passed to that callback as ``backend``, with ``mode`` = ``replay.mode``;
* the model (``model._target_``) passed to the LightningModule as ``model``, with ``grpo`` and
  ``optim`` from ``algorithm``, ``recompute_old_logprobs`` (``replay.mode=r2``) and, when
  ``model.sharded_weights`` is set, ``sharded_weights`` (the model is then built on the meta
  device from ``model.path``'s config and the module loads each FSDP2 rank's shards);
* the ``Trainer`` keywords ``max_epochs`` (= ``steps``: one epoch is one RL step),
  ``reload_dataloaders_every_n_epochs=1`` and ``callbacks`` (the ``callbacks`` dict, then the
  rollout loop and the checkpoint). Those three are refused under ``trainer.*``; any other
  ``trainer.*`` key goes to ``Trainer`` as it is, and wins over the job's defaults for
  ``logger`` (the ``loggers`` list), ``gradient_clip_val`` (``algorithm.optim.grad_clip``),
  ``default_root_dir``, ``num_sanity_val_steps`` (0) and ``enable_model_summary`` (false).

Kept apart from ``main.py`` so that tests and notebooks can build a run from a composed config
(``compose_config``) without going through Hydra's command line.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from r3lightning.job.build import dataclass_from, instantiate_node, locate, plain
from r3lightning.job.common import JobError, is_global_zero

if TYPE_CHECKING:
    from r3lightning.job.rollout_loop import Engine

__all__ = ["CONF_DIR", "JobError", "build_model", "check_config", "is_global_zero", "train_one"]

# A wheel carries the configs inside the package (setup.py copies them at build time); a source
# checkout or an editable install reads the repository's top-level conf/.
_PACKAGED_CONF = Path(__file__).resolve().parents[1] / "conf"
CONF_DIR = _PACKAGED_CONF if _PACKAGED_CONF.is_dir() else Path(__file__).resolve().parents[2] / "conf"


_MODES = ("r3", "r2", "off")
_PROTOCOLS = ("skyrl", "vllm", "sglang", "openai")
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


def _int(cfg: DictConfig, key: str, *, minimum: int | None = 1) -> None:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise JobError(f"{key} must be an integer{bound}, got {value!r}")


def _positive_number(cfg: DictConfig, key: str) -> None:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise JobError(f"{key} must be a number > 0, got {value!r}")


def replay_callback_settings(cfg: DictConfig) -> DictConfig | None:
    """The ``callbacks`` entry whose ``_target_`` is a ``RouterReplayCallback`` (None if removed)."""
    from r3lightning.replay.callback import RouterReplayCallback

    for name, node in cfg.callbacks.items():
        if node is None or "_target_" not in node:
            continue
        target = locate(f"callbacks.{name}", node._target_)
        if isinstance(target, type) and issubclass(target, RouterReplayCallback):
            return node
    return None


def check_config(cfg: DictConfig) -> None:
    """Reject bad values before anything is built; messages name the key and what it expects."""
    from r3lightning.correction.grpo import GRPOConfig
    from r3lightning.job.module import OptimConfig
    from r3lightning.job.rollout_settings import check_rollout
    from r3lightning.rollout.prompts import SamplingConfig

    _int(cfg, "seed", minimum=None)
    _int(cfg, "steps")
    _int(cfg, "prompts_per_step")
    for key in ("task.response_length", "task.prompt_length"):
        if OmegaConf.select(cfg, key) is not None:  # the token-class task's keys
            _int(cfg, key)
    if OmegaConf.select(cfg, "algorithm.mismatch_every_n_steps") is not None:
        _int(cfg, "algorithm.mismatch_every_n_steps", minimum=0)
    if str(cfg.replay.mode) not in _MODES:
        raise JobError(f"replay.mode must be one of {list(_MODES)}, got {cfg.replay.mode!r}")
    if cfg.rollout.protocol not in _PROTOCOLS:
        raise JobError(f"rollout.protocol must be one of {list(_PROTOCOLS)}, got {cfg.rollout.protocol!r}")
    url = cfg.rollout.url
    if url is None and cfg.rollout.protocol not in _EMBEDDED_PROTOCOLS:
        raise JobError(
            f"rollout.protocol={cfg.rollout.protocol} needs rollout.url (the engine's http://host:port); "
            f"the embedded engine speaks {list(_EMBEDDED_PROTOCOLS)}"
        )
    if url is None and cfg.rollout.get("require_url", False):
        raise JobError("rollout.url must be set to the engine's http://host:port (rollout.require_url=true)")
    urls = list(url) if isinstance(url, ListConfig) else [url]
    if url is not None and not (urls and all(str(u).startswith(("http://", "https://")) for u in urls)):
        raise JobError(
            f"rollout.url must be null (embedded engine), http(s)://host:port or a list of them, got {url!r}"
        )
    grpo = dataclass_from(GRPOConfig, cfg.algorithm, "algorithm", skip=("optim",))
    if grpo.group_size < 2:
        raise JobError(f"algorithm.group_size must be an integer >= 2, got {grpo.group_size}")
    for key in ("clip_low", "clip_high", "std_eps", "ratio_band"):
        if not getattr(grpo, key) > 0:
            raise JobError(f"algorithm.{key} must be a number > 0, got {getattr(grpo, key)!r}")
    dataclass_from(OptimConfig, cfg.algorithm.optim, "algorithm.optim")
    dataclass_from(SamplingConfig, cfg.rollout.sampling, "rollout.sampling")
    check_rollout(cfg)  # after algorithm.*: rollout.collector interpolates some of its keys
    _positive_number(cfg, "algorithm.optim.lr")
    for key in _JOB_TRAINER_KEYS:
        if key in cfg.trainer:
            raise JobError(f"trainer.{key} is set by the job; use {_JOB_TRAINER_KEYS[key]}")
    # before a checkpoint is loaded: Lightning would only find out when building the Trainer
    if cfg.trainer.get("accelerator") == "gpu" and not _gpu_available():
        raise JobError(
            f"trainer.accelerator=gpu but no GPU is visible here; use trainer=cpu, or trainer=cpu_fsdp "
            f"for FSDP2 on CPU processes (got trainer.devices={cfg.trainer.get('devices')!r})"
        )
    for name, node in cfg.callbacks.items():
        if node is not None:
            if "_target_" not in node:
                raise JobError(f"callbacks.{name} must have a _target_ (or be null to drop it)")
            locate(f"callbacks.{name}", node._target_)
    for key in ("model", "task", "reward", "module", "data"):
        if "_target_" not in cfg[key]:
            raise JobError(f"{key}._target_ must name the class or function that builds the {key}")
        locate(key, cfg[key]._target_)
    if cfg.loggers is not None and not OmegaConf.is_list(cfg.loggers):
        raise JobError(
            f"loggers must be a list of {{_target_: ...}} entries (or null), got {plain(cfg.loggers)!r}"
        )
    for index, node in enumerate(cfg.loggers or []):
        if not OmegaConf.is_dict(node) or "_target_" not in node:
            raise JobError(f"loggers[{index}] must be a mapping with a _target_, got {plain(node)!r}")
        locate(f"loggers[{index}]", node._target_)
    replay = replay_callback_settings(cfg)
    if replay is not None:
        # the callback reads it only at the first training batch, far from the command line
        pad = replay.get("pad_to_multiple", 1)
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 1:
            raise JobError(f"callbacks.router_replay.pad_to_multiple must be an integer >= 1, got {pad!r}")


def _gpu_available() -> bool:
    return torch.cuda.is_available() or torch.backends.mps.is_available()


def replay_settings(cfg: DictConfig, mode: str) -> DictConfig:
    """``cfg`` with the ``replay`` group swapped for ``conf/replay/<mode>.yaml``."""
    path = CONF_DIR / "replay" / f"{mode}.yaml"
    if not path.exists():
        raise JobError(f"no replay config for mode {mode!r} ({path})")
    out = OmegaConf.merge(cfg, {"replay": OmegaConf.load(path)})
    assert isinstance(out, DictConfig)
    return out


# ---------------------------------------------------------------------------- model


@contextlib.contextmanager
def model_runtime(model_cfg: DictConfig) -> Iterator[None]:
    """The process setup the model needs around the whole run (``model.runtime``: a ``_target_``
    returning a context manager, e.g. megatron-core's process group and device shims)."""
    node = model_cfg.get("runtime")
    if node is None:
        yield
        return
    with instantiate_node(node, "model.runtime"):
        yield


def build_model(model_cfg: DictConfig, *, trainer: bool = False) -> torch.nn.Module:
    """The policy from ``model._target_`` (its keys but ``runtime`` and ``sharded_weights`` are the
    factory's keywords).

    ``trainer=True`` with ``sharded_weights`` set: the checkpoint's (``model.path``) model with
    parameters on the meta device, for FSDP2 ranks that read only their shards (an embedded
    engine needs weights, so it builds from the factory)."""
    values = plain(model_cfg)
    values.pop("runtime", None)
    sharded = values.pop("sharded_weights", None)
    if trainer and sharded is not None:
        if values.get("path") is None:
            raise JobError("model.sharded_weights needs model.path (the checkpoint's config.json)")
        path = Path(str(values["path"])).expanduser()
        if not (path / "config.json").is_file():
            raise JobError(f"model.path must be a local checkpoint directory with a config.json, got {path}")
        from r3lightning.job.models import torch_dtype
        from r3lightning.job.sharded import meta_model

        # parameters on the meta device: each FSDP2 rank reads only its shards after sharding
        return meta_model(path, dtype=torch_dtype(values.get("dtype", "float32"), "model.dtype"))
    model = instantiate_node(values, "model")
    if not isinstance(model, torch.nn.Module):
        raise JobError(
            f"model._target_ {values['_target_']!r} must return a torch.nn.Module, got {type(model).__name__}"
        )
    return model


def replay_backend(cfg: DictConfig, model: torch.nn.Module):
    """The router replay backend of ``model`` named by the replay callback's ``backend`` key."""
    from r3lightning.replay.hf.replay import HFRouterReplay

    settings = replay_callback_settings(cfg)
    kind = "hf" if settings is None else settings.get("backend", "hf")
    try:
        if kind == "megatron":
            from r3lightning.replay.megatron.replay import MegatronRouterReplay

            own = getattr(model, "router_replay_backend", None)
            return own() if callable(own) else MegatronRouterReplay(model, validate=False)
        if kind in ("hf", None):
            return HFRouterReplay.for_model(model)
    except (TypeError, ValueError, LookupError) as exc:
        hint = ""
        if kind != "megatron" and callable(getattr(model, "router_replay_backend", None)):
            hint = " (this model routes with megatron-core: use callbacks=router_replay_megatron)"
        elif kind == "megatron":
            hint = " (a Hugging Face model: use callbacks=router_replay)"
        raise JobError(
            f"callbacks.router_replay.backend={kind}: {' '.join(str(exc).split())}{hint}"
        ) from None
    raise JobError(f"callbacks.router_replay.backend must be hf or megatron, got {kind!r}")


def _model_vocab_size(model: torch.nn.Module) -> int | None:
    return getattr(getattr(model, "config", None), "vocab_size", None)


def build_task(cfg: DictConfig, vocab_size: int | None):
    """The task (``task._target_``) with its reward (``reward._target_``)."""
    from r3lightning.rollout.tasks import ScoredTask

    extra = {}
    if "vocab_size" in cfg.task and cfg.task.vocab_size is None:
        if vocab_size is None:
            raise JobError("task.vocab_size must be set: the model has no config.vocab_size")
        extra["vocab_size"] = vocab_size
    prompts = instantiate_node(cfg.task, "task", **extra)
    reward = instantiate_node(cfg.reward, "reward")
    try:
        return ScoredTask(prompts, reward)
    except TypeError as exc:
        raise JobError(str(exc)) from None


# ---------------------------------------------------------------------------- trainer


def _trainer_kwargs(trainer_cfg: DictConfig) -> dict[str, Any]:
    """``trainer.*`` as ``Trainer`` keywords; values with a ``_target_`` (strategy, plugins, a
    logger, ...) are instantiated."""
    kwargs = plain(trainer_cfg)
    assert isinstance(kwargs, dict)
    for key, value in kwargs.items():
        if isinstance(value, dict) and "_target_" in value:
            kwargs[key] = instantiate_node(value, f"trainer.{key}")
    return kwargs


def _loggers(cfg: DictConfig, out_dir: Path) -> list:
    """The ``loggers`` list; ``save_dir`` defaults to the run's folder; entries that build to
    None (TensorBoard when it is not installed) are dropped."""
    out = []
    for index, node in enumerate(cfg.loggers or []):
        extra = {} if OmegaConf.select(node, "save_dir") is not None else {"save_dir": str(out_dir)}
        logger = instantiate_node(node, f"loggers[{index}]", **extra)
        if logger is not None:
            out.append(logger)
    return out


def _callbacks(cfg: DictConfig, backend, mode: str) -> list:
    """The ``callbacks`` dict, in order; the replay callback gets the job's backend and mode, and
    ``strict`` from ``replay.strict`` when set (null: strict for r3 with an external engine, which
    must return routes, else the callback's own ``strict``)."""
    from r3lightning.replay.callback import RouterReplayCallback

    out = []
    for name, node in cfg.callbacks.items():
        if node is None:  # callbacks.<name>=null drops an entry
            continue
        key = f"callbacks.{name}"
        target = locate(key, node._target_)
        extra: dict[str, Any] = {}
        if isinstance(target, type) and issubclass(target, RouterReplayCallback):
            extra = {"backend": backend, "mode": mode}
            replay_strict = cfg.replay.get("strict")
            if replay_strict is not None:
                extra["strict"] = bool(replay_strict)
            elif cfg.rollout.url is not None and mode == "r3":
                # an external engine that returns no routes is misconfigured: fail, do not train natively
                extra["strict"] = True
        values = plain(node)
        values.pop("backend", None)  # built by the job from this key
        out.append(instantiate_node(values, key, **extra))
    return out


def build_trainer(cfg: DictConfig, out_dir: Path, callbacks: list, grad_clip: float | None):
    import lightning.pytorch as pl
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    kwargs = _trainer_kwargs(cfg.trainer)
    if "logger" not in kwargs:
        kwargs["logger"] = _loggers(cfg, out_dir) or False
    kwargs.setdefault("gradient_clip_val", grad_clip)
    kwargs.setdefault("default_root_dir", str(out_dir))
    kwargs.setdefault("num_sanity_val_steps", 0)
    kwargs.setdefault("enable_model_summary", False)
    try:
        return pl.Trainer(
            **kwargs, max_epochs=int(cfg.steps), reload_dataloaders_every_n_epochs=1, callbacks=callbacks
        )
    except (MisconfigurationException, TypeError, ValueError) as exc:
        raise JobError(f"trainer: {' '.join(str(exc).split())}") from None


# ---------------------------------------------------------------------------- one run


def train_one(cfg: DictConfig, out_dir: Path, engine: Engine) -> list[dict[str, float]]:
    """Train one run (one replay mode) into ``out_dir``; returns its per-step history."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from r3lightning.correction.grpo import GRPOConfig
    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.job.checkpoint import resume_checkpoint
    from r3lightning.job.module import OptimConfig
    from r3lightning.job.rollout_loop import on_policy_loop
    from r3lightning.wire.request import RouteSchema

    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    model = build_model(cfg.model, trainer=True)
    mode = str(cfg.replay.mode)
    backend = replay_backend(cfg, model)
    schema = RouteSchema(backend.num_layers, backend.top_k, backend.num_experts)
    vocab_size = cfg.task.get("vocab_size") or _model_vocab_size(model)
    task = build_task(cfg, vocab_size)
    grpo = dataclass_from(GRPOConfig, cfg.algorithm, "algorithm", skip=("optim",))
    optim = dataclass_from(OptimConfig, cfg.algorithm.optim, "algorithm.optim")
    buffer = ReplayBuffer(vocab_size=vocab_size, num_experts=schema.num_experts)
    datamodule = instantiate_node(cfg.data, "data", buffer=buffer)
    extra = {}
    if cfg.model.get("sharded_weights") is not None:  # a meta-device model: the module loads its shards
        extra["sharded_weights"] = str(cfg.model.sharded_weights)
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
    loop = on_policy_loop(
        cfg,
        engine,
        task,
        schema,
        buffer,
        metrics_path=out_dir / "metrics.csv",
    )
    checkpoint = ModelCheckpoint(
        dirpath=out_dir / "checkpoints",
        filename="last",
        save_top_k=1,
        every_n_epochs=1,
        enable_version_counter=False,
    )
    callbacks = [*_callbacks(cfg, backend, mode), loop, checkpoint]
    trainer = build_trainer(cfg, out_dir, callbacks, optim.grad_clip)
    ckpt_path = resume_checkpoint(cfg, out_dir, module)
    if ckpt_path is not None and is_global_zero():
        print(f"resuming {out_dir.name} from {ckpt_path}")
    with warnings.catch_warnings():
        # Lightning's own deprecated pytree call, and the expected note when resuming into
        # the same checkpoint directory
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        # the GRPO module measures its paired mismatch in on_after_batch_transfer (intended)
        warnings.filterwarnings("ignore", message=r".*overridden `on_after_batch_transfer`.*")
        if trainer.world_size == 1:  # a process group of one (megatron's runtime) has nothing to sync
            warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\(.*sync_dist=True")
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        except SystemExit:
            # Lightning turns Ctrl-C into a graceful shutdown and exit status 1
            if trainer.interrupted:
                raise KeyboardInterrupt from None
            raise
    if trainer.interrupted:
        raise KeyboardInterrupt
    return loop.history
