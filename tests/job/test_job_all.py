"""Each ``r3lightning.app.job`` module's ``__all__`` says what other code takes from it: every
public name that the repository's Python (the package, tests, benchmarks, scripts, examples)
imports from the module is listed, and every listed name is bound there. Read from the sources:
nothing is imported. (A listed name nobody imports is allowed: a ``_target_`` in the YAML files,
or a name for users, is public too.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB = "r3lightning.app.job"
JOB_MODULES = {f"{JOB}.{p.stem}": p for p in sorted((REPO / "r3lightning/app/job").glob("*.py"))}
JOB_MODULES.pop(f"{JOB}.__init__")
SOURCES = ("r3lightning", "tests", "benchmarks", "scripts", "examples")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _names_taken() -> dict[str, dict[str, set[str]]]:
    """``{job module: {name: the modules taking it}}``: ``from <module> import name``, relative
    imports included, and ``alias.name`` where ``alias`` is the job module imported as a module."""
    taken: dict[str, dict[str, set[str]]] = {}
    for path in (p for folder in SOURCES for p in (REPO / folder).rglob("*.py")):
        me = _module_name(path)
        package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in JOB_MODULES:  # the module itself
                        aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
                    elif base in JOB_MODULES and base != me:
                        taken.setdefault(base, {}).setdefault(alias.name, set()).add(me)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in JOB_MODULES and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                module = aliases.get(node.value.id)
                if module is not None and module != me:
                    taken.setdefault(module, {}).setdefault(node.attr, set()).add(me)
    return taken


def _top_level(path: Path) -> tuple[list[str] | None, set[str], set[str]]:
    """The module's ``__all__`` (None: it has none), the names it defines, and those it imports."""
    defined: set[str] = set()
    imported: set[str] = set()
    listed = None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if "__all__" in names:
                listed = list(ast.literal_eval(node.value))
            defined |= names
        elif isinstance(node, ast.Import | ast.ImportFrom):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If):  # if TYPE_CHECKING: ... else: ... (names for annotations)
            for child in ast.walk(node):
                if isinstance(child, ast.Assign):
                    defined |= {t.id for t in child.targets if isinstance(t, ast.Name)}
    return listed, defined, imported


TAKEN = _names_taken()


@pytest.mark.parametrize("module", list(JOB_MODULES), ids=[m.rsplit(".", 1)[1] for m in JOB_MODULES])
def test_all_lists_what_other_code_imports(module):
    listed, defined, imported = _top_level(JOB_MODULES[module])
    public = {name: users for name, users in TAKEN.get(module, {}).items() if not name.startswith("_")}
    if listed is None:
        assert public == {}, f"{module} has no __all__, but others import {sorted(public)}"
        return
    missing = {name: sorted(users) for name, users in public.items() if name not in listed}
    assert missing == {}, f"imported from {module} but not in its __all__"
    assert sorted(set(listed) - defined - imported) == []  # every listed name is bound there
