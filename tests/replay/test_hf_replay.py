"""HFRouterReplay on the tiny model of each built-in family: exact replay of rollout routes, weights
from live logits, masks, activation checkpointing, packed batches and recording generation."""

import pytest
import torch
from hf_tiny_batch import B, S, batch, random_routes

from r3lightning.app.models.tiny import TINY_FAMILIES, build_tiny_moe, tiny_family_config
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay


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


def test_a_users_router_hook_sees_the_routers_own_choice_unless_registered_after_replay():
    """Replay swaps the router's output in its own forward hook: a user hook registered before the
    backend (or with prepend=True) sees the native experts, one registered after sees the replayed."""
    input_ids, _ = batch(4)
    model = build_tiny_moe(seed=0)
    router = model.model.layers[1].mlp.gate
    seen = {}
    router.register_forward_hook(lambda m, a, out: seen.update(before=out[2].clone()))
    backend = HFRouterReplay.for_model(model)
    router.register_forward_hook(lambda m, a, out: seen.update(after=out[2].clone()))
    router.register_forward_hook(lambda m, a, out: seen.update(prepended=out[2].clone()), prepend=True)
    routes = random_routes(backend.num_layers, backend.top_k, backend.num_experts, seed=4)
    with torch.no_grad():
        model(input_ids)
        native = seen["before"]
        with replay_routes(model, routes), record_routes(model) as rec:
            model(input_ids)
    assert torch.equal(seen["before"], native) and torch.equal(seen["prepended"], native)
    assert torch.equal(seen["after"], routes[:, :, 1].reshape(-1, 2))
    assert torch.equal(rec.routes[:, :, 1].long(), routes[:, :, 1])  # what the forward used
    assert not torch.equal(native, seen["after"])
