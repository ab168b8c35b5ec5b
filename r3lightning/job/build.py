"""From config nodes to objects: ``_target_`` instantiation and typed settings, errors in one line.

:func:`instantiate_node` builds a ``_target_`` node and turns every way it can fail (a module or
attribute that does not exist, a constructor that rejects its keywords or values) into a
:class:`JobError` naming the config key. :func:`dataclass_from` builds a settings dataclass,
checking each value against its field's type, so ``algorithm.clip_low=abc`` names the key and
the type it expects rather than failing deep inside a run.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
import typing
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

from r3lightning.job.common import JobError

__all__ = ["JobError", "dataclass_from", "instantiate_node", "locate", "plain", "tensorboard_if_installed"]

MEGATRON_HINT = 'pip install "r3lightning[megatron]"'


def one_line(text: Any) -> str:
    return " ".join(str(text).split())


def plain(node: Any) -> Any:
    """A config node as plain Python containers, interpolations resolved."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


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
    """Why an import failed, in one line; a missing megatron-core names the extra to install."""
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if missing is not None and missing.split(".")[0] == "megatron":
        return f"megatron-core is not installed: {MEGATRON_HINT}"
    return one_line(exc) if missing is None else f"no module named {missing!r} (is its package installed?)"


def locate(key: str, target: Any) -> Any:
    """The object ``target`` (``"module.attr"``) names; a :class:`JobError` naming ``key`` and
    what is missing (the module, the attribute, or a package it needs) otherwise."""
    if not isinstance(target, str) or not target:
        raise JobError(f"{key}._target_ must be an importable 'module.attribute' string, got {target!r}")
    try:
        return _import(target)
    except Exception as exc:
        raise JobError(f"{key}._target_: cannot import {target!r}: {import_problem(exc)}") from None


def target_of(node: Any, key: str) -> Any:
    """The object ``node._target_`` names; a :class:`JobError` naming ``key`` when ``node`` is no
    mapping with a ``_target_`` or the target cannot be imported."""
    values = plain(node)
    if not isinstance(values, Mapping) or "_target_" not in values:
        raise JobError(f"{key} must be a mapping with a _target_, got {values!r}")
    return locate(key, values["_target_"])


def instantiate_node(node: Any, key: str, **job_kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node, **job_kwargs)``; every failure a :class:`JobError` naming
    ``key``. ``job_kwargs`` (what the job passes itself) win over the node's keys; nested
    ``_target_`` nodes are instantiated too."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    target_of(node, key)
    try:
        return instantiate(plain(node), **job_kwargs)
    except InstantiationException as exc:
        text = one_line(exc.__cause__ or exc).split(" full_key:")[0]
        raise JobError(f"{key}: {text.split(', set env var')[0]}") from None
    except (TypeError, ValueError) as exc:
        raise JobError(f"{key}: {one_line(exc)}") from None


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """``value`` converted to ``tp`` (int -> float, list -> tuple), or a JobError naming ``key``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(tp) if o is not type(None)]
        if value is None and len(options) < len(typing.get_args(tp)):
            return None
        for option in options:
            try:
                return _check_value(key, value, option)
            except JobError:
                pass
        names = [_TYPE_NAMES.get(o, getattr(o, "__name__", str(o))) for o in options]
        null = " or null" if len(options) < len(typing.get_args(tp)) else ""
        raise JobError(f"{key} must be {' or '.join(names)}{null}, got {value!r}")
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise JobError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(
            _check_value(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    accepted = {int: int, float: int | float, bool: bool, str: str}.get(tp)
    if accepted is None:
        return value
    if not isinstance(value, accepted) or (isinstance(value, bool) and tp is not bool):
        raise JobError(f"{key} must be {_TYPE_NAMES[tp]}, got {value!r}")
    return float(value) if tp is float else value


def dataclass_from(cls: type, node: Any, key: str, *, skip: tuple[str, ...] = ()) -> Any:
    """``cls(**node)`` with every value checked against its field's type and unknown keys
    rejected; a ``ValueError`` of the class's own checks (``"<field> must be ..."``) is reported
    under ``key``. ``skip``: keys of ``node`` that belong to something else (a nested group)."""
    values = {k: v for k, v in (plain(node) or {}).items() if k not in skip}
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise JobError(f"{key}.{unknown[0]} is not a setting here; expected one of {names}")
    try:
        return cls(
            **{name: _check_value(f"{key}.{name}", value, hints[name]) for name, value in values.items()}
        )
    except ValueError as exc:
        raise JobError(f"{key}.{one_line(exc)}") from None


def tensorboard_if_installed(save_dir: str, name: str = "tensorboard", **kwargs: Any):
    """A ``TensorBoardLogger`` when ``tensorboard`` (or ``tensorboardX``) is installed, else None
    (the job then logs without it): ``pip install r3lightning[tensorboard]``."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
        return None
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(save_dir, name=name, **kwargs)
