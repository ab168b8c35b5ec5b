"""A tiny megatron-core MoE language model for the main job (``model=tiny_megatron_moe``).

Megatron-core's own MoE layers, routers and ``RouterReplay`` between an embedding and an LM head,
token-wise (no attention, so it runs on a CPU), called as a Hugging Face causal LM on the padded
``[B, S]`` batch: the embedded engine serves it and ``GRPOModule`` trains it unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["TinyMegatronMoE", "megatron_runtime", "tiny_megatron_moe"]

# one head, no biases, dropless, fp32 on the CPU, a RouterReplay in every TopKRouter
_MEGATRON_SETTINGS = {
    "num_attention_heads": 1,
    "add_bias_linear": False,
    "moe_enable_routing_replay": True,
    "moe_router_load_balancing_type": "none",
    "moe_token_dispatcher_type": "allgather",
    "use_cpu_initialization": True,
    "params_dtype": torch.float32,
}


class TinyMegatronMoE(nn.Module):
    """Embedding -> [RMSNorm -> megatron MLP or ``MoELayer``, + residual] x layers -> LM head.

    Build it with `tiny_megatron_moe`, inside `megatron_runtime` (megatron's layers need its
    process groups).

    Args:
        transformer_config: Megatron-core's ``TransformerConfig``: sizes, experts, top-k and
            ``moe_layer_freq`` (one 0/1 per layer: dense MLP or ``MoELayer``).
        config: A Hugging Face ``PretrainedConfig``: what the job and the engine read
            (``vocab_size``, ``num_hidden_layers``, ``max_position_embeddings``).
    """

    def __init__(self, transformer_config: Any, config: Any) -> None:
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module

        self.transformer_config = transformer_config
        self.config = config
        hidden = transformer_config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, hidden)
        moe_spec = get_gpt_layer_local_spec(num_experts=transformer_config.num_moe_experts).submodules.mlp
        dense_spec = get_gpt_layer_local_spec().submodules.mlp
        self.norms = nn.ModuleList(nn.RMSNorm(hidden) for _ in transformer_config.moe_layer_freq)
        self.mlps = nn.ModuleList()
        for index, is_moe in enumerate(transformer_config.moe_layer_freq):
            self.mlps.append(build_module(moe_spec if is_moe else dense_spec, config=transformer_config))
            if is_moe:
                self.mlps[-1].set_layer_number(index + 1)  # megatron's 1-based global layer number
        self.head = nn.Linear(hidden, config.vocab_size, bias=False)
        self._backend = None

    def router_replay_backend(self):
        """The [`MegatronRouterReplay`][r3lightning.replay.megatron.replay.MegatronRouterReplay] of this model's routers (built once)."""
        if self._backend is None:
            from r3lightning.replay.megatron.replay import MegatronRouterReplay

            self._backend = MegatronRouterReplay(self, validate=False)
        return self._backend

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The weights without megatron's ``None`` ``_extra_state`` entries: what the engine loads."""
        out = super().state_dict(*args, **kwargs)
        for key in [k for k, v in out.items() if k.endswith("._extra_state") and v is None]:
            del out[key]
        return out

    def forward(self, input_ids: Tensor, logits_to_keep: int = 0, **unused: Any) -> SimpleNamespace:
        """``input_ids [B, S]`` -> ``.logits [B, S or logits_to_keep, V]`` float32; masks, positions
        and a cache are accepted and unused (the model is token-wise)."""
        hidden = self.embed(input_ids).transpose(0, 1)  # [S, B, H]
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            out, _ = mlp(norm(hidden))
            hidden = hidden + out
        if logits_to_keep:
            hidden = hidden[-logits_to_keep:]
        return SimpleNamespace(logits=self.head(hidden).transpose(0, 1).float())


def tiny_megatron_moe(
    *,
    vocab_size: int = 96,
    num_layers: int = 4,
    hidden_size: int = 32,
    ffn_hidden_size: int = 64,
    num_experts: int = 8,
    top_k: int = 2,
    moe_layer_freq: list[int] | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> TinyMegatronMoE:
    """A tiny random `TinyMegatronMoE` in fp32 (``model=tiny_megatron_moe``).

    Call it inside `megatron_runtime`. Initialised from a forked RNG (the global RNG is
    untouched): the same arguments give the same weights.

    Args:
        vocab_size: Token ids.
        num_layers: Decoder layers.
        hidden_size: Width of the residual stream.
        ffn_hidden_size: Width of each expert's (and each dense layer's) MLP.
        num_experts: Experts per MoE layer.
        top_k: Experts each token is routed to.
        moe_layer_freq: One 0 (dense) or 1 (MoE) per layer; None: layer 0 dense, the rest MoE.
        max_position_embeddings: The context the engine allows (the model is token-wise).
        seed: Seeds the random weights.

    Returns:
        The model, in eval mode.

    Raises:
        ValueError: ``moe_layer_freq`` does not have ``num_layers`` entries.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import PretrainedConfig

    freq = list(moe_layer_freq) if moe_layer_freq is not None else [0] + [1] * (num_layers - 1)
    if len(freq) != num_layers:
        raise ValueError(f"moe_layer_freq must have num_layers={num_layers} entries, got {freq}")
    transformer_config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_moe_experts=num_experts,
        moe_router_topk=top_k,
        moe_layer_freq=freq,
        **_MEGATRON_SETTINGS,
    )
    sizes = {"vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings}
    config = PretrainedConfig(**sizes, num_hidden_layers=num_layers, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyMegatronMoE(transformer_config, config)
    return model.eval()


@contextlib.contextmanager
def megatron_runtime(device: str = "cpu") -> Iterator[None]:
    """What megatron-core layers need to run, for as long as the ``with`` block runs: a one-rank
    process group and megatron's ``parallel_state`` (unless already set up) and the device shims.

    The job enters it around a run as ``model.runtime``. What it set up is undone on exit.

    Args:
        device: ``cpu`` (a gloo process group, megatron's CUDA calls redirected) or a CUDA
            device (NCCL).

    Yields:
        Nothing.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from r3lightning.app.models.megatron_cpu import megatron_device_shims

    with megatron_device_shims(device), contextlib.ExitStack() as undo:
        if not dist.is_initialized():
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            undo.callback(dist.destroy_process_group)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel()
            undo.callback(parallel_state.destroy_model_parallel)  # runs first
        yield
