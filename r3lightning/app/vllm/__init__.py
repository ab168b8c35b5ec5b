"""A real vLLM engine for the job and the tests: the launcher, its settings and the model it serves.

Names resolve on first use, so the job reads ``VllmSettings`` (its config schema) without importing
transformers for the model module."""

from __future__ import annotations

from typing import TYPE_CHECKING

from r3lightning._lazy import LazyExports

# ruff: noqa: F401
if TYPE_CHECKING:  # the one list of public names: type checkers read it, LazyExports parses it
    from r3lightning.app.vllm.launcher import VllmServer, VllmStartError
    from r3lightning.app.vllm.model import VLLM_HEAD_DIM, save_tiny_vllm_model, tiny_vllm_moe_config
    from r3lightning.app.vllm.settings import ProcessOptions, ServeOptions, VllmSettings

_EXPORTS = LazyExports(globals(), __file__)
__all__ = _EXPORTS.names
__getattr__ = _EXPORTS.getattr
__dir__ = _EXPORTS.dir
