"""The one-line messages of a refused config: the one table of keys that moved (`MOVED_KEYS`),
and Hydra's and OmegaConf's composition errors as one line naming the key (`error_line`).

Imports nothing but ``re``: the Hydra callback and the entry point use it before anything heavy.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MOVED_KEYS", "error_line", "moved"]

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
# OmegaConf's names of the types a scalar node converts to, as the messages say them
_OMEGACONF_TYPES = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}


def _yaml(value: Any) -> str:
    """``value`` as it is written on the command line (``true``, ``null``, ``[1, 2]``)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, list | tuple):
        return f"[{','.join(_yaml(v) for v in value)}]"
    return str(value)


def moved(key: str, value: Any = None, *, known: bool = True) -> str:
    """The message for a key of `MOVED_KEYS` that a config still sets.

    Args:
        key: the old dotted key.
        value: the value it was set to, repeated in the message as the new key's value.
        known: False when the value is not known (the message shows ``...``).

    Returns:
        ``<key> moved to <new>; set <new>=<value> instead``, or how to set the new key when the
        value does not carry over as it is.
    """
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
    """One line for a Hydra composition error or an OmegaConf error.

    Args:
        exc: the error Hydra or OmegaConf raised (Hydra's wraps OmegaConf's as its ``__cause__``).

    Returns:
        The key, what is wrong, and for a moved key where it went (never Hydra's ``+key`` hint
        for it); Hydra's own text on one line when it names no key.
    """
    cause = exc.__cause__
    text = str(exc)
    appended = re.search(r"To append to your config use \+([\w.]+)=(.*)$", text, re.S)
    if appended and appended.group(1) in MOVED_KEYS:
        return moved(appended.group(1), appended.group(2).strip())
    if cause is not None and getattr(cause, "full_key", None):
        line = _omegaconf_line(cause)
        typed = getattr(cause, "object_type", None) not in (None, dict)  # a schema node: no new keys
        if appended is None or typed:
            return line
        return f"{line}; add a new key with +{appended.group(1)}=..."
    if getattr(exc, "full_key", None):
        return _omegaconf_line(exc)
    # Hydra's own message: its search path listing and OmegaConf's key details dropped
    text = text.split("Config search path")[0].split("full_key:")[0]
    return " ".join(text.replace(":\n\t", ": ").replace("\n\t", ", ").split())
