"""HFRouterReplay as a backend: the protocol, shared helpers, bad inputs, context managers, routers
registered by users, FSDP2 and torch.compile."""

from types import SimpleNamespace

import pytest
import torch
from gloo_ranks import run_ranks
from hf_tiny_batch import B, S, batch, random_routes
from torch import nn

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.replay.backend import (
    RouterReplayBackend,
    agreement_hits,
    routes_on_all_layers,
    validate_routes_for_install,
)
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.replay.hf.routers import RouterAdapter, register_router


def test_backend_satisfies_the_protocol_and_is_shared_per_model():
    model = build_tiny_moe()
    backend = HFRouterReplay.for_model(model)
    assert isinstance(backend, RouterReplayBackend)
    assert HFRouterReplay.for_model(model) is backend
    with pytest.raises(RuntimeError, match="already has a replay backend"):
        HFRouterReplay(model)
    backend.remove()
    assert HFRouterReplay.for_model(model) is not backend


def test_for_model_returns_the_attached_backend_for_equal_keywords_only():
    model = build_tiny_moe()
    backend = HFRouterReplay.for_model(model, validate=False, soft_threshold=1)
    assert (backend.validate, backend.soft_threshold) == (False, 1.0)  # a new backend takes them
    assert HFRouterReplay.for_model(model) is backend
    assert HFRouterReplay.for_model(model, validate=False) is backend
    assert HFRouterReplay.for_model(model, soft_threshold=1.0, validate=False) is backend
    assert HFRouterReplay.for_model(model, soft_threshold=1) is backend  # compared as stored


@pytest.mark.parametrize(
    ("keyword", "message"),
    [
        ({"soft_threshold": 0.5}, r"^soft_threshold=0\.5 differs .* \(soft_threshold=1\.0\)"),
        ({"soft_threshold": None}, r"^soft_threshold=None differs .* \(soft_threshold=1\.0\)"),
        ({"validate": True}, r"^validate=True differs .* \(validate=False\)"),
        ({"validate": False, "soft_threshold": 0.5}, r"^soft_threshold=0\.5 differs"),
    ],
    ids=["soft_threshold", "soft_threshold_none", "validate", "one_of_two"],
)
def test_for_model_refuses_a_keyword_that_differs_from_the_attached_backend(keyword, message):
    model = build_tiny_moe()
    backend = HFRouterReplay.for_model(model, validate=False, soft_threshold=1.0)
    with pytest.raises(ValueError, match=message):
        HFRouterReplay.for_model(model, **keyword)
    assert (backend.validate, backend.soft_threshold) == (False, 1.0)  # the attached one is unchanged
    assert HFRouterReplay.for_model(model) is backend
    backend.remove()
    fresh = HFRouterReplay.for_model(model, **keyword)  # nothing attached: a new backend takes them
    assert fresh is not backend
    assert {name: getattr(fresh, name) for name in keyword} == keyword


def test_for_model_checks_keywords_for_an_attached_backend_as_the_constructor_does():
    model = build_tiny_moe()
    HFRouterReplay.for_model(model)
    with pytest.raises(TypeError, match="unexpected keyword argument 'threshold'"):
        HFRouterReplay.for_model(model, threshold=0.5)
    with pytest.raises(ValueError, match=r"^soft_threshold must be"):
        HFRouterReplay.for_model(model, soft_threshold=-1.0)


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
