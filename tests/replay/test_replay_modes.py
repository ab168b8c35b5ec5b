"""The r3 / r2 / off modes through a real Lightning Trainer: what each forward uses and exact counts.

Hit counts are recomputed here from the routers' own outputs, captured by a hook that runs before
the replay hook (the router's native choice), and the engine's rows of the batch.
"""

import copy
import math

import pytest
import torch
from replay_policy import (
    LAYERS,
    TinyPolicy,
    engine_dense,
    fit,
    make_batch,
    position_ids,
    real_rows,
    set_agreement,
)

from r3lightning.packed import PackedTensor
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes
from r3lightning.replay.hf.replay import HFRouterReplay


@pytest.fixture(scope="module")
def batches():
    return [make_batch(0, [7, 9, 5]), make_batch(1, [6, 9, 8], dropped_rows=3)]


def test_off_mode_routes_natively_and_measures_the_mismatch(batches):
    module = TinyPolicy()
    reference = copy.deepcopy(module.model)
    callback = RouterReplayCallback(mode="off")
    _, logger = fit(module, copy.deepcopy(batches[:1]), callback)
    batch = batches[0]
    with record_routes(reference) as native:
        reference(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask.long(),
            position_ids=position_ids(batch.attention_mask),
        )
    assert torch.equal(module.train_routes[0], native.routes)  # nothing replayed
    index = tuple(torch.tensor(real_rows(batch)).T)
    expected = set_agreement(engine_dense(batch)[index][:, LAYERS], native.routes[index][:, LAYERS].long())
    assert expected < 0.97
    assert logger.series("router_replay/native_agreement") == pytest.approx([expected])
    assert logger.series("router_replay/used_agreement") == pytest.approx([expected])
    assert logger.series("router_replay/replayed_fraction") == [0.0]


def test_off_mode_survives_forwards_it_cannot_compare(batches):
    """Off mode only measures: forwards of other batch shapes (micro-batches, a probe) in a step
    skip the agreement metric instead of failing the step."""

    class Probing(TinyPolicy):
        def training_step(self, batch, batch_idx):
            with torch.no_grad():
                self.model(input_ids=batch.input_ids[:1])  # [1, S]: cannot join the [B, S] forward
            return super().training_step(batch, batch_idx)

    _, logger = fit(Probing(), copy.deepcopy(batches[:1]), RouterReplayCallback(mode="off"))
    assert logger.series("router_replay/replayed_fraction") == [0.0]
    assert [math.isnan(a) for a in logger.series("router_replay/native_agreement")] == [True]


def test_r2_replays_old_policy_routes_in_every_update_pass(batches):
    batch = copy.deepcopy(batches[0])
    batch.routed_experts = None  # the engine returned no routes
    results = {}
    for mode in ("r2", "off"):
        module = TinyPolicy(lr=2.0, passes=3, old_policy=True)
        fit(module, [copy.deepcopy(batch)], RouterReplayCallback(mode=mode))
        results[mode] = module
    real = batch.attention_mask
    r2 = results["r2"]
    for used in r2.train_routes:
        assert torch.equal(used[real][:, LAYERS], r2.old_routes[0][real][:, LAYERS])
    # without r2 the updates move the routing away from the old policy's
    off = results["off"]
    drift = set_agreement(
        off.train_routes[-1][real][:, LAYERS].long(), off.old_routes[0][real][:, LAYERS].long()
    )
    assert drift < 0.99


def test_r2_stores_routes_on_the_batch_for_later_passes():
    callback = RouterReplayCallback(mode="r2")
    module = TinyPolicy(old_policy=True)
    batch = make_batch(3, [4, 6], with_routes=False)
    fit(module, [batch], callback)
    assert isinstance(batch.routed_experts, PackedTensor)
    assert batch.routed_experts.lengths.tolist() == [4, 6] and batch.route_layers == tuple(LAYERS)
    assert torch.equal(batch.routed_experts.values, module.old_routes[0][batch.attention_mask][:, LAYERS])


def hand_hits(batch, experts):
    """Per MoE layer: the engine's route experts found in ``experts`` ``[B, S, L, K]``, over the
    positions with a captured route row (an independent count: plain Python over the rows)."""
    engine = engine_dense(batch)
    hits = [0] * len(LAYERS)
    for i, col in real_rows(batch):
        for j, layer in enumerate(LAYERS):
            chosen = set(experts[i, col, layer].tolist())
            hits[j] += sum(int(e) in chosen for e in engine[i, col, layer].tolist())
    return hits


class NativeCapture:
    """The router's own top-k of every forward, from a hook that runs before the replay hook."""

    def __init__(self, model):
        backend = HFRouterReplay.for_model(model)
        self.forwards, self.handles = [], []
        for layer, router in zip(backend.moe_layers, backend.routers, strict=True):
            self.handles.append(router.register_forward_hook(self._hook(layer), prepend=True))

    def _hook(self, layer):
        def hook(module, args, out):
            if layer == LAYERS[0]:
                self.forwards.append({})
            self.forwards[-1][layer] = out[2].detach()

        return hook

    def experts(self, index, token_shape):
        """``[*token_shape, 4, 2]`` native experts of forward ``index`` (-1 on the dense layer)."""
        out = torch.full((*token_shape, 4, 2), -1, dtype=torch.long)
        for layer, indices in self.forwards[index].items():
            out[..., layer, :] = indices.reshape(*token_shape, 2)
        return out

    def remove(self):
        for handle in self.handles:
            handle.remove()


def move_router(model):
    """The policy moves between two forwards of a step (its routing changes)."""
    gate = model.model.layers[2].mlp.gate.weight
    gate.add_(torch.randn(gate.shape, generator=torch.Generator().manual_seed(5)) * 3 * gate.std())


class ThreeForwards(TinyPolicy):
    """Replayed forward, a micro-batch without routes (native), the policy moves, replayed again."""

    def __init__(self):
        super().__init__(passes=2)  # manual optimisation: nothing to return
        self.counts = None

    def training_step(self, batch, batch_idx):
        callback = RouterReplayCallback.find(self.trainer)
        self.capture = NativeCapture(self.model)
        with torch.no_grad():
            self(batch)
            routeless = copy.copy(batch[:2])
            routeless.routed_experts = None
            with callback.micro_batch(routeless) as layout:
                assert layout is None and not callback.backend.installed
                self(routeless)
            move_router(self.model)
            self(batch)
        self.capture.remove()
        self.counts = {k: v.clone() for k, v in callback.routing_counts().items()}


def test_counts_before_a_switch_to_native_routing_are_kept(batches):
    """A micro-batch without routes clears the backend mid-step: the replayed forwards before it
    still count, exactly (hits and totals), together with those after it."""
    batch = batches[0]
    module = ThreeForwards()
    with pytest.warns(UserWarning, match="a micro-batch of a batch with routes has no routed_experts"):
        _, logger = fit(module, [copy.deepcopy(batch)], RouterReplayCallback(mode="r3"))
    shape = tuple(batch.input_ids.shape)
    first, last = (hand_hits(batch, module.capture.experts(f, shape)) for f in (0, 2))
    assert first != last  # the policy moved: the two replayed forwards agree differently
    rows = len(real_rows(batch))
    counts = {k: v.tolist() for k, v in module.counts.items()}
    assert counts["route_rows"] == counts["replayed_rows"] == [2 * rows] * 3
    assert counts["native_hits"] == [a + b for a, b in zip(first, last, strict=True)]
    assert counts["used_hits"] == [2 * rows * 2] * 3  # every replayed slot used its route's expert
    expected = (sum(first) + sum(last)) / (2 * rows * 2 * 3)
    assert logger.series("router_replay/native_agreement") == [pytest.approx(expected, abs=1e-7)]
    assert logger.series("router_replay/replayed_fraction") == [1.0]
    assert logger.series("router_replay/used_agreement") == [1.0]
    assert logger.series("router_replay/batches_without_routes") == [1.0]


def test_off_mode_joins_two_forwards_of_one_recording_exactly(batches):
    """Two forwards of the batch in one off-mode recording (no micro-batch in between): each is
    compared with the routes, so agreement is the hand count over both and stays <= 1."""
    batch = batches[0]

    class TwoForwards(TinyPolicy):
        def training_step(self, batch, batch_idx):
            self.used = []
            with torch.no_grad():
                for _ in range(2):
                    with record_routes(self.model) as rec:
                        self(batch)
                    self.used.append(rec.routes.long())
                    move_router(self.model)

    module = TwoForwards(passes=2)
    _, logger = fit(module, [copy.deepcopy(batch)], RouterReplayCallback(mode="off"))
    first, second = (hand_hits(batch, used) for used in module.used)
    assert first != second
    slots = 2 * len(real_rows(batch)) * 2 * len(LAYERS)
    expected = (sum(first) + sum(second)) / slots
    assert expected < 1.0
    for key in ("native_agreement", "used_agreement"):
        assert logger.series(f"router_replay/{key}") == [pytest.approx(expected, abs=1e-7)]
    for j, layer in enumerate(LAYERS):
        value = logger.series(f"router_replay/native_agreement/layer_{layer:02d}")
        assert value == [pytest.approx((first[j] + second[j]) / (slots / len(LAYERS)), abs=1e-7)]
    assert logger.series("router_replay/replayed_fraction") == [0.0]
