"""A true/false setting takes only ``true`` or ``false``, wherever it is written: on the command
line (`check_bool_overrides`), in a YAML config file of the composition (`check_bool_files`), or
in an arm's ``overrides`` (`refuse_non_bool`). OmegaConf's structured config turns ``1`` or
``yes`` into true while Hydra composes, so each check reads the literal as it was written: with
Hydra's override parser, or by loading the file again through Hydra's config loader. Nothing
here imports torch."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from r3lightning.app.job.common import JobError

__all__ = ["check_bool_files", "check_bool_overrides", "refuse_non_bool"]

_BOOL_TAG = "tag:yaml.org,2002:bool"


class _LiteralLoader(yaml.SafeLoader):
    """YAML as written, with YAML 1.2's booleans: ``true`` and ``false`` (any case) only. The YAML
    1.1 loader OmegaConf uses reads ``yes``, ``no``, ``on`` and ``off`` as booleans too; here they
    stay strings, so that a true/false key set to one of them is refused like ``1``."""


_LiteralLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_LiteralLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|false)$", re.IGNORECASE), list("tTfF"))


def refuse_non_bool(cfg: DictConfig, key: str, value: Any, where: str = "") -> None:
    """Refuse a literal other than ``true`` or ``false`` for a true/false setting: OmegaConf's
    structured config turns ``1`` or ``yes`` into true, so the literal as written is checked here.

    Args:
        cfg: The composed config: a key whose value is a bool there is a true/false setting.
        key: The dotted key ``value`` sets (``""``: the root, for a mapping of keys).
        value: The literal as written (an interpolation and None pass), or a mapping of keys to
            literals, each checked.
        where: Appended to the message: where the literal was written.

    Raises:
        JobError: The first such literal, naming its key and value.
    """
    if isinstance(value, Mapping):
        for name, item in value.items():
            refuse_non_bool(cfg, f"{key}.{name}" if key else str(name), item, where)
        return
    if value is None or isinstance(value, bool) or (isinstance(value, str) and "${" in value):
        return
    current = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
    if isinstance(current, bool):
        raise JobError(f"{key} must be true or false, got {value!r}{where}")


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
        if override.is_delete():
            continue
        try:
            values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        except Exception:  # an interval sweep has no values to list: its sweeper's range is numeric
            values = [override.value()]
        for value in values:
            refuse_non_bool(cfg, override.key_or_group, value)


def check_bool_files(cfg: DictConfig, config_name: str | None, overrides: Sequence[str]) -> None:
    """Every true/false setting a YAML config file of the composition sets is ``true`` or
    ``false`` there (``plot: 1`` or ``replay.request_routes: yes`` in an experiment file or a
    ``--config-dir`` primary config is refused, where the structured merge reads it as true).

    Hydra's config loader computes the defaults list of ``config_name`` with ``overrides``, and
    each YAML file in it is loaded again as written (``1`` an integer, ``yes`` a string: YAML
    1.2's booleans), under its package. Call it where Hydra runs (its callbacks): it uses Hydra's
    global config loader.

    Cost: loading the composition's YAML files once more (milliseconds); imports no torch.

    Args:
        cfg: The composed config (without the ``hydra`` node).
        config_name: The primary config's name (``hydra.job.config_name``).
        overrides: The overrides that chose the files: Hydra's and the task's, no sweeps.

    Raises:
        JobError: The first such literal, naming its key, its value and its file.
    """
    loader = GlobalHydra.instance().config_loader()
    defaults = loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN).defaults
    # after the defaults list: a hydra.searchpath of the primary config or the overrides is in
    sources = [source for source in loader.get_sources() if source.scheme() != "structured"]
    for default in defaults:
        path = default.config_path
        if path is None or path.split("/")[0] == "hydra":
            continue
        source = next((source for source in sources if source.is_config(path)), None)
        if source is None:  # a ConfigStore node (the schema): typed already
            continue
        if source.scheme() != "file":  # a wheel's own configs: the files a checkout reads as file://
            continue
        loaded = source.load_config(path)  # for its ``# @package`` header
        package = default.package if default.package is not None else loaded.header.get("package")
        file = Path(source.path) / (path if path.endswith((".yaml", ".yml")) else f"{path}.yaml")
        raw = yaml.load(file.read_text(encoding="utf-8"), Loader=_LiteralLoader)
        if not isinstance(raw, dict):
            continue
        raw.pop("defaults", None)
        raw.pop("hydra", None)
        refuse_non_bool(cfg, package or "", raw, f" (in {file})")
