"""The library is laid out in the order routes flow, the application sits on top, and no import
goes where the table below does not allow.

Library, in data-flow order: the core modules at the top of the package (ragged container, index
maths, route dtypes, the validation vocabulary), then ``wire`` (bodies and codecs) -> ``rollout``
(client, collector, the ``Trajectory`` a rollout makes) -> ``data`` (buffer, collation, the worker
that collects ahead into the streaming buffer) -> ``align`` -> ``replay`` -> ``correction``. A
folder imports only the layers ``ALLOWED`` names for it: the core, the wire and earlier stages
whose types it hands on. A later stage is never imported, not even for an annotation under
``if TYPE_CHECKING:`` (the stage would still depend on it, for its types and its docs): code two
later stages share (padded positions, placeholder routes) lives in the core. The layers form no
cycle.

The application (``r3lightning.app``: server, job, tasks, models) may import the whole library;
nothing in the library imports it. ``__init__.py`` of the package itself is exempt: it re-exports
lazily from every layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "r3lightning"
LIBRARY = ["", "wire", "rollout", "data", "align", "replay", "correction"]  # data-flow order; "" is the core
APPLICATION = ["app.models", "app.tasks", "app.serve", "app.vllm", "app.job"]
# what each library layer may import besides itself
ALLOWED = {
    "": set(),
    "wire": {""},
    "rollout": {"", "wire"},
    "data": {"", "wire", "rollout"},
    "align": {""},
    "replay": {"", "wire", "align"},
    "correction": {""},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    """``""`` for the core, the folder for a library module, ``app.<folder>`` for the application."""
    parts = module.split(".")
    if len(parts) < 2 or (PACKAGE / f"{parts[1]}.py").exists():
        return ""
    if parts[1] == "app":
        return "app" if len(parts) < 3 or (PACKAGE / "app" / f"{parts[2]}.py").exists() else f"app.{parts[2]}"
    return parts[1]


def _imports(path: Path, *, annotations: bool, source: str | None = None) -> set[str]:
    """Every ``r3lightning`` module ``path`` (or ``source`` read as if it were there) imports, at any
    depth of the file; under ``if TYPE_CHECKING:`` (annotations only, never executed) only with
    ``annotations``."""
    tree = ast.parse(path.read_text() if source is None else source)
    skip = set()
    if not annotations:
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


SOURCES = [p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "__init__.py"]
# what a module depends on, annotations included: the layer rules
GRAPH = {_module_name(p): _imports(p, annotations=True) for p in SOURCES}
# what importing it runs: the cycle check (an annotation-only import is how a cycle is avoided)
RUNTIME_GRAPH = {_module_name(p): _imports(p, annotations=False) for p in SOURCES}


LIBRARY_MODULES = sorted(m for m in GRAPH if _layer(m) in LIBRARY)


@pytest.mark.parametrize("module", LIBRARY_MODULES)
def test_a_library_module_imports_only_the_layers_its_layer_may(module):
    mine = _layer(module)
    other = sorted(m for m in GRAPH[module] if _layer(m) != mine and _layer(m) not in ALLOWED[mine])
    assert not other, f"{module} (layer {mine or 'core'}) imports outside {sorted(ALLOWED[mine])}: {other}"


@pytest.mark.parametrize("module", LIBRARY_MODULES)
def test_nothing_in_the_library_imports_the_application(module):
    app = sorted(m for m in GRAPH[module] if m == "r3lightning.app" or m.startswith("r3lightning.app."))
    assert not app, f"{module} is library code but imports the application: {app}"


def test_no_layer_may_import_a_later_one():
    later = {
        (layer, dep)
        for layer, deps in ALLOWED.items()
        for dep in deps
        if LIBRARY.index(dep) > LIBRARY.index(layer)
    }
    assert later == set()


def test_an_annotation_only_import_counts_for_the_layers():
    """A later layer imported under ``if TYPE_CHECKING:`` is still a dependency of the layer rules,
    but not of the cycle check (which looks at what an import runs)."""
    collector = PACKAGE / "rollout" / "collector.py"
    source = (
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..data.buffer import ReplayBuffer\n"
    )
    assert _imports(collector, annotations=True, source=source) == {"r3lightning.data.buffer"}
    assert _imports(collector, annotations=False, source=source) == set()


def test_the_allowed_imports_between_library_layers_form_no_cycle():
    def reaches(start: str, goal: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(
            dep == goal or (dep not in seen and reaches(dep, goal, seen | {dep})) for dep in ALLOWED[start]
        )

    assert [layer for layer in LIBRARY if reaches(layer, layer)] == []


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _layer(m) in APPLICATION))
def test_an_application_package_imports_only_the_library_and_those_before_it(module):
    mine = APPLICATION.index(_layer(module))
    later = sorted(
        m for m in GRAPH[module] if _layer(m) in APPLICATION and APPLICATION.index(_layer(m)) > mine
    )
    assert not later, f"{module} ({APPLICATION[mine]}) imports a later application package: {later}"


def test_every_folder_is_a_known_layer():
    folders = set()
    for path in PACKAGE.rglob("*.py"):
        if path.parent != PACKAGE and path.parent != PACKAGE / "app":
            folders.add(_layer(_module_name(path)))
    assert folders <= set(LIBRARY) | set(APPLICATION), sorted(folders - set(LIBRARY) - set(APPLICATION))


def test_no_import_cycle():
    graph = {m: {i for i in deps if i in RUNTIME_GRAPH and i != m} for m, deps in RUNTIME_GRAPH.items()}
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
