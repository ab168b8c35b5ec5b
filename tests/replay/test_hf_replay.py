from types import SimpleNamespace

import pytest
import torch
from gloo_ranks import run_ranks
from torch import nn

from r3lightning.replay.backend import (
    RouterReplayBackend,
    agreement_hits,
    routes_on_all_layers,
    validate_routes_for_install,
)
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay, RouterAdapter, register_router
from r3lightning.testing.tiny import TINY_FAMILIES, build_tiny_moe, tiny_family_config

B, S, VOCAB = 3, 10, 96


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.bool)
    attention_mask[0, :4] = False  # left padding
    attention_mask[2, :1] = False
    input_ids[~attention_mask] = 0
    return input_ids, attention_mask


def random_routes(num_layers, top_k, num_experts, seed=0, token_shape=(B, S)):
    """Distinct random experts per row, independent of any model."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(*token_shape, num_layers, num_experts, generator=g)
    return scores.argsort(dim=-1)[..., :top_k]


def rollout_model(family, seed=0):
    """A bf16 copy with perturbed router weights: an engine whose numerics differ from the trainer's."""
    model = build_tiny_moe(tiny_family_config(family), seed=seed, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.add_(0.3 * p.float().std() * torch.randn(p.shape, generator=g).to(p.dtype))
    return model


def set_agreement(a, b):
    """Fraction of experts of a that b also chose for the same token and layer (as sets)."""
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).float().mean().item()


def capture_router_outputs(backend, before_replay=False):
    """Hook every router before or after the replay hook: (logits, weights, indices) by layer."""
    seen, handles = {}, []
    for layer, module in zip(backend.moe_layers, backend.routers, strict=True):

        def hook(module, args, output, layer=layer):
            seen[layer] = output

        handles.append(module.register_forward_hook(hook, prepend=before_replay))
    return seen, handles


@pytest.fixture(params=TINY_FAMILIES)
def family(request):
    return request.param


def test_rollout_routes_are_replayed_exactly_while_native_routing_differs(family):
    input_ids, attention_mask = batch()
    engine = rollout_model(family)
    with record_routes(engine) as rollout:
        engine(input_ids, attention_mask=attention_mask)

    trainer = build_tiny_moe(tiny_family_config(family))
    layers = list(HFRouterReplay.for_model(trainer).moe_layers)
    real = attention_mask
    with record_routes(trainer) as native:
        trainer(input_ids, attention_mask=attention_mask)
    native_agreement = set_agreement(rollout.routes[real][:, layers], native.routes[real][:, layers])
    assert native_agreement < 0.97  # the mismatch R3 removes

    backend = HFRouterReplay.for_model(trainer)
    native_under_replay, handles = capture_router_outputs(backend, before_replay=True)
    with replay_routes(trainer, rollout.routes, attention_mask):
        with record_routes(trainer) as replayed:
            trainer(input_ids, attention_mask=attention_mask)
        stats = backend.routing_stats()
    for h in handles:
        h.remove()
    assert torch.equal(replayed.routes[real][:, layers], rollout.routes[real][:, layers].int())
    # per-layer stats: replayed experts the router would have chosen itself (on the replayed path)
    assert stats["layers"] == tuple(layers)
    assert stats["replayed_rows"].tolist() == [int(real.sum())] * len(layers)
    for i, layer in enumerate(layers):
        own = native_under_replay[layer][2].reshape(B, S, -1)[real]
        hits = (rollout.routes[real][:, layer].long().unsqueeze(-1) == own.unsqueeze(-2)).any(-1)
        assert stats["agreeing_slots"][i].item() == hits.sum().item()
    # the first MoE layer sees the same input either way
    first = (stats["agreeing_slots"][0] / (stats["replayed_rows"][0] * 2)).item()
    assert first == pytest.approx(
        set_agreement(rollout.routes[real][:, layers[0]], native.routes[real][:, layers[0]])
    )


def test_replaying_the_models_own_routes_is_bit_identical(family):
    input_ids, attention_mask = batch(1)
    model = build_tiny_moe(tiny_family_config(family))
    model.train()
    with record_routes(model) as rec:
        native = model(input_ids, attention_mask=attention_mask).logits
    native.square().mean().backward()
    native_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with replay_routes(model, rec.routes, attention_mask):
        replayed = model(input_ids, attention_mask=attention_mask).logits
        replayed.square().mean().backward()
    assert torch.equal(native, replayed)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, native_grads[name], rtol=1e-6, atol=1e-9, msg=name)


def reference_gate_weights(family, router, logits, indices):
    logits = logits.double()
    if family == "deepseek_v3":
        w = torch.sigmoid(logits).gather(1, indices)
        return w / w.sum(-1, keepdim=True) * router.routed_scaling_factor
    if family == "gpt_oss":
        return torch.softmax(logits.gather(1, indices), dim=-1)
    w = torch.softmax(logits, dim=-1).gather(1, indices)
    if family == "mixtral" or router.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w


def test_forced_routes_get_weights_from_live_logits_and_router_gradients(family):
    input_ids, attention_mask = batch(2)
    model = build_tiny_moe(tiny_family_config(family))
    backend = HFRouterReplay.for_model(model)
    routes = random_routes(backend.num_layers, backend.top_k, backend.num_experts, seed=5)
    mask = attention_mask.clone()
    mask[1, -3:] = False  # uncaptured suffix: native routing
    own, own_handles = capture_router_outputs(backend, before_replay=True)
    seen, handles = capture_router_outputs(backend)
    handles += own_handles
    try:
        with replay_routes(model, routes, mask), record_routes(model) as rec:
            logits = model(input_ids, attention_mask=attention_mask).logits
            logits.float().square().mean().backward()
    finally:
        for h in handles:
            h.remove()
    layers = list(backend.moe_layers)
    assert torch.equal(rec.routes[mask][:, layers], routes[mask][:, layers].int())
    for layer, router in zip(backend.moe_layers, backend.routers, strict=True):
        native = own[layer][2].reshape(B, S, -1)
        assert torch.equal(rec.routes[~mask][:, layer], native[~mask].int())
        router_logits, weights, indices = seen[layer]
        assert torch.equal(indices, rec.routes[:, :, layer].reshape(-1, backend.top_k).long())
        expected = reference_gate_weights(family, router, router_logits.detach(), indices)
        torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-6)
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_masked_rows_and_dense_layers_ignore_invalid_route_values():
    model = build_tiny_moe()  # layer 0 is dense
    input_ids, attention_mask = batch(3)
    routes = random_routes(4, 2, 8, seed=1)
    routes[:, :, 0] = 77  # dense layer: never read
    routes[~attention_mask] = -5  # padding rows: never replayed
    with record_routes(model) as native:
        expected = model(input_ids, attention_mask=attention_mask).logits
    routes[attention_mask] = native.routes[attention_mask].long()
    routes[:, :, 0] = 77
    with replay_routes(model, routes, attention_mask):
        got = model(input_ids, attention_mask=attention_mask).logits
    assert torch.equal(got, expected)
    assert native.routes[:, :, 0].eq(0).all()  # dense layer rows hold 0


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recompute_replays_the_same_routes(use_reentrant):
    input_ids, attention_mask = batch(4)
    routes = random_routes(4, 2, 8, seed=3)
    grads = []
    for checkpointing in (False, True):
        model = build_tiny_moe(seed=1).train()
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": use_reentrant})
        with replay_routes(model, routes, attention_mask) as backend, record_routes(model) as rec:
            model(input_ids, attention_mask=attention_mask).logits.square().mean().backward()
            stats = backend.routing_stats()
        assert torch.equal(rec.routes[attention_mask][:, 1:], routes[attention_mask][:, 1:].int())
        assert rec.routes.shape == (B, S, 4, 2)  # recompute is not recorded twice
        assert stats["replayed_rows"].tolist() == [int(attention_mask.sum())] * 3  # nor counted twice
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_packed_token_shape_and_generate_recording():
    model = build_tiny_moe(seed=2)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    with record_routes(model) as rec:
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    # prefill + one forward per generated token but the last: one row per forwarded token
    assert out.shape == (1, 9) and rec.routes.shape == (1, 8, 4, 2)
    # a full packed forward over the same tokens replaying them uses exactly those experts
    with replay_routes(model, rec.routes), record_routes(model) as again:
        model(out[:, :-1], position_ids=torch.arange(8)[None])
    assert torch.equal(again.routes, rec.routes)


def test_backend_satisfies_the_protocol_and_is_shared_per_model():
    model = build_tiny_moe()
    backend = HFRouterReplay.for_model(model)
    assert isinstance(backend, RouterReplayBackend)
    assert HFRouterReplay.for_model(model) is backend
    with pytest.raises(RuntimeError, match="already has a replay backend"):
        HFRouterReplay(model)
    backend.remove()
    assert HFRouterReplay.for_model(model) is not backend


def test_shared_backend_helpers():
    """The install checks, recorded-route layout and agreement counts every backend shares."""
    routes = torch.tensor([[[[0, 0], [1, 2]], [[0, 0], [3, 1]]]])  # [1, 2, L=2, K=2], layer 0 dense
    backend = SimpleNamespace(num_layers=2, top_k=2, num_experts=4, moe_layers=(1,))
    assert validate_routes_for_install(backend, routes, None) == (1, 2)
    assert validate_routes_for_install(backend, routes[0], None) == (2,)
    with pytest.raises(
        ValueError, match=r"routes must have shape \[B, S, num_layers=2, top_k=2\], got \(2, 2, 2\)"
    ):
        validate_routes_for_install(backend, routes[0], None, token_dims=2)
    shifted = routes + 2  # layer 1 ids [3, 5]; the dense layer's [2, 2] is never checked
    with pytest.raises(ValueError, match=r"expert ids in \[3, 5\] on replayed MoE layers"):
        validate_routes_for_install(backend, shifted, None)
    validate_routes_for_install(backend, shifted, None, check_ids=False)  # shape checks only
    repeated = torch.tensor([[[[0, 0], [1, 2]], [[0, 0], [3, 3]]]])  # token 1 repeats expert 3
    with pytest.raises(ValueError, match="repeat an expert"):
        validate_routes_for_install(backend, repeated, None)
    validate_routes_for_install(backend, repeated, torch.tensor([[True, False]]))  # not replayed

    rows = [(1, torch.tensor([[[5, 6], [7, 8]]])), (3, torch.tensor([[[1, 2], [3, 4]]]))]
    full = routes_on_all_layers(rows, (1, 2), 4, 2)
    assert full.dtype == torch.int32 and full.shape == (1, 2, 4, 2)
    assert full[0, :, 1].tolist() == [[5, 6], [7, 8]] and full[0, :, 3].tolist() == [[1, 2], [3, 4]]
    assert not full[:, :, [0, 2]].any()
    with pytest.raises(ValueError, match="at least one routed layer"):
        routes_on_all_layers([], (1, 2), 4, 2)

    hits = agreement_hits(torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 5], [3, 2]]))
    assert hits.tolist() == [[False, True], [True, True]]


def test_bad_inputs_are_rejected_with_clear_errors():
    model = build_tiny_moe()
    backend = HFRouterReplay.for_model(model)
    good = random_routes(4, 2, 8)
    with pytest.raises(TypeError, match="integer tensor"):
        backend.install(good.float())
    with pytest.raises(ValueError, match=r"num_layers=4, top_k=2"):
        backend.install(good[..., :1])
    with pytest.raises(ValueError, match="replay_mask must be a bool tensor of shape"):
        backend.install(good, torch.ones(B, S + 1, dtype=torch.bool))
    bad = good.clone()
    bad[1, 2, 3, 0] = 8
    with pytest.raises(ValueError, match=r"expected ids in \[0, 7\]"):
        backend.install(bad)
    bad[1, 2, 3] = torch.tensor([4, 4])
    with pytest.raises(ValueError, match="repeat an expert"):
        backend.install(bad)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 2] = False
    backend.install(bad, mask)  # the bad row is not replayed
    with pytest.raises(ValueError, match=r"routed 6 tokens at layer 1 but routes were installed"):
        model(torch.ones(2, 3, dtype=torch.long))
    backend.clear()
    with pytest.raises(RuntimeError, match="no forward pass of Qwen3MoeForCausalLM ran"):
        backend.start_recording()
        backend.stop_recording()
    with pytest.raises(ValueError, match="no MoE router found in Sequential"):
        HFRouterReplay(nn.Sequential(nn.Linear(2, 2)))


def test_context_managers_clear_on_exceptions():
    model = build_tiny_moe()
    input_ids, _ = batch()
    with record_routes(model) as native:
        expected = model(input_ids).logits
    backend = HFRouterReplay.for_model(model)
    with pytest.raises(KeyError), replay_routes(model, random_routes(4, 2, 8)):
        model(input_ids)
        raise KeyError("boom")
    assert not backend.installed
    with pytest.raises(KeyError), record_routes(model) as rec:
        raise KeyError("boom")
    assert rec.routes is None and not backend.recording
    assert torch.equal(model(input_ids).logits, expected)
    with pytest.raises(TypeError, match=r"expected an nn\.Module MoE model or a RouterReplayBackend"):
        replay_routes(object(), native.routes).__enter__()


class ToyRouter(nn.Module):
    """A router type transformers does not know: returns (logits, weights, indices)."""

    def __init__(self, hidden, experts, k):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden))
        self.k, self.experts = k, experts

    def forward(self, x):
        logits = x.reshape(-1, x.shape[-1]) @ self.weight.t()
        values, indices = logits.topk(self.k, dim=-1)
        return logits, values.tanh(), indices


class ToyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"router": ToyRouter(4, 6, 2)}) for _ in range(2))

    def forward(self, x):
        outs = []
        for layer in self.layers:
            _, weights, indices = layer["router"](x)
            outs.append((weights, indices))
        return outs


def test_register_router_adds_other_models():
    torch.manual_seed(0)
    model = ToyMoE()
    register_router(
        ToyRouter,
        RouterAdapter(
            gate_weights=lambda router, logits, idx: logits.gather(-1, idx).tanh(),
            top_k_attr="k",
            num_experts_attr="experts",
        ),
    )
    backend = HFRouterReplay(model)
    assert (backend.moe_layers, backend.num_layers, backend.num_experts) == ((0, 1), 2, 6)
    x = torch.randn(1, 3, 4)
    routes = random_routes(2, 2, 6, token_shape=(1, 3))
    with replay_routes(backend, routes):
        outs = model(x)
    for layer, (weights, indices) in enumerate(outs):
        assert torch.equal(indices, routes[0, :, layer])
        logits = x[0] @ model.layers[layer]["router"].weight.t()
        torch.testing.assert_close(weights, logits.gather(-1, indices).tanh())
    with pytest.raises(TypeError, match=r"nn\.Module subclass"):
        register_router(int, RouterAdapter(gate_weights=lambda *a: None))


# ------------------------------------------------------------------------------ FSDP2 (gloo)
def _fsdp_worker(rank, routes, input_ids, attention_mask, expected_logits):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        model = build_tiny_moe(seed=0).train()
        backend = HFRouterReplay.for_model(model)  # before sharding: module identity is kept
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        mine = slice(rank, rank + 1)  # each rank trains on its own row of the batch
        with replay_routes(model, routes[mine], attention_mask[mine]), record_routes(model) as rec:
            logits = model(input_ids[mine], attention_mask=attention_mask[mine]).logits
            logits.square().mean().backward()
        real = attention_mask[mine]
        assert torch.equal(rec.routes[real][:, 1:], routes[mine][real][:, 1:].int())
        torch.testing.assert_close(logits, expected_logits[mine], rtol=1e-5, atol=1e-6)
        grad = model.model.layers[1].mlp.gate.weight.grad
        assert grad is not None and grad.full_tensor().abs().sum() > 0
        assert not backend.installed
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_fully_shard_replays_per_rank_routes():
    input_ids, attention_mask = batch(5)
    routes = random_routes(4, 2, 8, seed=11)
    reference = build_tiny_moe(seed=0).train()
    with replay_routes(reference, routes, attention_mask):
        expected_logits = reference(input_ids, attention_mask=attention_mask).logits.detach()
    run_ranks(_fsdp_worker, routes, input_ids, attention_mask, expected_logits)


def test_routes_stay_compact_and_replay_the_same_under_torch_compile():
    """Installed routes keep their wire dtype (each router widens only its own layer), and a
    compiled model replays, records and counts exactly what the eager one does."""
    model = build_tiny_moe(seed=0)
    input_ids, attention_mask = batch(6)
    routes = random_routes(4, 2, 8, seed=6).to(torch.uint8)
    mask = attention_mask.clone()
    mask[2, -2:] = False
    with replay_routes(model, routes, mask) as backend, record_routes(model) as eager:
        expected = model(input_ids, attention_mask=attention_mask).logits
        assert backend._routes.dtype == torch.uint8  # no int64 [N, L, K] copy
        eager_stats = {
            k: v.clone() for k, v in backend.routing_stats().items() if k.endswith(("rows", "slots"))
        }
    with replay_routes(model, routes.long(), mask) as backend:
        assert torch.equal(model(input_ids, attention_mask=attention_mask).logits, expected)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with replay_routes(model, routes, mask) as backend, record_routes(model) as rec:
        got = compiled(input_ids, attention_mask=attention_mask).logits
        stats = backend.routing_stats()
        for key, value in eager_stats.items():
            assert torch.equal(stats[key], value), key
    assert torch.equal(rec.routes, eager.routes)
    torch.testing.assert_close(got, expected)
    torch._dynamo.reset()
