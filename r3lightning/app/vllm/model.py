"""The tiny Qwen3-MoE as a model directory vLLM loads (``config.json``, safetensors weights and the
tiny character tokenizer, which ``/v1/completions`` needs even for token-id prompts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3MoeConfig

from r3lightning.app.models.tiny import build_tiny_moe, tiny_moe_config
from r3lightning.app.models.tiny_tokenizer import build_tiny_tokenizer

# vLLM's CPU attention has no kernel for head_dim 16 (the default tiny model's); 32 is the
# smallest it serves. Only the attention width changes: vocab, layers, experts and top-k stay.
VLLM_HEAD_DIM = 32


def tiny_vllm_moe_config(**overrides: Any) -> Qwen3MoeConfig:
    """``tiny_moe_config()`` with ``head_dim=VLLM_HEAD_DIM``: the tiny model vLLM can serve.

    Args:
        **overrides: config fields that win over the tiny defaults.

    Returns:
        A ``Qwen3MoeConfig`` (vocab 96, 4 layers with layer 0 dense, 8 experts, top-2).
    """
    return tiny_moe_config(**({"head_dim": VLLM_HEAD_DIM} | overrides))


def save_tiny_vllm_model(
    directory: str | Path, *, seed: int = 0, config: Qwen3MoeConfig | None = None
) -> Path:
    """Write the tiny vLLM model (fp32 weights, seeded) and the tiny tokenizer where ``vllm serve``
    can load them.

    The engine casts to its ``--dtype`` at load time, so an fp32 engine serves exactly the weights
    ``build_tiny_moe(tiny_vllm_moe_config(), seed=seed)`` builds in the trainer.

    Args:
        directory: the model directory (created if missing).
        seed: the initialisation seed of `build_tiny_moe`.
        config: the config to build (default `tiny_vllm_moe_config`).

    Returns:
        The directory, holding ``config.json``, ``generation_config.json``, ``model.safetensors`` and
        the tokenizer files (its ids 0-2 are the config's pad, bos and eos).
    """
    directory = Path(directory)
    model = build_tiny_moe(
        tiny_vllm_moe_config() if config is None else config, seed=seed, dtype=torch.float32
    )
    model.save_pretrained(directory, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory
