"""Model factories of the job's ``model`` group (yours: any callable returning a Hugging Face-style
causal MoE LM), in their ``dtype``; the embedded engine builds its copy with the same factory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["from_pretrained", "tiny_moe", "torch_dtype"]


def torch_dtype(name: str | torch.dtype, key: str = "dtype") -> torch.dtype:
    """The ``torch.dtype`` a config value names.

    Args:
        name: A dtype name such as ``"bfloat16"``, or a ``torch.dtype`` (returned as it is).
        key: The config key ``name`` came from, for the error message.

    Returns:
        The dtype, e.g. ``torch.bfloat16``.

    Raises:
        ValueError: ``name`` is not a torch dtype; the message names ``key``.
    """
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
    """A tiny random MoE LM of one of the families in ``r3lightning.app.models.tiny.TINY_FAMILIES``.

    Args:
        family: The Hugging Face model family (``qwen3_moe``, ...).
        seed: Seeds the random weights: the trainer and the embedded engine build the same model.
        overrides: Keys of the family's HF config to change (``num_hidden_layers``, ...).
        dtype: The parameters' dtype name.

    Returns:
        The model, in eval mode.

    Raises:
        ValueError: An unknown ``family`` or dtype, or an override its HF config refuses (the
            message starts with ``overrides:``).
    """
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
    """``AutoModelForCausalLM.from_pretrained`` of a local checkpoint directory; never downloads.

    Args:
        path: The checkpoint directory (``~`` is expanded).
        dtype: The parameters' dtype name.
        attn_implementation: Passed on when set (``"sdpa"``, ``"eager"``, ...); None keeps
            transformers' choice.
        **kwargs: More ``from_pretrained`` keywords.

    Returns:
        The model, in eval mode (as ``from_pretrained`` returns it).

    Raises:
        ValueError: ``path`` is not a directory, or ``dtype`` not a torch dtype name.
    """
    from transformers import AutoModelForCausalLM

    directory = Path(str(path)).expanduser()
    if not directory.is_dir():
        raise ValueError(f"path must be a local checkpoint directory, {directory} is not one")
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch_dtype(dtype), local_files_only=True, **kwargs
    )
