"""Tiny megatron-core MoE configs and the CPU shims megatron-core 0.16.1 needs, for the megatron tests.

The shims themselves are the package's :func:`r3lightning.app.models.megatron_cpu.megatron_device_shims`.

Used in-process by the megatron replay tests (their ``megatron_cpu`` fixture, models and route
helpers) and by the spawned ranks of megatron_tp_worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import free_port
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from r3lightning.app.models.megatron_cpu import megatron_device_shims

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


@pytest.fixture(scope="module")
def megatron_cpu():
    """The megatron world for a test module: import it and name it in
    ``pytestmark = pytest.mark.usefixtures("megatron_cpu")``."""
    with megatron_world():
        yield


def distinct_routes(rows: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, LAYERS, TOP_K] uint8, distinct experts per row."""
    scores = torch.rand(rows, LAYERS, EXPERTS, generator=generator)
    return scores.topk(TOP_K, dim=-1).indices.to(torch.uint8)


def stage_routes(rows: int, layers: int, seed: int) -> torch.Tensor:
    """[1, rows, layers, TOP_K] uint8, distinct random experts per row."""
    scores = torch.rand(rows, layers, EXPERTS, generator=torch.Generator().manual_seed(seed))
    return scores.topk(TOP_K, dim=-1).indices.to(torch.uint8)[None]


class UsedExperts:
    """Hooks every router: the experts each call (forward or recompute) used, as sorted lists."""

    def __init__(self, routers: list[TopKRouter]) -> None:
        self.calls: list[tuple[int, list[list[int]]]] = []  # (decoder layer, experts per token)
        self.handles = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, router, args, output) -> None:
        _, routing_map = output  # [N, E] bool
        experts = [row.nonzero().flatten().tolist() for row in routing_map]
        self.calls.append((router.layer_number - 1, experts))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def sorted_rows(routes: torch.Tensor, layer: int) -> list[list[int]]:
    """Installed routes [1, N, L, K] of one layer as sorted expert lists per token."""
    return [sorted(row) for row in routes[0, :, layer].tolist()]


class TokenMoE(torch.nn.Module):
    """Embedding -> two megatron MoELayers (decoder layers 1 and 3, residual) -> LM head."""

    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        config = make_config()
        self.embed = torch.nn.Embedding(vocab, HIDDEN)
        self.moe = torch.nn.ModuleList([make_moe_layer(config, 2), make_moe_layer(config, 4)])
        self.head = torch.nn.Linear(HIDDEN, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, vocab]
        hidden = self.embed(tokens).transpose(0, 1)  # megatron's [s, b, h]
        for layer in self.moe:
            hidden = hidden + layer(hidden)[0]
        return self.head(hidden).transpose(0, 1)
