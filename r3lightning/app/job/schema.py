"""Hydra structured configs made from the library's settings dataclasses.

The dataclasses (``RetryPolicy``, ``EngineConfig``, ``GRPOConfig``, ...) are the one source of the
job's field names, types and defaults. `structured` turns one into a dataclass that OmegaConf
can type-check: the same fields and defaults, each type narrowed to what a YAML value can be
(``torch.dtype | str`` -> ``str``, ``Sequence[int] | None`` -> ``Optional[List[int]]``). Hydra then
refuses a wrong type or an unknown key while it composes; the value checks of the dataclass's own
``__post_init__`` run when `build` makes the library object from the composed node.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, cast

from omegaconf import MISSING, DictConfig, OmegaConf

__all__ = ["SettingsError", "build", "field_types", "structured"]

_PRIMITIVES = (int, float, bool, str)
_CACHE: dict[tuple[type, str], type] = {}


class SettingsError(ValueError):
    """A refused setting, its message already naming the dotted config key."""


def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of every field of the dataclass ``cls``, its bases' included.

    A field annotated with a name its module imports only for type checkers
    (``DataOptions.eval_buffer: ReplayBuffer | None``: that module imports torch) is ``Any``: it
    holds an object the job builds, never a config value. Resolving imports nothing.

    Args:
        cls: a dataclass (``from __future__ import annotations`` or not).

    Returns:
        ``{field name: annotation}``.
    """
    try:
        return typing.get_type_hints(cls)
    except NameError:
        pass
    types_: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        namespace = vars(sys.modules[klass.__module__])
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            try:
                types_[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
            except NameError:
                types_[name] = Any
    return types_


def _yaml_type(tp: Any) -> Any:
    """The OmegaConf annotation for a field annotated ``tp`` (``Any`` where YAML cannot say more)."""
    if tp in _PRIMITIVES or tp is Any:
        return tp
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return structured(tp)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        optional = len(options) < len(args)  # None is one of the options
        narrowed = [_yaml_type(a) for a in options]
        # a union of a config-able type and objects YAML cannot hold (torch.dtype | str) is the
        # former: the options that narrow to Any are dropped, unless Any itself was written
        kept = [n for n, a in zip(narrowed, options, strict=True) if n is not Any or a is Any]
        inner = kept[0] if len(set(kept)) == 1 else Any  # two YAML types left: OmegaConf takes Any
        if optional and inner is not Any:
            return Optional[inner]  # noqa: UP045 (OmegaConf reads typing.Optional)
        return inner
    if origin in (list, tuple, Sequence, set, frozenset) or origin is typing.Sequence:
        if origin is tuple and args and args[-1] is not Ellipsis:
            # a fixed-length tuple keeps one narrowed type per position: tuple[a, b] built at runtime
            return types.GenericAlias(tuple, tuple(_yaml_type(a) for a in args))
        return list[_yaml_type(args[0]) if args else Any]
    if origin in (dict, Mapping) or origin is typing.Mapping:
        return dict[str, _yaml_type(args[1]) if len(args) == 2 else Any]
    return Any


def _yaml_default(value: Any) -> Any:
    """A field's default as YAML holds it (a ``torch.dtype`` as its name, a tuple as a list)."""
    if isinstance(value, tuple | list):
        return [_yaml_default(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _yaml_default(v) for k, v in value.items()}
    if value is None or isinstance(value, (*_PRIMITIVES, enum.Enum)):
        return value
    name = str(value)
    return name.removeprefix("torch.") if name.startswith("torch.") else name


def _schema_default(item: dataclasses.Field, tp: Any) -> dataclasses.Field:
    """The schema field's default: the settings field ``item``'s, as YAML holds it (``tp`` its
    schema type); ``???``, Hydra's mandatory value, where it has none."""
    if item.default is not dataclasses.MISSING:
        default = _yaml_default(item.default)
        if isinstance(default, list):  # a mutable default: each config gets its own copy
            return dataclasses.field(default_factory=lambda d=default: list(d))
        return dataclasses.field(default=default)
    if item.default_factory is not dataclasses.MISSING:
        if dataclasses.is_dataclass(item.default_factory()):  # nested settings: their schema's defaults
            return dataclasses.field(default_factory=tp)
        return dataclasses.field(default_factory=lambda f=item.default_factory: _yaml_default(f()))
    return dataclasses.field(default=MISSING)


def structured(
    cls: type,
    *,
    target: str | None = None,
    exclude: Sequence[str] = (),
    extra: Sequence[dataclasses.Field | tuple] = (),
    name: str | None = None,
) -> type:
    """The structured-config dataclass of the settings dataclass ``cls``.

    Args:
        cls: a dataclass whose fields are the settings.
        target: a ``_target_`` default (first field), for a node Hydra can instantiate.
        exclude: fields that are not settings of a config (objects the job builds itself).
        extra: more fields, as ``dataclasses.make_dataclass`` takes them (``(name, type, field)``).
        name: the class name in Hydra's messages (default: ``cls``'s).

    Returns:
        A (cached) dataclass with the same field names and defaults; a field without a default is
        ``???`` (Hydra's mandatory value).
    """
    key = (cls, repr((target, tuple(exclude), tuple(map(repr, extra)), name)))
    if key in _CACHE:
        return _CACHE[key]
    hints = field_types(cls)
    fields: list[tuple] = []
    if target is not None:
        fields.append(("_target_", str, dataclasses.field(default=target)))
    for item in dataclasses.fields(cls):
        if item.name in exclude or not item.init:
            continue
        tp = _yaml_type(hints[item.name])
        fields.append((item.name, tp, _schema_default(item, tp)))
    fields += list(extra)
    schema = dataclasses.make_dataclass(name or cls.__name__, fields)
    schema.__doc__ = f"Structured config of ``{cls.__module__}.{cls.__qualname__}``."
    _CACHE[key] = schema
    return schema


def _source(node: Any, field: str) -> str:
    """`` (set by ${x})`` when ``node.field`` is an interpolation, else ``""``."""
    if not isinstance(node, DictConfig) or field not in node:
        return ""
    # a DictConfig gives a dict; OmegaConf's annotation also allows a list, None or a string
    values = cast(dict, OmegaConf.to_container(node, resolve=False))
    raw = values.get(field)
    return f" (set by {raw})" if isinstance(raw, str) and raw.startswith("${") else ""


def build(
    cls: type, node: Any, key: str, *, skip: Sequence[str] = (), convert: Callable | None = None
) -> Any:
    """``cls`` (a settings dataclass) from the config ``node`` at ``key``: nested settings too, the
    ``_target_`` and ``skip`` keys left out. A value the class refuses (its ``ValueError`` or
    ``TypeError``) is a `SettingsError` naming ``key.<field>`` and, for an interpolated value,
    where it is set.

    Args:
        cls: the settings dataclass.
        node: its composed config node (or a plain mapping).
        key: the node's dotted config key, for messages.
        skip: keys of the node that are not fields of ``cls``.
        convert: applied to the plain values before ``cls`` gets them.

    Returns:
        The ``cls`` instance.

    Raises:
        SettingsError: a refused value, or a key that is not a field of ``cls``.
    """
    if OmegaConf.is_config(node):
        values = OmegaConf.to_container(node, resolve=True)
    else:
        values = dict(node or {})  # a plain mapping, or None for an empty node
    values = {k: v for k, v in values.items() if k != "_target_" and k not in skip}
    hints = field_types(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    prefix = f"{key}." if key else ""
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise SettingsError(f"{prefix}{unknown[0]} is not a setting here; expected one of {names}")
    for name, value in values.items():
        nested = hints[name]
        is_settings = dataclasses.is_dataclass(nested) and isinstance(nested, type)
        if is_settings and isinstance(value, Mapping):
            # the nested config node rather than its plain copy, so a refused value can name the
            # interpolation that set it
            child = node[name] if OmegaConf.is_config(node) else value
            values[name] = build(nested, child, f"{prefix}{name}")
    if convert is not None:
        values = convert(values)
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        text = " ".join(str(exc).split())
        # the message's leading word names the field: "name must be ...", "name=x needs ..."
        field = re.split(r"\W", text, maxsplit=1)[0]
        if field in names:
            raise SettingsError(f"{prefix}{text}{_source(node, field)}") from None
        raise SettingsError(f"{key or 'config'}: {text}") from None
