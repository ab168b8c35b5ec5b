"""Every move in the CHANGELOG's migration tables: the new path imports, the old one still does, with
a DeprecationWarning naming the new path, and gives the same object."""

import importlib
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import r3lightning
from r3lightning import _aliases
from r3lightning.rollout.trajectory import Trajectory

CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"


def _table() -> dict[str, str]:
    """The rows of every release's migration table (0.2.0's, and the moves since)."""
    table: dict[str, str] = {}
    for section in CHANGELOG.read_text().split("### Moved: old import path -> new import path\n")[1:]:
        section = section.split("\n### ", 1)[0]
        table.update(re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \|$", section, flags=re.M))
    return table


TABLE = _table()


def _resolve(path: str) -> object:
    """A module, or an attribute of the longest importable prefix."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def test_the_table_lists_every_alias_and_nothing_else():
    assert TABLE == {**_aliases.NAMES, **_aliases.MODULES, **_aliases.FLAT_MODULES}
    assert {"r3lightning.data.trajectory", "r3lightning.rollout.ahead"} <= set(TABLE)  # moved since 0.2.0
    assert not set(_aliases.NAMES) & {f"r3lightning.{n}" for n in r3lightning.__all__}


@pytest.mark.parametrize("old", sorted(_aliases.NAMES))
def test_a_name_that_left_a_package_warns_and_resolves(old, monkeypatch):
    new = TABLE[old]
    expected = _resolve(new)  # imported from its documented place
    package, _, name = old.rpartition(".")
    monkeypatch.delitem(vars(sys.modules[package]), name, raising=False)  # a cached earlier lookup
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(old)} moved to {re.escape(new)};") as caught:
        value = getattr(sys.modules[package], name)
    assert value is expected
    assert caught[0].filename == __file__  # points at the user's line


@pytest.mark.parametrize("old", sorted(_aliases.MODULES))
def test_a_moved_module_warns_and_is_the_new_module(old, monkeypatch):
    new = TABLE[old]
    expected = importlib.import_module(new)
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{re.escape(old)} moved to {re.escape(new)};") as caught:
        module = importlib.import_module(old)
    assert module is expected
    assert sys.modules[old] is expected  # no second copy of the module
    assert caught[-1].message.args[0].startswith(old)


def _moved_since_0_2() -> set[str]:
    """The old paths of the CHANGELOG's table of moves made after 0.2.0 (the section marked
    ``moved-since-0-2``)."""
    text = CHANGELOG.read_text()
    section = text.split("[start:moved-since-0-2]", 1)[1].split("[end:moved-since-0-2]", 1)[0]
    return set(re.findall(r"^\| `([\w.]+)` \| `[\w.]+` \|$", section, flags=re.M))


@pytest.mark.parametrize("old", sorted(_aliases.MODULES))
def test_the_warning_names_the_release_that_removes_the_old_path(old, monkeypatch):
    """Moves of 0.2 go in 0.3; a move made after 0.2.0 warns for a release first, until 0.4."""
    since = _moved_since_0_2()
    assert since == {"r3lightning.data.trajectory", "r3lightning.rollout.ahead"}
    release = "0.4" if old in since else "0.3"
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"the old path is removed in {re.escape(release)}$"):
        importlib.import_module(old)


def test_a_moved_module_warns_at_the_import_statement(monkeypatch):
    monkeypatch.delitem(sys.modules, "r3lightning.rollout.wire", raising=False)
    with pytest.warns(DeprecationWarning, match="r3lightning.rollout.wire moved") as caught:
        from r3lightning.rollout.wire import encode_routes
    assert caught[0].filename == __file__
    assert encode_routes is importlib.import_module("r3lightning.wire.codec").encode_routes


@pytest.mark.parametrize("old", sorted(_aliases.FLAT_MODULES))
def test_a_module_that_became_a_package_serves_its_old_names(old, monkeypatch):
    new_module = importlib.import_module(TABLE[old])
    package = importlib.import_module(old)
    names = [n for n, v in vars(new_module).items() if getattr(v, "__module__", "").startswith(old)]
    names = [n for n in names if not n.startswith("_")]
    assert names
    for name in names:
        monkeypatch.delitem(vars(package), name, raising=False)
        with pytest.warns(DeprecationWarning, match=f"^{re.escape(old)}.{name} moved to r3lightning"):
            exec(f"from {old} import {name} as value", scope := {})
        assert scope["value"] is getattr(new_module, name)
    with pytest.raises(AttributeError, match=f"module '{old}' has no attribute 'missing'"):
        package.missing  # noqa: B018


def test_old_paths_are_not_files_any_more():
    root = Path(r3lightning.__file__).parent.parent
    for old in _aliases.MODULES:
        path = root / old.replace(".", "/")
        assert not path.with_suffix(".py").exists() and not (path / "__init__.py").exists(), old


def test_a_module_of_a_moved_package_is_the_new_module(monkeypatch):
    """``r3lightning.serve.server`` has no entry of its own: it moves with ``r3lightning.serve``."""
    assert "r3lightning.serve.server" not in _aliases.MODULES
    monkeypatch.delitem(sys.modules, "r3lightning.serve", raising=False)
    monkeypatch.delitem(sys.modules, "r3lightning.serve.server", raising=False)
    with pytest.warns(
        DeprecationWarning, match=r"^r3lightning\.serve\.server moved to r3lightning\.app\.serve\.server;"
    ):
        from r3lightning.serve.server import RolloutServer
    assert RolloutServer is importlib.import_module("r3lightning.app.serve.server").RolloutServer
    assert (
        _aliases.new_module_path("r3lightning.serve.no_such_module") == "r3lightning.app.serve.no_such_module"
    )
    assert (
        _aliases.new_module_path("r3lightning.models.sharded") == "r3lightning.app.job.sharded"
    )  # its own entry
    assert _aliases.new_module_path("r3lightning.rollout.client") is None


def test_python_m_runs_an_old_module_path(tmp_path):
    """``python -m <old path>`` runs the module at the new path as ``__main__``, and says so."""
    root = Path(r3lightning.__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    old = subprocess.run(
        [sys.executable, "-m", "r3lightning.models.tiny_tokenizer", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    new = subprocess.run(
        [sys.executable, "-m", "r3lightning.app.models.tiny_tokenizer", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert old.returncode == 0, old.stderr
    assert old.stdout == new.stdout and "Write a tiny MoE checkpoint" in old.stdout
    assert "r3lightning.models.tiny_tokenizer moved to r3lightning.app.models.tiny_tokenizer;" in old.stderr


def test_a_trajectory_pickled_under_its_old_module_path_loads(monkeypatch):
    """Pickles name a class by its module: one written by 0.2.0 says ``r3lightning.data.trajectory``.
    Protocols 2 and 3 write that name as a text line (``GLOBAL``), so the old pickle is the new one
    with the line swapped."""
    routes = torch.tensor([[[0, 1]], [[2, 3]], [[1, 3]]])  # [3 rows, 1 layer, top_k 2]
    trajectory = Trajectory([5, 6], [7, 8], reward=1.5, routed_experts=routes, weight_version=3)
    new = pickle.dumps(trajectory, protocol=2)
    assert new.count(b"r3lightning.rollout.trajectory\nTrajectory\n") == 1
    old = new.replace(
        b"r3lightning.rollout.trajectory\nTrajectory\n", b"r3lightning.data.trajectory\nTrajectory\n"
    )
    monkeypatch.delitem(sys.modules, "r3lightning.data.trajectory", raising=False)
    with pytest.warns(
        DeprecationWarning, match="^r3lightning.data.trajectory moved to r3lightning.rollout.trajectory;"
    ):
        loaded = pickle.loads(old)
    assert type(loaded) is Trajectory
    assert loaded.equal(trajectory)
    assert loaded.routed_experts.dtype == torch.uint8  # the compact dtype survives
