"""From config nodes to objects (``_target_`` nodes, settings dataclasses, the model, replay backend,
task and callbacks), every failure a one-line `JobError` naming the config key; the ``Trainer`` is
built in `r3lightning.app.job.trainer`."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from r3lightning.app.job.common import JobError, one_line, plain
from r3lightning.app.job.models import torch_dtype
from r3lightning.app.job.sharded import meta_model
from r3lightning.app.tasks.token_class import ScoredTask
from r3lightning.replay.backend import check_soft_threshold
from r3lightning.replay.hf.replay import HFRouterReplay

__all__ = [
    "MEGATRON_HINT",
    "JobError",
    "build_callbacks",
    "build_model",
    "build_task",
    "import_problem",
    "instantiate_node",
    "megatron_installed",
    "one_line",
    "plain",
    "replay_backend",
    "replay_callback_settings",
    "target_of",
]

MEGATRON_HINT = 'pip install "r3lightning[megatron]"'


def megatron_installed() -> bool:
    """Whether megatron-core can be imported, found without importing it.

    Returns:
        True when ``megatron.core`` is installed.
    """
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no parent package, or one set to None in sys.modules
        return False


def _import(target: str) -> Any:
    """The object ``"package.module.attr"`` names, importing modules along the way."""
    parts = target.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        name = ".".join(parts[: i + 1])
        if not hasattr(obj, part) and inspect.ismodule(obj):
            try:
                importlib.import_module(name)  # a submodule not imported yet
            except ModuleNotFoundError as exc:
                if exc.name != name:  # the submodule exists but needs a missing package
                    raise
        if not hasattr(obj, part):
            kind = "module" if inspect.ismodule(obj) else type(obj).__name__
            raise AttributeError(f"{kind} {'.'.join(parts[:i])!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def import_problem(exc: BaseException) -> str:
    """Why an import failed, in one line for the user.

    Args:
        exc: The exception the import raised.

    Returns:
        The missing module's name (for megatron-core: the extra to install), else ``exc``'s
        message on one line.
    """
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if missing is not None and missing.split(".")[0] == "megatron":
        return f"megatron-core is not installed: {MEGATRON_HINT}"
    return one_line(exc) if missing is None else f"no module named {missing!r} (is its package installed?)"


def target_of(node: Any, key: str) -> Any:
    """The object ``node._target_`` names, imported (nothing is called).

    Args:
        node: A config node (or plain mapping) with a ``_target_``.
        key: Where ``node`` sits in the config, for the error message.

    Returns:
        The class or function the dotted path names.

    Raises:
        JobError: ``node`` is not a mapping with a non-empty string ``_target_``, or the path
            does not import (a missing package is named); the message names ``key``.
    """
    values = plain(node)
    if not isinstance(values, Mapping) or "_target_" not in values:
        raise JobError(f"{key} must be a mapping with a _target_, got {values!r}")
    target = values["_target_"]
    if not isinstance(target, str) or not target:
        raise JobError(f"{key}._target_ must be an importable 'module.attribute' string, got {target!r}")
    try:
        return _import(target)
    except Exception as exc:
        raise JobError(f"{key}._target_: cannot import {target!r}: {import_problem(exc)}") from None


def instantiate_node(node: Any, key: str, **job_kwargs: Any) -> Any:
    """Calls ``node``'s ``_target_`` with the node's other keys and ``job_kwargs``.

    ``job_kwargs`` reach the target as they are: given to Hydra's ``instantiate``, a dataclass
    (``grpo=GRPOConfig(...)``) would become a ``DictConfig`` and lose its methods.

    Args:
        node: A config node (or plain mapping) with a ``_target_``; ``_partial_: true`` returns
            a ``functools.partial`` instead of calling it.
        key: Where ``node`` sits in the config, for the error messages.
        **job_kwargs: Objects the job built (the model, the buffer, ...), passed on as keywords.

    Returns:
        What the target returned.

    Raises:
        JobError: The target does not import, or refuses its arguments (``TypeError``,
            ``ValueError``); one line naming ``key``.
    """
    target_of(node, key)
    values = plain(node)
    try:
        if job_kwargs and not values.get("_partial_"):
            return instantiate(values, _partial_=True)(**job_kwargs)
        return instantiate(values, **job_kwargs)
    except InstantiationException as exc:
        text = one_line(exc.__cause__ or exc).split(" full_key:")[0]
        raise JobError(f"{key}: {text.split(', set env var')[0]}") from None
    except (TypeError, ValueError) as exc:
        raise JobError(f"{key}: {one_line(exc)}") from None


def replay_callback_settings(cfg: DictConfig) -> tuple[str, DictConfig] | None:
    """The entry of ``callbacks`` that builds a ``RouterReplayCallback`` (or a subclass).

    Args:
        cfg: The job's config; imports every callback's ``_target_``.

    Returns:
        ``(name, node)`` of the first such entry, or None when the config removed it.

    Raises:
        JobError: A callback's ``_target_`` does not import.
    """
    from r3lightning.replay.callback import RouterReplayCallback

    for name, node in cfg.callbacks.items():
        target = None if node is None else target_of(node, f"callbacks.{name}")
        if isinstance(target, type) and issubclass(target, RouterReplayCallback):
            return str(name), node
    return None


def build_model(model_cfg: DictConfig, *, trainer: bool = False) -> torch.nn.Module:
    """The policy model the ``model`` group describes.

    Cost: builds (or loads) the whole model on the host, except a trainer's sharded model,
    which is built on the meta device and costs no memory until FSDP2 shards it.

    Args:
        model_cfg: The ``model`` node: a ``_target_`` factory and its keywords, plus the job's
            own ``runtime`` and ``sharded_weights`` keys (not passed to the factory).
        trainer: The trainer's copy: with ``model.sharded_weights`` set, build it on the meta
            device from ``model.path``'s ``config.json`` (the module loads the shards later).

    Returns:
        The model.

    Raises:
        JobError: The factory fails or returns something other than an ``nn.Module``, or a
            sharded model has no ``model.path`` with a ``config.json``.
    """
    values = {k: v for k, v in plain(model_cfg).items() if k not in ("runtime", "sharded_weights")}
    if trainer and model_cfg.get("sharded_weights") is not None:
        path = Path(str(values.get("path"))).expanduser()
        if values.get("path") is None or not (path / "config.json").is_file():
            raise JobError(
                f"model.sharded_weights needs model.path: a directory with a config.json, got {values.get('path')}"
            )
        return meta_model(path, dtype=torch_dtype(values.get("dtype", "float32"), "model.dtype"))
    model = instantiate_node(values, "model")
    if not isinstance(model, torch.nn.Module):
        raise JobError(
            f"model._target_ {values['_target_']!r} must return a torch.nn.Module, got {type(model).__name__}"
        )
    return model


def replay_backend(cfg: DictConfig, model: torch.nn.Module):
    """The router replay backend of ``model`` that the replay callback's ``backend`` key names.

    Args:
        cfg: The job's config (``callbacks``, ``replay.mode``, ``replay.soft_threshold``).
        model: The trainer's model; one with a ``router_replay_backend()`` method (megatron-core
            models of this package) builds its own.

    Returns:
        An ``HFRouterReplay`` (``backend: hf``, the default, or no replay callback) with the
        soft threshold set, else a megatron-core backend.

    Raises:
        JobError: An unknown backend name, ``replay.soft_threshold`` where it does not apply
            (megatron, or a mode other than r3), or a model the backend cannot patch (the
            message suggests the other callback group).
    """
    replay = replay_callback_settings(cfg)
    kind = "hf" if replay is None else replay[1].get("backend", "hf")
    if kind not in ("hf", "megatron", None):
        raise JobError(f"callbacks.router_replay.backend must be hf or megatron, got {kind!r}")
    megatron_model = callable(getattr(model, "router_replay_backend", None))
    soft = cfg.replay.get("soft_threshold")
    if soft is not None and (kind == "megatron" or cfg.replay.mode != "r3"):
        why = (
            "the megatron backend replays ids as given"
            if kind == "megatron"
            else f"replay.mode is {cfg.replay.mode}"
        )
        raise JobError(f"replay.soft_threshold needs replay=r3 with the hf backend; {why} (set it to null)")
    try:
        if kind != "megatron":
            backend = HFRouterReplay.for_model(model)
            backend.soft_threshold = check_soft_threshold(soft)
            return backend
        if megatron_model:
            return model.router_replay_backend()
        from r3lightning.replay.megatron.replay import MegatronRouterReplay

        return MegatronRouterReplay(model, validate=False)
    except (TypeError, ValueError, LookupError) as exc:
        hint = " (a Hugging Face model: use callbacks=router_replay)" if kind == "megatron" else ""
        if megatron_model and kind != "megatron":
            hint = " (this model routes with megatron-core: use callbacks=router_replay_megatron)"
        raise JobError(f"callbacks.router_replay.backend={kind}: {one_line(exc)}{hint}") from None


def build_task(cfg: DictConfig, vocab_size: int | None) -> ScoredTask:
    """The ``task`` (prompts) and ``reward`` (scorer) groups as one ``ScoredTask``.

    Args:
        cfg: The job's config; ``reward.timeout_s`` bounds each scorer call.
        vocab_size: The model's vocabulary size, given to a task whose ``vocab_size`` is null.

    Returns:
        The task with its scorer.

    Raises:
        JobError: The task needs a vocabulary size the model does not have, or the task or
            scorer cannot be built.
    """
    extra = {}
    if "vocab_size" in cfg.task and cfg.task.vocab_size is None:
        if vocab_size is None:
            raise JobError("task.vocab_size must be set: the model has no config.vocab_size")
        extra["vocab_size"] = vocab_size
    prompts = instantiate_node(cfg.task, "task", **extra)
    reward = instantiate_node({k: v for k, v in plain(cfg.reward).items() if k != "timeout_s"}, "reward")
    try:
        return ScoredTask(prompts, reward, timeout_s=cfg.reward.get("timeout_s", 60.0))
    except TypeError as exc:
        raise JobError(str(exc)) from None


def build_callbacks(cfg: DictConfig, backend, mode: str) -> list:
    """The ``callbacks`` group's callbacks, in order; a ``null`` entry is dropped.

    Args:
        cfg: The job's config.
        backend: The replay backend (`replay_backend`), given to the replay callback.
        mode: The replay mode (``r3``, ``r2``, ``off``), given to the replay callback.

    Returns:
        The callbacks. The replay callback also gets ``strict`` from ``replay.strict``; when
        that is null it is strict for r3 with an external or launched engine, whose routes
        must never be missing.

    Raises:
        JobError: A callback cannot be built; the message names ``callbacks.<name>``.
    """
    replay = replay_callback_settings(cfg)
    out = []
    for name, node in cfg.callbacks.items():
        if node is None:
            continue
        extra: dict[str, Any] = {}
        if replay is not None and name == replay[0]:
            extra = {"backend": backend, "mode": mode}
            strict = cfg.replay.get("strict")
            external = cfg.rollout.url is not None or cfg.rollout.get("launch") is not None
            if strict is None and external and mode == "r3":
                strict = True  # an external engine without routes is misconfigured: never train natively
            if strict is not None:
                extra["strict"] = bool(strict)
        values = {k: v for k, v in plain(node).items() if k != "backend"}  # the job builds the backend
        out.append(instantiate_node(values, f"callbacks.{name}", **extra))
    return out
