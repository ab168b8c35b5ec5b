"""Tiny megatron-core MoE configs and the CPU shims megatron-core 0.16.1 needs, for the megatron tests.

The shims themselves are the package's :func:`r3lightning.testing.megatron_cpu.megatron_device_shims`.

Used in-process by test_megatron_replay and by the spawned ranks of megatron_tp_worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from gloo_ranks import free_port
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from r3lightning.testing.megatron_cpu import megatron_device_shims

LAYERS, EXPERTS, TOP_K, HIDDEN = 4, 8, 2, 16


def cpu_shims():
    """Let megatron-core MoE layers run forward, backward and recompute on the CPU."""
    return megatron_device_shims("cpu")


@contextmanager
def megatron_world() -> Iterator[None]:
    """A world-size-1 gloo group, ``parallel_state`` with TP = CP = PP = 1 and the CPU shims."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        with cpu_shims():
            yield
    finally:
        parallel_state.destroy_model_parallel()
        RouterReplay.clear_global_router_replay_instances()
        if started:
            dist.destroy_process_group()


def make_config(**overrides) -> TransformerConfig:
    """``LAYERS`` decoder layers, the first dense, ``EXPERTS`` experts, top-``TOP_K``, dropless,
    routing replay enabled, fp32 on the CPU; ``overrides`` replace any field."""
    fields = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        ffn_hidden_size=16,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K,
        moe_layer_freq=[0, 1, 1, 1],  # first layer dense
        moe_enable_routing_replay=True,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def make_moe_layer(config: TransformerConfig, layer_number: int | None):
    """A standalone megatron ``MoELayer`` as decoder layer ``layer_number`` (1-based; None leaves
    it unnumbered, as an MoE layer built outside a ``TransformerLayer`` is)."""
    layer = build_module(get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp, config=config)
    if layer_number is not None:
        layer.set_layer_number(layer_number)
    return layer
