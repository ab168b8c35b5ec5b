"""A real vLLM engine for the job and the tests: the launcher, its settings and the model it serves.

Names resolve on first use, so the job reads ``VllmSettings`` (its config schema) without importing
transformers for the model module."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from r3lightning.app.vllm.launcher import VllmServer, VllmStartError
    from r3lightning.app.vllm.model import VLLM_HEAD_DIM, save_tiny_vllm_model, tiny_vllm_moe_config
    from r3lightning.app.vllm.settings import ProcessOptions, ServeOptions, VllmSettings

_MODULES = {
    "VLLM_HEAD_DIM": "model",
    "ProcessOptions": "settings",
    "ServeOptions": "settings",
    "VllmServer": "launcher",
    "VllmSettings": "settings",
    "VllmStartError": "launcher",
    "save_tiny_vllm_model": "model",
    "tiny_vllm_moe_config": "model",
}
__all__ = [
    "VLLM_HEAD_DIM",
    "ProcessOptions",
    "ServeOptions",
    "VllmServer",
    "VllmSettings",
    "VllmStartError",
    "save_tiny_vllm_model",
    "tiny_vllm_moe_config",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)
