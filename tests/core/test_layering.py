"""The package's layers import only downward, with no cycle between modules.

Layers, lowest first: the core modules at the top of the package (ragged container, index maths,
route dtypes, multi-turn trace), then one folder per stage of a route's data flow. ``__init__.py``
of the package itself is exempt: it re-exports lazily from every layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "r3lightning"
LAYERS = ["", "wire", "align", "data", "correction", "rollout", "replay", "testing", "serve", "job", "app"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2 or (PACKAGE / f"{parts[1]}.py").exists():
        return ""
    return parts[1]


def _imports(path: Path) -> set[str]:
    """Every ``r3lightning`` module ``path`` imports, at any depth of the file, except under
    ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    tree = ast.parse(path.read_text())
    skip = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("r3lightning"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.startswith("r3lightning"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}"))
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


GRAPH = {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "__init__.py"}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_downward_only(module):
    mine = LAYERS.index(_layer(module))
    upward = sorted(m for m in GRAPH[module] if LAYERS.index(_layer(m)) > mine)
    assert not upward, f"{module} (layer {LAYERS[mine] or 'core'}) imports a higher layer: {upward}"


def test_every_folder_is_a_known_layer():
    folders = {p.parent.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE}
    assert folders <= set(LAYERS), sorted(folders - set(LAYERS))


def test_no_import_cycle():
    graph = {m: {i for i in deps if i in GRAPH and i != m} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
