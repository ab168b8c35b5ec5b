"""MegatronRouterReplay against real megatron-core routers, on CPU: layers, refusals and exact placement.

megatron-core 0.16.1 assumes CUDA in places that ``megatron_cpu.cpu_shims`` patches, only while
this module's tests run. A world-size-1 gloo process group and ``parallel_state`` (TP = CP = PP = 1)
back the routers' process groups; other TP / CP positions are exercised by giving the backend
explicit ranks, which only changes which token rows a rank installs.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron_cpu import (
    EXPERTS,
    HIDDEN,
    LAYERS,
    TOP_K,
    distinct_routes,
    make_config,
    make_moe_layer,
    megatron_cpu,  # noqa: F401 (the module's fixture)
)

from r3lightning.align.align import align_packed_token_metadata, build_replay_mask
from r3lightning.align.dummy import dummy_routes
from r3lightning.packed import PackedTensor
from r3lightning.replay.megatron.replay import (
    MegatronParallelism,
    MegatronRouterReplay,
    megatron_token_layout,
)

pytestmark = pytest.mark.usefixtures("megatron_cpu")


@pytest.fixture(scope="module")
def block() -> TransformerBlock:
    torch.manual_seed(0)
    config = make_config()
    return TransformerBlock(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False))


def reference_positions(lengths, tp, tp_rank, cp, cp_rank):
    """(sequence, offset) or None for each token this TP rank's routers see, by plain loops."""
    multiple = 2 * tp * cp if cp > 1 else tp
    positions = []
    for i, n in enumerate(lengths):
        padded = math.ceil(n / multiple) * multiple
        span = [(i, j) if j < n else None for j in range(padded)]
        if cp > 1:
            chunk = padded // (2 * cp)
            first, second = cp_rank, 2 * cp - 1 - cp_rank
            span = span[first * chunk : (first + 1) * chunk] + span[second * chunk : (second + 1) * chunk]
        positions += span
    share = len(positions) // tp
    return positions[tp_rank * share : (tp_rank + 1) * share]


def softmax_probs_at(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[N, E] probabilities megatron's softmax-after-top-k gives ``experts``, from live logits."""
    picked = logits.gather(1, experts)
    return torch.zeros_like(logits).scatter(1, experts, torch.softmax(picked, dim=-1))


def test_moe_layers_of_full_model_and_pipeline_stages(block):
    assert MegatronRouterReplay(block).moe_layers == (1, 2, 3)  # layer 0 is dense
    stage0 = MegatronRouterReplay(list(block.layers[:2]), parallelism=MegatronParallelism())
    stage1 = MegatronRouterReplay(list(block.layers[2:]), parallelism=MegatronParallelism())
    assert (stage0.moe_layers, stage1.moe_layers) == ((1,), (2, 3))
    assert (stage1.num_layers, stage1.top_k, stage1.num_experts) == (LAYERS, TOP_K, EXPERTS)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            dict(virtual_pipeline_model_parallel_size=2),
            "virtual pipeline parallelism.*cannot tell the virtual stage of the router at decoder layer 1",
        ),
        (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
        (dict(moe_expert_capacity_factor=1.0), "dropless MoE"),
    ],
)
def test_unsupported_configs_are_refused(block, overrides, match):
    bad = dataclasses.replace(block.config)  # a copy; set afterwards to skip megatron's own checks
    for key, value in overrides.items():
        setattr(bad, key, value)
    with pytest.raises(ValueError, match=match):
        MegatronRouterReplay(block, bad)


def test_model_chunks_of_virtual_stages_need_vp_stage_on_install(block):
    class Chunk(torch.nn.Module):
        def __init__(self, layer, stage):
            super().__init__()
            self.layer, self.vp_stage = layer, stage

    backend = MegatronRouterReplay([Chunk(block.layers[1], 0), Chunk(block.layers[2], 1)])
    assert backend.vp_stages == (0, 1)
    routes = dummy_routes(4, LAYERS, TOP_K, EXPERTS).reshape(1, 4, LAYERS, TOP_K)
    with pytest.raises(ValueError, match=r"install\(\.\.\., vp_stage=\) is required"):
        backend.install(routes)
    with pytest.raises(ValueError, match=r"vp_stage must be one of \[0, 1\]"):
        backend.install(routes, vp_stage=2)
    backend.install(routes, vp_stage=1)  # only the stage-1 chunk's router takes them
    assert block.layers[1].mlp.router.router_replay.target_topk_idx is None
    assert block.layers[2].mlp.router.router_replay.target_topk_idx.shape == (4, TOP_K)
    backend.clear()
    with pytest.raises(ValueError, match="no virtual pipeline stages"):
        MegatronRouterReplay(block).install(routes, vp_stage=1)


def test_routers_without_replay_or_layer_number_are_refused():
    plain = make_moe_layer(make_config(moe_enable_routing_replay=False), 2)
    with pytest.raises(ValueError, match="moe_enable_routing_replay=True"):
        MegatronRouterReplay(plain)
    unnumbered = make_moe_layer(make_config(), None)
    with pytest.raises(ValueError, match="set_layer_number"):
        MegatronRouterReplay(unnumbered)
    with pytest.raises(ValueError, match="no megatron TopKRouter"):
        MegatronRouterReplay(torch.nn.Linear(2, 2))


def test_install_rejects_bad_routes(block):
    backend = MegatronRouterReplay(block, parallelism=MegatronParallelism(tp_size=2, sequence_parallel=True))
    good = torch.zeros(1, 8, LAYERS, TOP_K, dtype=torch.uint8)
    good[..., 1] = 1
    with pytest.raises(TypeError, match="integer tensor"):
        backend.install(good.float())
    with pytest.raises(ValueError, match=r"num_layers=4, top_k=2"):
        backend.install(good[:, :, :3])
    with pytest.raises(ValueError, match="replay_mask must be a bool tensor of shape"):
        backend.install(good, torch.ones(1, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"expected ids in \[0, 7\]"):
        backend.install(good + 8)
    with pytest.raises(ValueError, match="repeat an expert"):
        backend.install(torch.zeros_like(good))
    with pytest.raises(ValueError, match="not divisible by tp_size=2"):
        backend.install(good[:, :7])
    assert all(r.router_replay.target_topk_idx is None for r in backend_routers(block))


def backend_routers(module):
    return [m for m in module.modules() if isinstance(m, TopKRouter)]


@pytest.mark.parametrize(("tp", "cp"), [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4)])
def test_packed_routes_reach_each_layer_exactly(block, tp, cp):
    generator = torch.Generator().manual_seed(tp * 10 + cp)
    lengths = [5, 11, 1, 8]
    captured = [n - 1 for n in lengths]  # the last token of each trajectory has no captured route
    segments = [distinct_routes(n, generator) for n in captured]
    packed = PackedTensor.from_segments(segments)
    width = max(lengths)
    attention_mask = torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            backend = MegatronRouterReplay(
                block, parallelism=MegatronParallelism(tp, tp_rank, cp, cp_rank, sequence_parallel=tp > 1)
            )
            layout = backend.build_layout(attention_mask)
            routes = align_packed_token_metadata(
                packed, layout, pad=lambda n: dummy_routes(n, LAYERS, TOP_K, EXPERTS)
            )
            backend.install(routes, build_replay_mask(packed, layout))
            expected = reference_positions(lengths, tp, tp_rank, cp, cp_rank)
            replayed = [p is not None and p[1] < captured[p[0]] for p in expected]
            for layer, router in zip(backend.moe_layers, backend_routers(block), strict=True):
                replay = router.router_replay
                target = replay.target_topk_idx
                assert target.dtype == torch.int64 and target.shape == (len(expected), TOP_K)
                assert replay.target_mask.tolist() == replayed
                for row, (position, used) in enumerate(zip(expected, replayed, strict=True)):
                    if used:
                        sequence, offset = position
                        assert target[row].tolist() == segments[sequence][offset, layer].tolist()
                # megatron's own routing function consumes exactly these rows
                logits = torch.randn(len(expected), EXPERTS, generator=generator)
                probs, routing_map = moe_utils.topk_routing_with_score_function(
                    logits, TOP_K, router_replay=replay
                )
                native = logits.topk(TOP_K, dim=-1).indices
                keep = torch.tensor(replayed)[:, None]
                used_experts = torch.where(keep, target, native)
                assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, used_experts, True))
                torch.testing.assert_close(probs, softmax_probs_at(logits, used_experts))
            backend.clear()
            assert all(r.router_replay.target_topk_idx is None for r in backend_routers(block))


def test_unpacked_batch_is_split_in_megatron_token_order(block):
    """[B, S] routes: TP rank r keeps sequence positions r*S/TP.. and flattens them [s, b]-major."""
    batch, width, tp = 3, 8, 2
    routes = distinct_routes(batch * width, torch.Generator().manual_seed(1)).reshape(
        batch, width, LAYERS, TOP_K
    )
    for tp_rank in range(tp):
        backend = MegatronRouterReplay(
            block, parallelism=MegatronParallelism(tp, tp_rank, sequence_parallel=True)
        )
        backend.install(routes)
        share = width // tp
        for layer, router in zip(backend.moe_layers, backend_routers(block), strict=True):
            target = router.router_replay.target_topk_idx
            for s in range(share):
                for b in range(batch):
                    assert target[s * batch + b].tolist() == routes[b, tp_rank * share + s, layer].tolist()
        backend.clear()


def test_layout_helper_reads_parallel_state_or_explicit_sizes():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert MegatronParallelism.resolve() == MegatronParallelism(1, 0, 1, 0, False)  # world size 1
    packed = megatron_token_layout(mask)
    assert packed.token_shape == (1, 8) and packed.cu_seqlens_padded.tolist() == [0, 3, 8]
    sharded = megatron_token_layout(mask, parallelism=MegatronParallelism(2, 1, 2, 1, True))
    assert sharded.pad_to_multiple == 8 and sharded.token_shape == (1, 8) and sharded.cp_rank == 1
    unpacked = megatron_token_layout(mask, packed=False, parallelism=MegatronParallelism(2, 0, 1, 0, True))
    assert unpacked.token_shape == (2, 6) and unpacked.side == "right"
    with pytest.raises(ValueError, match=r"context parallelism.*packed layout"):
        megatron_token_layout(mask, packed=False, parallelism=MegatronParallelism(cp_size=2))


def test_topk_router_forward_replays_masked_rows_and_trains_the_router(block):
    router = backend_routers(block)[0]  # layer 1
    backend = MegatronRouterReplay(block)
    generator = torch.Generator().manual_seed(2)
    tokens = 6
    hidden = torch.randn(tokens, 1, HIDDEN, generator=generator)  # [s, b, h]
    routes = torch.zeros(1, tokens, LAYERS, TOP_K, dtype=torch.int64)
    routes[..., 1, :] = distinct_routes(tokens, generator)[:, 1].long()
    routes[..., 2:, :] = dummy_routes(tokens, 2, TOP_K, EXPERTS).long()
    mask = torch.tensor([[True, True, False, True, True, False]])
    backend.install(routes, mask)
    router.weight.grad = None
    probs, routing_map = router(hidden)
    logits = hidden.reshape(tokens, HIDDEN) @ router.weight.t()
    native = logits.topk(TOP_K, dim=-1).indices
    used = torch.where(mask.reshape(tokens, 1), routes[0, :, 1], native)
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, used, True))
    torch.testing.assert_close(probs, softmax_probs_at(logits, used))
    (probs * torch.arange(EXPERTS)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    stats = backend.routing_stats()
    hits = (routes[0, :, 1, :, None] == native[:, None, :]).any(-1) & mask.reshape(tokens, 1)
    assert stats["layers"] == (1, 2, 3) and stats["top_k"] == TOP_K
    assert stats["replayed_rows"].tolist() == [4, 0, 0]
    assert stats["agreeing_slots"].tolist() == [int(hits.sum()), 0, 0]
    backend.clear()
    assert backend.routing_stats()["replayed_rows"].tolist() == [0, 0, 0]
    assert router.router_replay.router_replay_action is None


def test_token_count_mismatch_is_an_error(block):
    router = backend_routers(block)[0]
    backend = MegatronRouterReplay(block)
    backend.install(dummy_routes(8, LAYERS, TOP_K, EXPERTS).reshape(1, 8, LAYERS, TOP_K))
    with pytest.raises(ValueError, match=r"routes 6 tokens.*hold 8 rows"):
        router(torch.randn(6, 1, HIDDEN))
    backend.clear()


def test_dense_layer_zero_rows_install_but_not_on_an_moe_layer(block):
    """An engine's all-zero dense-layer rows are never looked at; on an MoE layer they repeat expert 0."""
    backend = MegatronRouterReplay(block)  # validate=True
    routes = dummy_routes(5, LAYERS, TOP_K, EXPERTS).reshape(1, 5, LAYERS, TOP_K)
    routes[..., 0, :] = 0  # layer 0 is dense
    backend.install(routes)
    backend.clear()
    routes[0, 2, 1] = 0
    with pytest.raises(ValueError, match="repeat an expert within a token's top_k on a replayed MoE layer"):
        backend.install(routes)
    backend.clear()


def test_sliced_routes_reach_each_router_as_their_widened_copy_would(block):
    """A stage's columns with their layer ids: each router gets exactly the rows the same routes on
    all layers give it, without the widened copy."""
    generator = torch.Generator().manual_seed(5)
    full = distinct_routes(12, generator).reshape(2, 6, LAYERS, TOP_K)  # [B, S, L, K]
    backend = MegatronRouterReplay(block)
    layers = backend.moe_layers  # layer 0 is dense: its column is not held
    assert layers == (1, 2, 3)
    sliced = full[..., list(layers), :]
    backend.install(full)
    expected = [r.router_replay.target_topk_idx.clone() for r in backend_routers(block)]
    backend.clear()
    backend.install(sliced, layers=layers)
    got = [r.router_replay.target_topk_idx for r in backend_routers(block)]
    assert len(got) == len(backend.moe_layers) and all(
        torch.equal(a, b) for a, b in zip(got, expected, strict=True)
    )
    backend.clear()
    with pytest.raises(ValueError, match=r"routes must have shape \[B, S, \d+ layers \(one per route layer"):
        backend.install(full, layers=layers)
