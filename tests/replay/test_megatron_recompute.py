"""MegatronRouterReplay recording, the backend protocol and activation recomputation (megatron's
REPLAY_BACKWARD FIFO), against real megatron-core MoE layers on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
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

from r3lightning.align.dummy import dummy_routes
from r3lightning.replay.backend import RouterReplayBackend
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.megatron.replay import (
    MegatronParallelism,
    MegatronRouterReplay,
)

pytestmark = pytest.mark.usefixtures("megatron_cpu")


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
    routes = [distinct_routes(4, generator).reshape(1, 4, LAYERS, TOP_K) for _ in range(2)]
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
