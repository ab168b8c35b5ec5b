"""``r3lightning-train --help``: config groups, their options and the keys, explained by the
comments in the YAML files themselves (the one place they are written down)."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

_KEY_LINE = re.compile(
    r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w]*):(?P<value>[^#]*?)\s*(?:#\s?(?P<comment>.*))?$"
)


def _description(path: Path) -> str:
    """The leading comment block of a YAML file, joined into one paragraph (usage lines dropped)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith(("@package", "r3lightning-train", "python -m")) or line.startswith("#   "):
            continue
        lines.append(text)
    return " ".join(lines)


def _keys(path: Path, prefix: str) -> list[tuple[str, str, str]]:
    """``(dotted key, value, comment)`` of every key line in ``path`` (nested keys by indentation;
    a comment continued on the following comment-only lines is joined)."""
    out: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []
    in_defaults = False
    comment_column = -1  # where the last key line's comment starts
    list_indent: int | None = None  # inside a list's items (their keys are not options)
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            if out and out[-1][2] and line.index("#") == comment_column:
                key, value, comment = out[-1]
                out[-1] = (key, value, f"{comment} {stripped.lstrip('#').strip()}")
            continue
        comment_column = -1
        if stripped.startswith("- "):
            indent = len(line) - len(line.lstrip())
            list_indent = indent if list_indent is None else min(list_indent, indent)
            continue
        match = _KEY_LINE.match(line)
        if match is None:
            continue
        indent = len(match["indent"])
        if list_indent is not None:
            if indent > list_indent:
                continue
            list_indent = None
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if indent == 0:
            in_defaults = match["key"] in ("defaults", "hydra")
        if in_defaults:
            continue
        key = ".".join([*(k for _, k in stack), match["key"]])
        stack.append((indent, match["key"]))
        value = match["value"].strip()
        if match["key"] == "_target_" or (not value and not match["comment"]):
            continue
        if match["comment"]:
            comment_column = line.index("#", len(match["indent"]) + len(match["key"]))
        out.append((f"{prefix}{key}", value, (match["comment"] or "").strip()))
    return out


def _defaults(conf_dir: Path) -> dict[str, str | None]:
    chosen: dict[str, str | None] = {}
    defaults = OmegaConf.to_container(OmegaConf.load(conf_dir / "config.yaml").defaults, resolve=False)
    for entry in defaults:  # type: ignore[union-attr]
        if isinstance(entry, dict):
            ((group, option),) = entry.items()
            if isinstance(option, str) and option.startswith("${") and option.endswith("}"):
                option = chosen.get(option[2:-1])  # another group's choice, e.g. reward: ${task}
            chosen[str(group)] = None if option is None else str(option)
    return chosen


def format_help(conf_dir: Path) -> str:
    """The help text: usage, every config group with its options (default marked), the top-level
    keys, then the keys of each default option, each with its explanation."""
    defaults = _defaults(conf_dir)
    lines = [
        "r3lightning-train: GRPO training of a causal MoE with Rollout Routing Replay (R3).",
        "",
        "usage: r3lightning-train [--config-dir DIR] [-m] [group=option ...] [key=value ...] [+key=value ...]",
        "",
        "  group=option       pick a config group's option, e.g. replay=off trainer=cpu_fsdp",
        "  key=value          set a value, e.g. steps=50 rollout.url=http://host:30000",
        "  +key=value         add a key, e.g. +callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
        "  --config-dir DIR   your own YAML files (DIR/<group>/<option>.yaml), searched before the package's",
        "  -m, --multirun     a sweep (key=a,b): its jobs run one after the other; failures are listed",
        "  --cfg job          print the composed config and exit; --hydra-help for Hydra's own flags",
        "",
        f"Every piece with a _target_ is built from it (your own class or function works). Configs: {conf_dir}",
        "Any trainer.* key goes to lightning's Trainer as it is (+trainer.max_steps=100, +trainer.logger=false);",
        "the job sets max_epochs (= steps), reload_dataloaders_every_n_epochs and callbacks itself.",
        "",
        "Config groups (* = default):",
    ]
    for group in sorted(p.name for p in conf_dir.iterdir() if p.is_dir()):
        lines.append(f"  {group}:")
        for path in sorted((conf_dir / group).glob("*.yaml")):
            mark = "*" if defaults.get(group) == path.stem else " "
            lines.append(f"   {mark} {path.stem:<24} {_description(path)}")
    sections = [("Options", _keys(conf_dir / "config.yaml", ""))]
    for group, option in defaults.items():
        if option is not None and (conf_dir / group / f"{option}.yaml").exists():
            prefix = f"{group}."
            path = conf_dir / group / f"{option}.yaml"
            keys = _keys(path, prefix)
            for base in OmegaConf.load(path).get("defaults", []) or []:
                if isinstance(base, str) and base != "_self_":
                    keys = _keys(conf_dir / group / f"{base}.yaml", prefix) + keys
            sections.append((f"{group} ({option})", keys))
    for title, keys in sections:
        if not keys:
            continue
        lines += ["", f"{title}:"]
        for key, value, comment in keys:
            lines.append(f"  {key}={value}".ljust(44) + (f"  {comment}" if comment else ""))
    return "\n".join(lines)
