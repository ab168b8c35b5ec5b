"""mkdocs hook: pages carry generated tables instead of hand-typed lists that drift.

``<!-- generated: config-groups -->`` becomes the job's config groups and options, read from the
top-level ``conf/`` (each option described by the first sentence of its YAML comment), and
``<!-- generated: public-api -->`` the names of ``r3lightning.__all__``, each with its defining
module and the first line of its docstring, read from the source (nothing is imported).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"


def _first_sentence(comment: str) -> str:
    sentence = re.split(r"(?<=[a-z0-9)]\.)\s+(?=[A-Z])", comment.strip(), maxsplit=1)[0]
    return sentence.replace("|", "\\|").replace("_", "\\_").replace("<", "&lt;").rstrip(":")


def _leading_comment(path: Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#") or line.startswith("#   "):  # the prose ends at code or an example
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def config_groups() -> str:
    defaults = {}
    for entry in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            defaults.update(entry)
    rows = ["| group | option | what it is |", "|---|---|---|"]
    for group in sorted(p for p in CONF.iterdir() if p.is_dir()):
        default = defaults.get(group.name)
        for option in sorted(group.glob("*.yaml")):
            name = f"`{group.name}={option.stem}`" + (" (default)" if option.stem == default else "")
            rows.append(f"| `{group.name}` | {name} | {_first_sentence(_leading_comment(option))} |")
    return "\n".join(rows)


def public_api() -> str:
    source = (ROOT / "r3lightning" / "__init__.py").read_text()
    block = next(n for n in ast.parse(source).body if isinstance(n, ast.If))
    rows = ["| name | defined in | what it is |", "|---|---|---|"]
    for node in sorted(block.body, key=lambda n: n.module):
        module_path = ROOT / Path(*node.module.split(".")).with_suffix(".py")
        definitions = {
            d.name: d
            for d in ast.parse(module_path.read_text()).body
            if isinstance(d, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        }
        for alias in node.names:
            doc = ast.get_docstring(definitions[alias.name]) or ""
            summary = doc.split("\n\n", 1)[0].replace("\n", " ").replace("|", "\\|")
            link = f"[`{alias.name}`][{node.module}.{alias.name}]"
            rows.append(f"| {link} | `{node.module}` | {summary} |")
    return "\n".join(rows)


# objects the reference documents besides r3lightning.__all__: the job's settings and entry point,
# the launcher of a local vLLM engine, and the correction functions a user's module calls
EXTRA_REFERENCE = [
    "r3lightning.app.job.settings.RunSettings",
    "r3lightning.app.job.settings.ReplaySettings",
    "r3lightning.app.job.settings.RolloutSettings",
    "r3lightning.app.job.settings.WeightSyncSettings",
    "r3lightning.app.job.settings.ServerAddress",
    "r3lightning.app.job.settings.OptimConfig",
    "r3lightning.app.job.algorithm.GRPOConfig",
    "r3lightning.app.job.module.GRPOModule",
    "r3lightning.app.job.main.main",
    "r3lightning.app.vllm.settings.VllmSettings",
    "r3lightning.app.vllm.launcher.VllmServer",
    "r3lightning.correction.config.CorrectionConfig",
    "r3lightning.correction.config.CorrectionStep",
    "r3lightning.correction.importance.token_tis",
    "r3lightning.correction.importance.sequence_tis",
    "r3lightning.correction.importance.geometric_mask",
    "r3lightning.correction.importance.token_mask",
    "r3lightning.correction.importance.veto_mask",
    "r3lightning.correction.importance.k3_mask",
    "r3lightning.correction.steps.correction_weights",
    "r3lightning.correction.metrics.CorrectionMetrics",
]


def _public_paths() -> list[str]:
    source = (ROOT / "r3lightning" / "__init__.py").read_text()
    block = next(n for n in ast.parse(source).body if isinstance(n, ast.If))
    return [f"{node.module}.{alias.name}" for node in block.body for alias in node.names]


def reference(prefix: str) -> str:
    """``::: path`` for every public name and extra object defined under ``prefix``: their
    signatures and documented arguments, not the modules' internals."""
    paths = [p for p in [*_public_paths(), *EXTRA_REFERENCE] if p.startswith(f"{prefix}.")]
    return "\n\n".join(f"::: {path}" for path in sorted(set(paths), key=paths.index))


GENERATED = {"config-groups": config_groups, "public-api": public_api}


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    markdown = re.sub(r"<!-- reference: ([\w.]+) -->", lambda m: reference(m.group(1)), markdown)
    return re.sub(r"<!-- generated: ([\w-]+) -->", lambda m: GENERATED[m.group(1)](), markdown)
