"""Packages whose names resolve on first use: the ``if TYPE_CHECKING:`` block is their one list of
public names. Checked against the block as written, read here with a plain parse."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

LAZY_PACKAGES = ["r3lightning", "r3lightning.correction", "r3lightning.app.vllm"]


def _written(package: str) -> dict[str, str]:
    """``{name: module}`` of the package's TYPE_CHECKING imports, parsed here independently."""
    path = Path(importlib.util.find_spec(package).origin)
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                out.update({alias.name: stmt.module for alias in stmt.names})
    return out


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_listed_name_is_exported_and_is_its_modules_object(package):
    module = importlib.import_module(package)
    written = _written(package)
    assert written and module.__all__ == sorted(written)
    for name, source in written.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), name), name
    assert set(written) <= set(dir(module))


@pytest.mark.parametrize("package", LAZY_PACKAGES[1:])
def test_an_unlisted_name_is_an_attribute_error_naming_the_package(package):
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match=rf"^module '{package}' has no attribute 'no_such_name'$"):
        module.no_such_name  # noqa: B018


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_importing_the_package_imports_none_of_its_modules(package):
    code = f"import json, sys, {package}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(json.loads(out))
    assert sorted(set(_written(package).values()) & loaded) == []
    assert "torch" not in loaded
