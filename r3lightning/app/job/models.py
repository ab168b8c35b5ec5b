"""Model factories of the job's ``model`` group (yours: any callable returning a Hugging Face-style
causal MoE LM), in their ``dtype``; the embedded engine builds its copy with the same factory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["from_pretrained", "tiny_moe", "torch_dtype"]


def torch_dtype(name: str | torch.dtype, key: str = "dtype") -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a ValueError naming ``key`` for anything else."""
    dtype = name if isinstance(name, torch.dtype) else getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{key} must be a torch dtype name (float32, bfloat16, float16), got {name!r}")
    return dtype


def tiny_moe(
    family: str = "qwen3_moe",
    *,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    dtype: str = "float32",
) -> nn.Module:
    """A tiny random MoE of one ``testing.tiny.TINY_FAMILIES`` family; ``overrides``: its HF config's."""
    from r3lightning.app.models.tiny import TINY_FAMILIES, build_tiny_moe, tiny_family_config

    if family not in TINY_FAMILIES:
        raise ValueError(f"family must be one of {list(TINY_FAMILIES)}, got {family!r}")
    try:
        config = tiny_family_config(family, **(overrides or {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"overrides: {exc}") from None
    return build_tiny_moe(config, seed=seed, dtype=torch_dtype(dtype))


def from_pretrained(
    path: str, *, dtype: str = "float32", attn_implementation: str | None = None, **kwargs: Any
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` of a local directory (no download)."""
    from transformers import AutoModelForCausalLM

    directory = Path(str(path)).expanduser()
    if not directory.is_dir():
        raise ValueError(f"path must be a local checkpoint directory, {directory} is not one")
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch_dtype(dtype), local_files_only=True, **kwargs
    )
