"""Soft replay (``soft_threshold``) on real transformers models: its two limits are exact (0: plain
r3; above every probability: native routing), and in between every slot follows the rule, checked
against a reference written here from the router's own logits; the kept share is counted."""

import copy

import pytest
import torch
from hf_tiny_batch import batch
from replay_policy import TinyPolicy, fit, make_batch
from test_hf_replay import capture_router_outputs, rollout_model

from r3lightning.app.models.tiny import TINY_FAMILIES, build_tiny_moe, tiny_family_config
from r3lightning.replay.backend import soft_replay_indices
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay


def _reference_slots(replayed, native, probs, threshold):
    """Per row: slot kept iff p(expert) >= threshold; the others, in slot order, take the native
    experts (in native order) that are not kept."""
    out, kept_count = [], 0
    for r_row, n_row, p_row in zip(replayed.tolist(), native.tolist(), probs.tolist(), strict=True):
        keep = [p_row[e] >= threshold for e in r_row]
        kept = {e for e, k in zip(r_row, keep, strict=True) if k}
        free = iter([e for e in n_row if e not in kept])
        out.append([e if k else next(free) for e, k in zip(r_row, keep, strict=True)])
        kept_count += sum(keep)
    return out, kept_count


@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.12, 0.3, 2.0])
def test_soft_replay_indices_follow_the_rule(threshold):
    g = torch.Generator().manual_seed(3)
    n, e, k = 64, 8, 3
    logits = torch.randn(n, e, generator=g)
    replayed = torch.rand(n, e, generator=g).argsort(-1)[:, :k]
    native = logits.topk(k, dim=-1).indices
    mask = torch.rand(n, generator=g) > 0.2
    base = torch.where(mask[:, None], replayed, native)
    got, kept = soft_replay_indices(base, native, logits, threshold, mask)
    probs = logits.float().softmax(-1)
    expected, count = _reference_slots(base, native, torch.where(mask[:, None], probs, -1.0), threshold)
    assert got.tolist() == expected and int(kept.sum()) == count
    assert (got.sort(-1).values[:, 1:] != got.sort(-1).values[:, :-1]).all()  # k distinct experts
    assert torch.equal(got[~mask], native[~mask])  # unreplayed rows: native


@pytest.fixture(params=TINY_FAMILIES)
def family(request):
    return request.param


def _forward(model, input_ids, attention_mask):
    with record_routes(model) as used:
        logits = model(input_ids, attention_mask=attention_mask).logits
    return logits, used.routes


def test_soft_replay_limits_are_exactly_r3_and_exactly_native(family):
    input_ids, attention_mask = batch()
    engine = rollout_model(family)
    with record_routes(engine) as rollout:
        engine(input_ids, attention_mask=attention_mask)
    trainer = build_tiny_moe(tiny_family_config(family))
    native_logits, native_routes = _forward(trainer, input_ids, attention_mask)
    with replay_routes(trainer, rollout.routes, attention_mask):
        r3_logits, r3_routes = _forward(trainer, input_ids, attention_mask)
    assert not torch.equal(r3_routes, native_routes)  # the two limits differ on this model
    with replay_routes(trainer, rollout.routes, attention_mask, soft_threshold=0.0):
        zero_logits, zero_routes = _forward(trainer, input_ids, attention_mask)
    with replay_routes(trainer, rollout.routes, attention_mask, soft_threshold=1.0 + 1e-6):
        high_logits, high_routes = _forward(trainer, input_ids, attention_mask)
    assert torch.equal(zero_logits, r3_logits) and torch.equal(zero_routes, r3_routes)
    assert torch.equal(high_logits, native_logits) and torch.equal(high_routes, native_routes)
    assert HFRouterReplay.for_model(trainer).soft_threshold is None  # the block's setting is gone


def test_between_the_limits_every_slot_follows_the_rule_and_is_counted(family):
    input_ids, attention_mask = batch(1)
    engine = rollout_model(family)
    with record_routes(engine) as rollout:
        engine(input_ids, attention_mask=attention_mask)
    trainer = build_tiny_moe(tiny_family_config(family))
    backend = HFRouterReplay.for_model(trainer)
    seen, handles = capture_router_outputs(backend, before_replay=True)  # the router's own outputs
    threshold = 1.0 / backend.num_experts  # about half the slots of a softmax router pass
    try:
        with replay_routes(trainer, rollout.routes, attention_mask, soft_threshold=threshold):
            _, used = _forward(trainer, input_ids, attention_mask)
            stats = backend.routing_stats()
    finally:
        for h in handles:
            h.remove()
    mask = attention_mask.reshape(-1)
    total_kept = 0
    for i, layer in enumerate(backend.moe_layers):
        logits, _, native = seen[layer]
        replayed = rollout.routes.reshape(-1, *rollout.routes.shape[-2:])[:, layer].long()
        base = torch.where(mask[:, None], replayed, native)
        probs = torch.where(mask[:, None], logits.float().softmax(-1), -1.0)  # unmasked rows: nothing kept
        expected, kept = _reference_slots(base, native, probs, threshold)
        assert used.reshape(-1, *used.shape[-2:])[:, layer].tolist() == expected, layer
        assert stats["kept_slots"][i].item() == kept
        used_hits = sum(
            len(set(r) & set(u)) for r, u, m in zip(base.tolist(), expected, mask.tolist(), strict=True) if m
        )
        assert stats["used_slots"][i].item() == used_hits
        total_kept += kept
    slots = int(mask.sum()) * backend.top_k * len(backend.moe_layers)
    assert 0 < total_kept < slots  # the threshold acts on these tokens


def test_the_callback_logs_the_kept_share_as_a_ratio_of_sums():
    batches = [make_batch(0, [7, 9, 5]), make_batch(1, [6, 9, 8], dropped_rows=3)]
    module = TinyPolicy()
    backend = HFRouterReplay(module.model, soft_threshold=1.0 + 1e-6)  # keeps nothing: native
    _, logger = fit(module, copy.deepcopy(batches), RouterReplayCallback(backend=backend, mode="r3"))
    assert logger.series("router_replay/soft_kept_fraction") == [0.0, 0.0]
    assert logger.series("router_replay/replayed_fraction") == [1.0, 1.0]
    backend.remove()
    module = TinyPolicy()
    backend = HFRouterReplay(module.model, soft_threshold=0.0)  # keeps everything: r3
    _, logger = fit(module, copy.deepcopy(batches), RouterReplayCallback(backend=backend, mode="r3"))
    assert logger.series("router_replay/soft_kept_fraction") == [1.0, 1.0]
    assert logger.series("router_replay/used_agreement") == [1.0, 1.0]
    backend.remove()


def test_bad_settings_are_refused():
    model = build_tiny_moe()
    with pytest.raises(ValueError, match="soft_threshold must be null or a number >= 0"):
        HFRouterReplay(model, soft_threshold=-0.1)
    backend = HFRouterReplay.for_model(model)
    routes = torch.zeros(1, 2, 4, 2, dtype=torch.long)
    with (
        pytest.raises(ValueError, match="soft_threshold must be null or a number >= 0"),
        replay_routes(backend, routes, soft_threshold=float("nan")),
    ):
        pass
    backend.soft_threshold = 0.1
    callback = RouterReplayCallback(backend=backend, mode="r2")
    with pytest.raises(ValueError, match=r"soft replay .* applies to mode 'r3', got 'r2'"):
        callback._ensure_backend(None)
    backend.remove()


def test_backends_without_soft_replay_refuse_it():
    class Plain:  # a backend object without soft replay (as megatron-core's)
        num_layers, top_k, num_experts, moe_layers = 2, 2, 4, (1,)

        def install(self, routes, replay_mask=None): ...
        def clear(self): ...
        def start_recording(self): ...
        def stop_recording(self): ...
        def routing_stats(self): ...

    with (
        pytest.raises(ValueError, match="soft_threshold needs a backend with soft replay"),
        replay_routes(Plain(), torch.zeros(1, 2, 2, 2, dtype=torch.long), soft_threshold=0.1),
    ):
        pass


def test_the_job_sets_replay_soft_threshold_on_the_hf_backend_only():
    from r3lightning.app.job.build import replay_backend
    from r3lightning.app.job.common import JobError
    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.validate import check_config

    model = build_tiny_moe()
    backend = replay_backend(compose_config(["replay.soft_threshold=0.05"]), model)
    assert backend.soft_threshold == 0.05
    assert replay_backend(compose_config(), model).soft_threshold is None  # plain r3 by default
    backend.remove()
    with pytest.raises(JobError, match=r"replay\.soft_threshold needs replay=r3 with the hf backend"):
        replay_backend(
            compose_config(["replay.soft_threshold=0.05", "callbacks=router_replay_megatron"]), model
        )
    with pytest.raises(
        JobError,
        match=r"replay\.soft_threshold must be null or a number >= 0 \(a router probability\), got -1",
    ):
        check_config(compose_config(["replay.soft_threshold=-1"]))
