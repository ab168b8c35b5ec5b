"""From config nodes to objects: ``_target_`` instantiation and typed settings, errors in one line.

Every swappable piece of the job is a Hydra ``_target_`` (the LightningModule, data module,
callbacks, loggers, task, reward, model factory). :func:`instantiate_node` builds one and turns
every way it can fail (an unimportable target, a constructor that rejects its keywords or values)
into a :class:`JobError` naming the config key. :func:`dataclass_from` builds a settings
dataclass from a node, checking each value against the field's type, so ``algorithm.clip_low=abc``
is reported as the key and the type it expects rather than a traceback from deep inside a run.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from r3lightning.job.common import JobError

__all__ = ["JobError", "dataclass_from", "instantiate_node", "locate", "plain", "tensorboard_if_installed"]


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def plain(node: Any) -> Any:
    """A config node as plain Python containers, interpolations resolved."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return node


def locate(key: str, target: Any) -> Any:
    """The object ``target`` (``"module.attr"``) names; a :class:`JobError` naming ``key`` if it
    cannot be imported."""
    from hydra.utils import get_object

    if not isinstance(target, str) or not target:
        raise JobError(f"{key}._target_ must be an importable 'module.attribute' string, got {target!r}")
    try:
        return get_object(target)
    except Exception as exc:
        cause = exc.__cause__ or exc
        raise JobError(
            f"{key}._target_: cannot import {target!r} ({_one_line(cause)}); "
            "give an importable 'module.attribute' (is its package installed?)"
        ) from None


def instantiate_node(node: Any, key: str, **job_kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node, **job_kwargs)``; every failure a :class:`JobError` naming ``key``.

    ``job_kwargs`` are what the job passes itself (they win over the node's keys). Nested
    ``_target_`` nodes are instantiated too (Hydra's recursive instantiation).
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    values = plain(node)
    if not isinstance(values, Mapping) or "_target_" not in values:
        raise JobError(
            f"{key} must be a mapping with a _target_ (an importable class or function), got {values!r}"
        )
    locate(key, values["_target_"])
    try:
        return instantiate(values, **job_kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        text = _one_line(cause).split(" full_key:")[0]
        if text.startswith("Error locating target"):  # a nested _target_
            text = text.split(", set env var")[0]
        raise JobError(f"{key}: {text}") from None
    except (TypeError, ValueError) as exc:
        raise JobError(f"{key}: {_one_line(exc)}") from None


# ---------------------------------------------------------------------------- typed settings


def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _check_value(key: str, value: Any, tp: Any) -> Any:
    """``value`` converted to ``tp`` (int -> float, list -> tuple), or a JobError naming ``key``."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):  # a nested settings group
        if not isinstance(value, Mapping):
            fields = [f.name for f in dataclasses.fields(tp)]
            raise JobError(f"{key} must be a mapping with keys among {fields}, got {value!r}")
        return dataclass_from(tp, value, key)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _check_value(key, value, option)
            except JobError as exc:
                errors.append(exc)
        expected = " or ".join(_type_name(o) for o in options if o is not type(None))
        if type(None) in options:
            expected += " or null"
        raise JobError(f"{key} must be {expected}, got {value!r}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple) or (args and len(value) != len(args)):
            raise JobError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(
            _check_value(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args, strict=True))
        )
    if tp is bool:
        if not isinstance(value, bool):
            raise JobError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise JobError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise JobError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise JobError(f"{key} must be a string, got {value!r}")
        return value
    return value


def dataclass_from(cls: type, node: DictConfig | Mapping[str, Any], key: str, *, skip: tuple[str, ...] = ()):
    """``cls(**node)`` with every value checked against its field's type; unknown keys rejected.

    ``skip``: keys of ``node`` that belong to something else (a nested group). A field typed as a
    dataclass is built the same way from its sub-mapping; the class's own ``ValueError`` becomes a
    :class:`JobError` naming the key.
    """
    values = {k: v for k, v in (plain(node) or {}).items() if k not in skip}
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise JobError(f"{key}.{unknown[0]} is not a setting here; expected one of {names}")
    checked = {name: _check_value(f"{key}.{name}", value, hints[name]) for name, value in values.items()}
    try:
        return cls(**checked)
    except (TypeError, ValueError) as exc:  # the class's own checks, e.g. "mode must be one of ..."
        text = _one_line(exc)
        raise JobError(f"{key}.{text}" if text.split(" ", 1)[0] in names else f"{key}: {text}") from None


def tensorboard_if_installed(save_dir: str, name: str = "tensorboard", **kwargs: Any):
    """A ``TensorBoardLogger`` when ``tensorboard`` (or ``tensorboardX``) is installed, else None
    (the job then logs without it): ``pip install r3lightning[tensorboard]``."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
        return None
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(save_dir, name=name, **kwargs)
