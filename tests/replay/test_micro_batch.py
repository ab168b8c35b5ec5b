"""Micro-batches and several passes per rollout batch through a real Lightning Trainer and the
Hugging Face tiny MoE: every forward replays its own micro-batch's routes, in every mode."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from micro_policy import (
    PLANS,
    MicroPolicy,
    captured_mask,
    dense_engine_routes,
    native_reference,
    seven_batch,
)
from replay_policy import LAYERS, engine_dense, fit, loader, make_batch, position_ids, real_rows

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes


@pytest.fixture(scope="module")
def seven():
    return seven_batch()


@pytest.fixture(scope="module")
def trained_without_checkpointing(seven):
    module = MicroPolicy(PLANS)
    fit(module, [copy.deepcopy(seven)], RouterReplayCallback(mode="r3"))
    return module.model.state_dict()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_unequal_micro_batches_over_two_passes_replay_exactly(
    seven, checkpointing, trained_without_checkpointing
):
    module = MicroPolicy(PLANS, checkpointing=checkpointing)
    callback = RouterReplayCallback(mode="r3")
    _, logger = fit(module, [copy.deepcopy(seven)], callback)
    # recompute inside backward replayed each micro-batch's routes: the same updates
    for name, value in trained_without_checkpointing.items():
        torch.testing.assert_close(module.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert len(module.forwards) == 6
    assert [tuple(mb.input_ids.shape) for mb, _, _ in module.forwards][3:] == [(3, 7), (2, 9), (2, 6)]
    for mb, used, snapshot in module.forwards:
        # every captured token used the engine's experts on every MoE layer ...
        index = tuple(torch.tensor(real_rows(mb)).T)
        assert torch.equal(used[index][:, LAYERS].long(), engine_dense(mb)[index][:, LAYERS])
        # ... and every other position (uncaptured suffix, routeless row, padding) routed natively
        # inside the same forward: bit-equal to replay_routes with a False mask there
        assert torch.equal(used, native_reference(mb, snapshot))
    batch, used = module.whole[0]
    index = tuple(torch.tensor(real_rows(batch)).T)
    assert torch.equal(used[index][:, LAYERS].long(), engine_dense(batch)[index][:, LAYERS])
    assert logger.series("router_replay/replayed_fraction") == [1.0]
    assert logger.series("router_replay/used_agreement") == [1.0]


def test_off_mode_micro_batches_route_natively_and_measure_every_forward(seven):
    module = MicroPolicy(PLANS)
    _, logger = fit(module, [copy.deepcopy(seven)], RouterReplayCallback(mode="off"))
    hits = slots = 0
    for mb, used, snapshot in module.forwards:
        model = build_tiny_moe(seed=0)
        model.load_state_dict(snapshot)
        with torch.no_grad(), record_routes(model) as native:
            model(
                input_ids=mb.input_ids,
                attention_mask=mb.attention_mask.long(),
                position_ids=position_ids(mb.attention_mask),
            )
        assert torch.equal(used, native.routes)  # nothing replayed
        mask = captured_mask(mb)
        ours, engine = used[mask][:, LAYERS].long(), dense_engine_routes(mb)[mask][:, LAYERS]
        hits += int((engine.unsqueeze(-1) == ours.unsqueeze(-2)).any(-1).sum())
        slots += engine.numel()
    # the whole-batch forward after the blocks is compared too
    batch, used = module.whole[0]
    mask = captured_mask(batch)
    ours, engine = used[mask][:, LAYERS].long(), dense_engine_routes(batch)[mask][:, LAYERS]
    hits += int((engine.unsqueeze(-1) == ours.unsqueeze(-2)).any(-1).sum())
    slots += engine.numel()
    assert hits < slots
    assert logger.series("router_replay/native_agreement") == [pytest.approx(hits / slots, abs=1e-7)]
    assert logger.series("router_replay/used_agreement") == [pytest.approx(hits / slots, abs=1e-7)]
    assert logger.series("router_replay/replayed_fraction") == [0.0]


def test_r2_records_per_micro_batch_and_replays_in_later_passes():
    batch = make_batch(12, [5, 9, 4, 7, 6, 8, 3], with_routes=False)
    module = MicroPolicy(PLANS, old_policy=True)
    fit(module, [batch], RouterReplayCallback(mode="r2", strict=True))
    # the old-policy forward recorded every row: stored on the step's batch, in trajectory order,
    # on the MoE layers only (the dense layer 0 has no router)
    recorded = batch.routed_experts
    assert recorded is not None and recorded.lengths.tolist() == [5, 9, 4, 7, 6, 8, 3]
    assert batch.route_layers == tuple(LAYERS) and recorded.row_shape == (len(LAYERS), 2)
    for mb, used, _ in module.forwards:  # re-cut, shuffled and trimmed sub-batches included
        rows = mb.rows_in(batch)
        for i, row in enumerate(rows.tolist()):
            n = int(mb.attention_mask[i].sum())
            assert torch.equal(used[i, mb.width - n :, LAYERS], recorded[row].int())
    # SGD with lr=1 moves the routers: natively, the last pass would route differently
    _, last_used, snapshot = module.forwards[-1]
    mb = module.forwards[-1][0]
    model = build_tiny_moe(seed=0)
    model.load_state_dict(snapshot)
    with torch.no_grad(), record_routes(model) as native:
        model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask.long(),
            position_ids=position_ids(mb.attention_mask),
        )
    real = mb.attention_mask
    assert not torch.equal(native.routes[real][:, LAYERS], last_used[real][:, LAYERS])


def test_r2_old_policy_forward_inside_a_micro_batch_block_replays_for_the_rest_of_it():
    class Inside(MicroPolicy):
        def training_step(self, batch, batch_idx):
            callback = RouterReplayCallback.find(self.trainer)
            for mb in batch.split([3, 2, 2]):
                with callback.micro_batch(mb) as layout:
                    assert layout is None  # nothing recorded for these rows yet
                    with callback.old_policy_forward(mb), torch.no_grad(), record_routes(self.model) as old:
                        self(mb)
                    self.model.model.layers[1].mlp.gate.weight.data.normal_()  # the policy moves
                    with record_routes(self.model) as rec:
                        self(mb)
                self.forwards.append((mb, old.routes, rec.routes))
            with callback.micro_batch(batch.select([6, 5, 4, 3, 2, 1, 0])) as layout:
                assert layout is not None  # every row recorded: a re-cut replays them
                with record_routes(self.model) as rec:
                    self(batch.select([6, 5, 4, 3, 2, 1, 0]))
            self.whole.append((batch, rec.routes))

    batch = make_batch(13, [5, 9, 4, 7, 6, 8, 3], with_routes=False)
    module = Inside([])
    fit(module, [batch], RouterReplayCallback(mode="r2", strict=True))
    for mb, old, used in module.forwards:
        real = mb.attention_mask
        assert torch.equal(used[real][:, LAYERS], old[real][:, LAYERS])
    _, used = module.whole[0]
    reversed_batch = batch.select([6, 5, 4, 3, 2, 1, 0])
    for i, row in enumerate([6, 5, 4, 3, 2, 1, 0]):
        n = int(batch.sequence_lengths[row])
        assert torch.equal(used[i, reversed_batch.width - n :, LAYERS], batch.routed_experts[row].int())


def test_micro_batch_blocks_cannot_nest_or_overlap_or_run_outside_a_step(seven):
    errors = []

    class Nesting(MicroPolicy):
        def training_step(self, batch, batch_idx):
            callback = RouterReplayCallback.find(self.trainer)
            first, second = batch.chunk(2)
            with callback.micro_batch(first):
                with (
                    pytest.raises(RuntimeError, match="cannot nest or overlap") as info,
                    callback.micro_batch(second),
                ):
                    pass
                errors.append(str(info.value))
                self(first)  # the outer block is still installed
            with callback.micro_batch(batch[4:5]) as layout:  # the routeless trajectory alone
                assert layout is not None and callback.routing_counts() is not None
                with record_routes(self.model) as rec:
                    self(batch[4:5])
            self.whole.append((batch[4:5], rec.routes))
            self(batch)  # and the step's routes are back

    callback = RouterReplayCallback(mode="r3", strict=True)
    module = Nesting([])
    _, logger = fit(module, [copy.deepcopy(seven)], callback)
    assert len(errors) == 1
    # a micro-batch whose rows have no captured route routes natively, strict or not
    alone, used = module.whole[0]
    model = build_tiny_moe(seed=0)
    with torch.no_grad(), record_routes(model) as native:
        model(
            input_ids=alone.input_ids,
            attention_mask=alone.attention_mask.long(),
            position_ids=position_ids(alone.attention_mask),
        )
    assert torch.equal(used, native.routes)
    assert logger.series("router_replay/batches_without_routes") == [0.0]
    with pytest.raises(RuntimeError, match="only valid inside a training step"), callback.micro_batch(seven):
        pass


def test_routes_are_cleared_before_the_next_callback_and_before_validation(seven):
    callback = RouterReplayCallback(mode="r3")
    seen = []

    class After(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(callback.backend.installed)

    module = MicroPolicy([lambda b: b.split([3, 2, 2])])
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, After()],
    )
    trainer.fit(module, loader([copy.deepcopy(seven)]))
    assert seen == [False]
    # stale routes of another shape, as after a step that never ended: validation clears them
    callback.backend.install(dense_engine_routes(seven), captured_mask(seven))

    class Validating(MicroPolicy):
        def validation_step(self, batch, batch_idx):
            with record_routes(self.model) as rec:
                self(batch[:2])  # would fail on the stale [7, S] routes
            self.whole.append(rec.routes)

    validating = Validating([])
    validating.model = module.model
    trainer.validate(validating, loader([copy.deepcopy(seven)]), verbose=False)
    assert len(validating.whole) == 1 and not callback.backend.installed
