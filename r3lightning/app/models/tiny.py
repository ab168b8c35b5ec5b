"""Tiny randomly initialised Hugging Face MoE models (deterministic, offline, milliseconds on a
CPU); the default ``Qwen3MoeForCausalLM`` has a dense layer 0, so dense route rows are exercised."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import transformers

if TYPE_CHECKING:
    from transformers import PretrainedConfig, Qwen3MoeConfig

# Shared by every family: a 64-wide model small enough for a 1-thread CPU test.
_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "num_experts_per_tok": 2,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_QWEN = {"num_experts": 8, "moe_intermediate_size": 32}
_DEEPSEEK = {
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "n_group": 2,
    "moe_intermediate_size": 32,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}
_GPT_OSS = {
    "num_local_experts": 8,
    "head_dim": 16,
    "sliding_window": 8,
    # plain RoPE: the YaRN defaults assume a 4k original context
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

# family -> (its transformers config class, by name: resolved on use, so a server of the default
# Qwen3-MoE never imports the other families' modules; the tiny settings)
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {**_QWEN, "head_dim": 16, "norm_topk_prob": True, "mlp_only_layers": [0]},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {**_QWEN, "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1]},
    ),
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "norm_topk_prob": False}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "head_dim": 16}),
    "deepseek_v3": ("DeepseekV3Config", _DEEPSEEK),
    "gpt_oss": ("GptOssConfig", _GPT_OSS),
}

TINY_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def tiny_family_config(family: str, **overrides: Any) -> PretrainedConfig:
    """A tiny Hugging Face config of one MoE family.

    Args:
        family: One of ``TINY_FAMILIES``.
        **overrides: Config keys that win over the tiny defaults (``num_hidden_layers``, ...).

    Returns:
        The family's config class, built with the tiny sizes. gpt-oss gets one ``layer_types``
        entry per layer (sliding and full attention alternating) unless overridden.

    Raises:
        ValueError: An unknown family, or a value the config class refuses.
        TypeError: A keyword the config class refuses.
    """
    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {TINY_FAMILIES}, got {family!r}")
    config_name, family_kwargs = _FAMILIES[family]
    config_cls = getattr(transformers, config_name)  # imports this family's config module only
    kwargs = {**_COMMON, **family_kwargs, **overrides}
    if family == "gpt_oss" and "layer_types" not in overrides:  # one per layer: follows num_hidden_layers
        kinds = ("sliding_attention", "full_attention")
        kwargs["layer_types"] = [kinds[i % 2] for i in range(kwargs["num_hidden_layers"])]
    return config_cls(**kwargs)


def tiny_moe_config(**overrides: Any) -> Qwen3MoeConfig:
    """The default tiny config: Qwen3-MoE, vocab 96, hidden 64, 4 layers (layer 0 dense), 8
    experts, top-2.

    Args:
        **overrides: Config keys that win over the tiny defaults.

    Returns:
        The ``Qwen3MoeConfig``.
    """
    return tiny_family_config("qwen3_moe", **overrides)


def build_tiny_moe(
    config: PretrainedConfig | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A tiny random causal MoE LM, the same for the same ``config`` and ``seed``.

    Initialised in fp32 from a forked RNG (the global RNG is untouched), then cast: every dtype
    starts from the same weights.

    Args:
        config: Its Hugging Face config; None: `tiny_moe_config`.
        seed: Seeds the random weights.
        dtype: The parameters' dtype.

    Returns:
        The model, in eval mode.
    """
    config = tiny_moe_config() if config is None else config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype).eval()
