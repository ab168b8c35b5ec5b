"""MegatronRouterReplay against real megatron-core routers, on CPU.

megatron-core 0.16.1 assumes CUDA in places that ``megatron_cpu.cpu_shims`` patches, only while
this module's tests run. A world-size-1 gloo process group and ``parallel_state`` (TP = CP = PP = 1)
back the routers' process groups; other TP / CP positions are exercised by giving the backend
explicit ranks, which only changes which token rows a rank installs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import parallel_state
from megatron.core.fusions import fused_softmax
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron_cpu import EXPERTS, HIDDEN, LAYERS, TOP_K, make_config, make_moe_layer, megatron_world

from r3lightning.align.align import align_packed_token_metadata, build_replay_mask
from r3lightning.align.dummy import dummy_routes
from r3lightning.packed import PackedTensor
from r3lightning.replay.backend import RouterReplayBackend
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.megatron.replay import (
    MegatronParallelism,
    MegatronRouterReplay,
    megatron_token_layout,
)

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh single-threaded interpreter importing this checkout; it must succeed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=180, cwd=cwd, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module", autouse=True)
def megatron_cpu():
    with megatron_world():
        yield


@pytest.fixture(scope="module")
def block() -> TransformerBlock:
    torch.manual_seed(0)
    config = make_config()
    return TransformerBlock(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False))


def random_routes(rows: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, LAYERS, TOP_K] uint8, distinct experts per row."""
    scores = torch.rand(rows, LAYERS, EXPERTS, generator=generator)
    return scores.topk(TOP_K, dim=-1).indices.to(torch.uint8)


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


# --------------------------------------------------------------------------- layers and refusals
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


# --------------------------------------------------------------------------- exact placement
@pytest.mark.parametrize(("tp", "cp"), [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4)])
def test_packed_routes_reach_each_layer_exactly(block, tp, cp):
    generator = torch.Generator().manual_seed(tp * 10 + cp)
    lengths = [5, 11, 1, 8]
    captured = [n - 1 for n in lengths]  # the last token of each trajectory has no captured route
    segments = [random_routes(n, generator) for n in captured]
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
    routes = random_routes(batch * width, torch.Generator().manual_seed(1)).reshape(
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


# --------------------------------------------------------------------------- real router forward
def test_topk_router_forward_replays_masked_rows_and_trains_the_router(block):
    router = backend_routers(block)[0]  # layer 1
    backend = MegatronRouterReplay(block)
    generator = torch.Generator().manual_seed(2)
    tokens = 6
    hidden = torch.randn(tokens, 1, HIDDEN, generator=generator)  # [s, b, h]
    routes = torch.zeros(1, tokens, LAYERS, TOP_K, dtype=torch.int64)
    routes[..., 1, :] = random_routes(tokens, generator)[:, 1].long()
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


def test_record_then_replay_round_trip_unpacked_batch():
    torch.manual_seed(3)
    config = make_config()
    layer = make_moe_layer(config, 3)  # decoder layer index 2
    backend = MegatronRouterReplay(layer)
    hidden = torch.randn(5, 2, HIDDEN)  # [s, b, h]
    backend.start_recording()
    layer(hidden)
    recorded = backend.stop_recording()
    logits = hidden.reshape(10, HIDDEN) @ layer.router.weight.t()  # rows in [s, b] order
    native = logits.topk(TOP_K, dim=-1).indices.reshape(5, 2, TOP_K).transpose(0, 1)  # [b, s, k]
    assert recorded.shape == (2, 5, LAYERS, TOP_K) and recorded.dtype == torch.int32
    assert torch.equal(recorded[:, :, 2].long(), native)
    assert not recorded[:, :, [0, 1, 3]].any()
    # replay different experts, and record what was used under replay
    replayed = recorded.clone()
    replayed[:, :, 2] = dummy_routes(10, 1, TOP_K, EXPERTS).reshape(2, 5, TOP_K)
    backend.install(replayed)
    backend.start_recording()
    layer(hidden)
    assert torch.equal(backend.stop_recording(), replayed)
    backend.clear()
    with pytest.raises(RuntimeError, match="no forward pass"):
        backend.stop_recording()


def test_backend_protocol_and_context_managers():
    torch.manual_seed(7)
    layer = make_moe_layer(make_config(), 2)
    backend = MegatronRouterReplay(layer)
    assert isinstance(backend, RouterReplayBackend)
    assert backend.routers == [layer.router]
    hidden = torch.randn(3, 2, HIDDEN)
    with record_routes(backend) as native:
        layer(hidden)
    swapped = native.routes.flip(-1)  # same experts, other slot order: replay must keep the order
    swapped[0, 0, 1] = torch.tensor([6, 7], dtype=swapped.dtype)
    with replay_routes(backend, swapped) as replaying, record_routes(replaying) as used:
        layer(hidden)
        stats = replaying.routing_stats()
    assert torch.equal(used.routes, swapped)
    assert stats["replayed_rows"].tolist() == [6]
    native_pair = set(native.routes[0, 0, 1].tolist())
    assert stats["agreeing_slots"].tolist() == [5 * TOP_K + len(native_pair & {6, 7})]
    assert layer.router.router_replay.target_topk_idx is None  # cleared on exit


def test_recording_under_sequence_parallelism_needs_the_tp_group():
    layer = make_moe_layer(make_config(), 2)
    with pytest.raises(ValueError, match="tp_rank must be an int in \\[0, 2\\)"):
        MegatronRouterReplay(layer, parallelism=MegatronParallelism(tp_size=2, tp_rank=2))
    backend = MegatronRouterReplay(layer, parallelism=MegatronParallelism(tp_size=2, sequence_parallel=True))
    backend.start_recording()
    layer(torch.randn(4, 1, HIDDEN))
    group = parallel_state.get_tensor_model_parallel_group()  # size 1: stands in for the TP group
    gathered = MegatronRouterReplay(layer, parallelism=MegatronParallelism(), tp_group=group).stop_recording()
    assert gathered.shape == (1, 4, LAYERS, TOP_K)
    backend.clear()


# --------------------------------------------------------------------------- recomputation
def replayed_moe_grads(layer, hidden, routes_per_microbatch):
    """Forward every microbatch (installing its routes first), then backward in forward order."""
    backend = MegatronRouterReplay(layer)
    layer.zero_grad(set_to_none=True)
    outputs = []
    for x, routes in zip(hidden, routes_per_microbatch, strict=True):
        backend.install(routes)
        outputs.append(layer(x)[0])
    queued = len(layer.router.router_replay.replay_backward_list)
    for out in outputs:
        out.pow(2).sum().backward()
    left = len(layer.router.router_replay.replay_backward_list)
    stats = backend.routing_stats()
    backend.clear()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return grads, queued, left, stats


def test_activation_recompute_replays_each_microbatchs_routes():
    """megatron's own MoE-layer recompute (selective, "moe") replays each microbatch's routes."""
    torch.manual_seed(4)
    layer = make_moe_layer(make_config(), 2)
    recomputing = make_moe_layer(make_config(recompute_granularity="selective", recompute_modules=["moe"]), 2)
    recomputing.load_state_dict(layer.state_dict())
    assert recomputing.moe_layer_recompute
    generator = torch.Generator().manual_seed(5)
    hidden = [torch.randn(4, 1, HIDDEN, requires_grad=True) for _ in range(2)]
    routes = [random_routes(4, generator).reshape(1, 4, LAYERS, TOP_K) for _ in range(2)]
    plain, queued, left, stats = replayed_moe_grads(layer, hidden, routes)
    assert (queued, left) == (2, 2)  # nothing recomputed: entries stay until clear()
    recomputed, queued, left, recomputed_stats = replayed_moe_grads(recomputing, hidden, routes)
    assert (queued, left) == (2, 0)  # REPLAY_BACKWARD consumed one entry per recomputation
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, msg=name)
    assert plain["router.weight"].abs().sum() > 0
    # forwards are counted once, recomputation never
    assert recomputed_stats["replayed_rows"].tolist() == stats["replayed_rows"].tolist() == [8]


def test_torch_checkpoint_recompute_replays_with_mask():
    torch.manual_seed(6)
    layer = make_moe_layer(make_config(), 2)
    backend = MegatronRouterReplay(layer)
    x = torch.randn(4, 1, HIDDEN, requires_grad=True)
    routes = dummy_routes(4, LAYERS, TOP_K, EXPERTS).reshape(1, 4, LAYERS, TOP_K)
    mask = torch.tensor([[True, False, True, True]])
    grads = []
    for checkpointed in (False, True):
        layer.zero_grad(set_to_none=True)
        backend.install(routes, mask)
        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(lambda h: layer(h)[0], x, use_reentrant=False)
        else:
            out = layer(x)[0]
        out.pow(2).sum().backward()
        backend.clear()
        grads.append(layer.router.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0])


def test_recompute_after_clear_is_an_error():
    layer = make_moe_layer(make_config(), 2)
    backend = MegatronRouterReplay(layer)
    backend.install(dummy_routes(4, LAYERS, TOP_K, EXPERTS).reshape(1, 4, LAYERS, TOP_K))
    x = torch.randn(4, 1, HIDDEN, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(lambda h: layer(h)[0], x, use_reentrant=True)
    backend.clear()
    backend.install(dummy_routes(4, LAYERS, TOP_K, EXPERTS).reshape(1, 4, LAYERS, TOP_K))
    layer.router.router_replay.replay_backward_list.clear()
    layer.router.router_replay.replay_backward_masks.clear()
    with pytest.raises(RuntimeError, match="no queued routes"):
        out.sum().backward()
    backend.clear()


def test_global_instance_list_keeps_one_entry_per_router():
    before = len(RouterReplay.global_router_replay_instances)
    layer = make_moe_layer(make_config(), 2)
    assert len(RouterReplay.global_router_replay_instances) == before + 1
    MegatronRouterReplay(layer)
    MegatronRouterReplay(layer)
    instances = RouterReplay.global_router_replay_instances
    assert len(instances) == before + 1 and instances[-1] is layer.router.router_replay
    # megatron's own global API still drives the swapped instance
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    assert layer.router.router_replay.router_replay_action is RouterReplayAction.RECORD
    RouterReplay.clear_global_router_replay_action()


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


class PackedPolicy(pl.LightningModule):
    """Feeds the model the packed [1, T] tokens of the callback's megatron layout."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TokenMoE()
        self.used: list[tuple[torch.Tensor, object]] = []

    def logprob_loss(self, batch, layout) -> torch.Tensor:
        tokens = layout.from_batch(batch["input_ids"])
        labels = layout.from_batch(batch["input_ids"], next_token=True)
        valid = layout.from_batch(batch["attention_mask"], next_token=True, pad=False)
        logprobs = torch.log_softmax(self.model(tokens), -1).gather(-1, labels[..., None])[..., 0]
        return -(logprobs * valid).sum() / valid.sum()

    def training_step(self, batch, batch_idx):
        callback = RouterReplayCallback.find(self.trainer)
        if callback.mode == "r2":
            with callback.old_policy_forward(batch), torch.no_grad():
                self.logprob_loss(batch, callback.build_layout(batch["attention_mask"]))
            with torch.no_grad():  # the policy drifts before the update pass: native routing changes
                for layer in self.model.moe:
                    layer.router.weight.add_(torch.randn_like(layer.router.weight))
        backend = callback.backend
        backend.start_recording()
        loss = self.logprob_loss(batch, callback.layout)
        self.used.append((backend.stop_recording(), callback.layout, batch.get("routed_experts")))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_lightning_callback_replays_rollout_routes(mode, tmp_path):
    """RouterReplayCallback + MegatronRouterReplay in a real Trainer fit: every captured token of
    every MoE layer uses the rollout's experts (r3) or the old-policy forward's (r2)."""
    torch.manual_seed(8)
    generator = torch.Generator().manual_seed(8)
    lengths = [3, 6, 5]
    width = max(lengths)
    attention_mask = torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]
    input_ids = torch.randint(0, 32, (len(lengths), width), generator=generator) * attention_mask
    rollout = [random_routes(n - 1, generator) for n in lengths]  # last token: no route
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if mode == "r3":
        batch["routed_experts"] = PackedTensor.from_segments(rollout)
    module = PackedPolicy()
    backend = MegatronRouterReplay(module.model)
    assert backend.moe_layers == (1, 3)
    callback = RouterReplayCallback(backend=backend, mode=mode, strict=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    loader = torch.utils.data.DataLoader([batch], batch_size=None)
    trainer.fit(module, loader)
    assert len(module.used) == 2
    for used, layout, replayed_routes in module.used:
        assert used.shape == (*layout.token_shape, LAYERS, TOP_K)
        expected = rollout if mode == "r3" else [replayed_routes[i] for i in range(len(lengths))]
        checked = 0
        for position in range(layout.num_positions):
            i, j = int(layout.position_sequence[position]), int(layout.position_offset[position])
            if i < 0 or j >= len(expected[i]):
                continue
            for layer in backend.moe_layers:
                assert used[0, position, layer].tolist() == expected[i][j, layer].tolist()
                checked += 1
        assert checked == sum(len(e) for e in expected) * len(backend.moe_layers)
    replayed = trainer.callback_metrics["router_replay/replayed_fraction"]
    assert float(replayed) == 1.0  # every slot with a route row was replayed
    assert float(trainer.callback_metrics["router_replay/used_agreement"]) == 1.0
    assert "router_replay/native_agreement/layer_03" in trainer.callback_metrics
    assert backend.routers[0].router_replay.target_topk_idx is None  # cleared after the step


def test_gpt_model_with_full_recompute_replays_engine_routes(monkeypatch):
    """examples/megatron_moe/gpt_recompute.py (written for a GPU) on CPU: a real GPTModel with
    attention, a dense first layer and full activation recomputation replays a bf16 engine's routes.

    Extra CPU shims: megatron's CUDA RNG tracker (dropout RNG forks) becomes a no-op, and the
    default causal attention mask, built on "cuda", is built on the CPU.
    """
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "megatron_moe"))
    gpt_recompute = pytest.importorskip("gpt_recompute")
    tracker = tp_random.get_cuda_rng_tracker()
    monkeypatch.setattr(tracker, "fork", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(tracker, "get_states", lambda: {})
    monkeypatch.setattr(tracker, "set_states", lambda states: None)
    monkeypatch.setattr(
        fused_softmax, "get_default_causal_mask", lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    )
    torch.manual_seed(9)
    checks = gpt_recompute.check_gpt_replay(torch.device("cpu"))
    assert all(checks.values()), checks


@pytest.mark.slow
def test_example_trains_with_full_agreement(tmp_path):
    """The example's R3 loop: every replayed token/layer uses the rollout's experts, although the
    trainer's native routing disagrees with the (bf16, lagging) engine on some of them."""
    result = run_script(
        ROOT / "examples" / "megatron_moe" / "train_r3.py", "--steps", "3", "--device", "cpu", cwd=tmp_path
    )
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3
    assert all(line.endswith("replayed agreement with rollout routes: 100.00%") for line in steps)
    native = [float(re.search(r"native top-k agreement with rollout ([\d.]+)%", line)[1]) for line in steps]
    assert min(native) < 100.0, native


@pytest.mark.slow
def test_two_tensor_parallel_ranks_route_their_sequence_halves(tmp_path):
    """Real TP = 2 with sequence parallelism: megatron's own scatter gives rank r the contiguous
    r-th half of the sequence, and its router uses exactly the installed routes of those tokens."""
    run_script(ROOT / "tests" / "support" / "megatron_tp_worker.py", str(tmp_path), cwd=tmp_path)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["parallelism"] for r in reports] == [[2, 0], [2, 1]]
    for report in reports:
        half = len(report["routes"]) // 2
        mine = report["routes"][report["rank"] * half : (report["rank"] + 1) * half]
        assert report["used"] == mine
        assert report["recorded_equal"] and report["other_layers_zero"]
        assert report["router_grad"] > 0
        # the rank's half of megatron's padding mask left its padding out of the expert-bias counts
        expected = [0.0] * EXPERTS
        start = report["rank"] * half
        for position, experts in enumerate(mine, start=start):
            if position not in (3, 6, 7):
                for expert in experts:
                    expected[expert] += 1
        assert report["expert_counts"] == expected


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
