"""Names a package resolves on first use: the package lists them once, as the imports of its
``if TYPE_CHECKING:`` block (what type checkers and readers see), and this module turns that block
into the package's ``__all__``, ``__getattr__`` and ``__dir__``. Importing such a package imports
none of its modules, so a torch-free caller (the job's config checks) can import it."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["LazyExports"]


def _type_checking_imports(init_file: str) -> dict[str, str]:
    """``{name: defining module}`` of the ``if TYPE_CHECKING:`` block of ``init_file`` (about 1 ms:
    one parse of the file, no import)."""
    with open(init_file, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {
        alias.asname or alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


class LazyExports:
    """The public names of one package, imported from their modules on first use.

    Args:
        package_globals: The package's ``globals()``: its ``__name__`` names it, and each resolved
            value is stored there, so later lookups skip ``__getattr__``.
        init_file: The package's ``__init__.py`` (its ``__file__``), whose ``if TYPE_CHECKING:``
            block lists the names as ``from <module> import <name>``.
        missing: Called with a name the block does not list (e.g. to serve a moved name); None:
            ``AttributeError``.

    Raises:
        StopIteration: ``init_file`` has no ``if TYPE_CHECKING:`` block.
    """

    def __init__(
        self,
        package_globals: dict[str, Any],
        init_file: str,
        missing: Callable[[str], Any] | None = None,
    ) -> None:
        self.package_globals = package_globals
        self.package = package_globals["__name__"]
        self.modules = _type_checking_imports(init_file)  # name -> defining module
        self.missing = missing
        self.names = sorted(self.modules)  # the package's __all__

    def getattr(self, name: str) -> Any:
        """The package's ``__getattr__``: ``name`` imported from its module (once).

        Args:
            name: An attribute the package does not hold yet.

        Returns:
            The value ``name`` has in its defining module.

        Raises:
            AttributeError: ``name`` is not listed and no ``missing`` serves it.
        """
        module = self.modules.get(name)
        if module is None:
            if self.missing is not None:
                return self.missing(name)
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        self.package_globals[name] = value
        return value

    def dir(self) -> list[str]:
        """The package's ``__dir__``: what it holds already and every listed name."""
        return sorted(set(self.package_globals) | set(self.modules))
