"""Code on the new paths runs under ``-W error::DeprecationWarning`` (the migration page's advice):
every module of the package imports in a fresh interpreter with DeprecationWarning as an error, so
no module uses a name or a path that this release deprecated."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

from python_process import REPO

import r3lightning

# Upstream's own deprecations, raised inside megatron-core's import (an optional dependency, not
# this package's use): filtered by their exact message, nothing broader.
UPSTREAM = (
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
    "ignore:The following imports from `dynamic_context.py` will be removed:DeprecationWarning",
)

# one interpreter: a deprecated name raises before its alias caches it, so a module imported
# earlier cannot hide a later module's use of it
_IMPORT_ALL = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}")
"""


def test_every_module_imports_with_deprecation_warnings_as_errors():
    names = sorted(m.name for m in pkgutil.walk_packages(r3lightning.__path__, "r3lightning."))
    assert "r3lightning.app.serve.perturb" in names and len(names) > 50
    flags = [arg for entry in UPSTREAM for arg in ("-W", entry)]  # later -W options take precedence
    proc = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", *flags, "-c", _IMPORT_ALL, *names],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == []
