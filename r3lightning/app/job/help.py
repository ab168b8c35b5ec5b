"""``r3lightning-train --help``: config groups, options and keys, explained by the YAML files' comments."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from pathlib import Path

from omegaconf import OmegaConf

__all__ = ["format_help"]

_KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_]\w*):(?P<value>[^#]*?)\s*(?:#\s?(?P<comment>.*))?$")
_USAGE = """r3lightning-train: GRPO training of a causal MoE with Rollout Routing Replay (R3).

usage: r3lightning-train [--config-dir DIR] [-m] [group=option ...] [key=value ...] [+key=value ...]

  group=option       pick a config group's option, e.g. replay=off trainer=cpu_fsdp
  key=value          set a value, e.g. steps=50 rollout.url=http://host:30000
  +key=value         add a key, e.g. +callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor
  --config-dir DIR   your own YAML files (DIR/<group>/<option>.yaml), searched before the package's
  -m, --multirun     a sweep (key=a,b) through Hydra's sweeper and launcher: one after the other,
                     or in parallel with hydra/launcher=joblib (submitit_slurm: on SLURM)
  --cfg job          print the composed config and exit; --hydra-help for Hydra's own flags
  group=option --help  this help with that option selected and its keys listed

Every piece with a _target_ is built from it (your own class or function works). Configs: {conf_dir}
Any trainer.* key goes to lightning's Trainer as it is (+trainer.max_steps=100, +trainer.logger=false);
the job sets max_epochs (= steps), reload_dataloaders_every_n_epochs and callbacks itself."""


def _description(path: Path) -> str:
    """The leading comment block of a YAML file as one paragraph (usage lines dropped)."""
    header = itertools.takewhile(lambda line: line.startswith("#"), path.read_text().splitlines())
    texts = [line.lstrip("#").strip() for line in header if not line.startswith("#   ")]  # "#   ": usage
    return " ".join(t for t in texts if not t.startswith(("@package", "r3lightning-train", "python -m")))


def _keys(path: Path, prefix: str) -> list[tuple[str, str, str]]:
    """``(dotted key, value, comment)`` of every key line of ``path`` (a comment continued on comment
    lines at its column joined; list items and the ``defaults`` / ``hydra`` blocks left out)."""
    out: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []
    skip_block = False  # inside the defaults or hydra block
    comment_column = -1  # where the last key's comment starts; -1: it has none to continue
    list_indent: int | None = None  # the indent of the list items being skipped, if any
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            if out and out[-1][2] and line.index("#") == comment_column:  # the comment goes on
                key, value, comment = out[-1]
                out[-1] = (key, value, f"{comment} {stripped.lstrip('#').strip()}")
            continue
        comment_column = -1
        indent = len(line) - len(line.lstrip())
        if stripped.startswith("- "):
            list_indent = indent if list_indent is None else min(list_indent, indent)
            continue
        match = _KEY_LINE.match(line)
        if match is None or (list_indent is not None and indent > list_indent):
            continue
        list_indent = None
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if indent == 0:
            skip_block = match["key"] in ("defaults", "hydra")
        if skip_block:
            continue
        key = ".".join([*(k for _, k in stack), match["key"]])
        stack.append((indent, match["key"]))
        if match["key"] == "_target_" or not (match["value"].strip() or match["comment"]):
            continue
        if match["comment"]:
            comment_column = line.index("#", indent + len(match["key"]))
        out.append((f"{prefix}{key}", match["value"].strip(), (match["comment"] or "").strip()))
    return out


def _selected_sections(
    conf_dir: Path, selected: Mapping[str, str | None]
) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """``(title, keys)`` of each selected option, in the order of ``config.yaml``'s defaults list;
    an option's keys follow those of the options it extends (its own ``defaults``)."""
    sections = []
    for entry in OmegaConf.load(conf_dir / "config.yaml").defaults:
        if not OmegaConf.is_dict(entry):
            continue  # the schema's name and _self_: not a group
        group = str(next(iter(entry)))
        path = conf_dir / group / f"{selected.get(group)}.yaml"
        if not path.is_file():
            continue  # no option selected (null)
        prefix = "" if path.read_text().startswith("# @package _global_") else f"{group}."
        defaults = OmegaConf.load(path).get("defaults", [])
        bases = [b for b in defaults if isinstance(b, str) and b != "_self_"]
        keys: list[tuple[str, str, str]] = []
        for option in [*bases, path.stem]:
            keys += _keys(path.with_name(f"{option}.yaml"), prefix)
        sections.append((f"{group} ({selected[group]})", keys))
    return sections


def format_help(conf_dir: Path, selected: Mapping[str, str | None]) -> str:
    """The text of ``r3lightning-train --help``, read from the YAML files and their comments.

    Cost: reads every YAML file of ``conf_dir`` once or twice; imports nothing.

    Args:
        conf_dir: the config folder (``config.yaml`` and one folder per group).
        selected: ``{group: option}`` of the composed config (Hydra's ``runtime.choices``).

    Returns:
        The usage, every group's options (the selected ones marked ``*``) with their leading
        comments, then the top-level keys and those of each selected option (its bases' first),
        each with its value and explanation.
    """
    lines = [_USAGE.format(conf_dir=conf_dir), "", "Config groups (* = selected):"]
    for group in sorted(p.name for p in conf_dir.iterdir() if p.is_dir()):
        lines.append(f"  {group}:")
        for path in sorted((conf_dir / group).glob("*.yaml")):
            mark = "*" if selected.get(group) == path.stem else " "
            lines.append(f"   {mark} {path.stem:<24} {_description(path)}")
    options = ("Options", _keys(conf_dir / "config.yaml", ""))
    for title, keys in [options, *_selected_sections(conf_dir, selected)]:
        if not keys:
            continue
        lines += ["", f"{title}:"]
        for key, value, comment in keys:
            lines.append((f"  {key}={value}".ljust(44) + f"  {comment}").rstrip())
    return "\n".join(lines)


def _help_template() -> str:
    """``hydra.help.template`` (``${r3lightning_help:}``): the help of the composed config's choices,
    ``$`` escaped for the ``string.Template`` Hydra fills it into."""
    from hydra.core.hydra_config import HydraConfig

    from r3lightning.app.job.store import CONF_DIR

    return format_help(CONF_DIR, dict(HydraConfig.get().runtime.choices)).replace("$", "$$")


OmegaConf.register_new_resolver("r3lightning_help", _help_template, replace=True)
