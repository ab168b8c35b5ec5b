"""Batches whose routes are missing (r3): warned once per run, counted once per step, refused under
``strict``, and the count and warning state carried through a checkpoint into a resumed run."""

import copy
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from micro_policy import MicroPolicy, seven_batch
from replay_policy import MemoryLogger, fit, loader, position_ids

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.packed import PackedTensor
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes

FLAG = "--enable-return-routed-experts"


@pytest.fixture(scope="module")
def seven():
    return seven_batch()


def without_routes(batch, *, zero_rows=False):
    """``batch`` with ``routed_experts`` None, or present with 0 rows for each trajectory."""
    out = copy.deepcopy(batch)
    empty = torch.zeros(0, 4, 2, dtype=torch.uint8)
    out.routed_experts = PackedTensor.from_lengths(empty, [0] * len(out)) if zero_rows else None
    return out


class Whole(MicroPolicy):
    """One forward of the whole batch per step, recording the experts it used."""

    def __init__(self):
        super().__init__([])

    def training_step(self, batch, batch_idx):
        with record_routes(self.model) as rec:
            self(batch)
        self.whole.append((batch, rec.routes))


def native_routes(batch):
    model = build_tiny_moe(seed=0)
    with torch.no_grad(), record_routes(model) as rec:
        mask = batch.attention_mask
        model(input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=position_ids(mask))
    return rec.routes


def test_missing_routes_warn_once_are_counted_and_raise_when_strict(seven):
    routeless = without_routes(seven)
    batches = [routeless, copy.deepcopy(seven), copy.deepcopy(routeless)]
    with pytest.warns(UserWarning, match=FLAG) as caught:
        _, logger = fit(Whole(), batches, RouterReplayCallback(mode="r3"))
    assert sum(FLAG in str(w.message) for w in caught) == 1  # once per run
    assert logger.series("router_replay/batches_without_routes") == [1.0, 1.0, 2.0]
    assert logger.series("router_replay/replayed_fraction") == [0.0, 1.0, 0.0]
    assert [math.isnan(v) for v in logger.series("router_replay/native_agreement")] == [True, False, True]
    with pytest.raises(ValueError, match=rf"strict=True.*no routed_experts.*{FLAG}"):
        fit(Whole(), [copy.deepcopy(routeless)], RouterReplayCallback(mode="r3", strict=True))


def test_routes_of_zero_rows_are_missing_routes(seven):
    """``routed_experts`` present but empty is what an engine without routes may give a collator:
    warned, counted, routed natively (nothing stale installed), and an error under strict."""
    empty = without_routes(seven, zero_rows=True)
    module = Whole()
    with pytest.warns(UserWarning, match=rf"routed_experts of 0 rows, so it routes natively.*{FLAG}"):
        _, logger = fit(module, [copy.deepcopy(empty)], RouterReplayCallback(mode="r3"))
    assert logger.series("router_replay/batches_without_routes") == [1.0]
    assert logger.series("router_replay/replayed_fraction") == [0.0]
    assert torch.equal(module.whole[0][1], native_routes(empty))
    with pytest.raises(ValueError, match=rf"strict=True\): the batch has routed_experts of 0 rows.*{FLAG}"):
        fit(Whole(), [copy.deepcopy(empty)], RouterReplayCallback(mode="r3", strict=True))


class RouteStripping(MicroPolicy):
    """Three micro-batches per step, none of them carrying routes (a loop that drops the field)."""

    def __init__(self):
        super().__init__([])

    def training_step(self, batch, batch_idx):
        callback = RouterReplayCallback.find(self.trainer)
        for part in batch.chunk(3):
            part.routed_experts = None
            with callback.micro_batch(part) as layout:
                assert layout is None
                self(part)


def test_a_step_is_counted_once_not_once_per_micro_batch(seven):
    """A routeless step with three micro-batches counts 1; so does a routed step whose three
    micro-batches lack routes."""
    with pytest.warns(UserWarning, match=FLAG):
        _, logger = fit(
            RouteStripping(), [without_routes(seven), copy.deepcopy(seven)], RouterReplayCallback()
        )
    assert logger.series("router_replay/batches_without_routes") == [1.0, 2.0]


def test_a_resumed_trainer_keeps_counting_and_does_not_warn_again(seven, tmp_path):
    def run(callback, max_epochs, ckpt_path=None):
        logger = MemoryLogger()
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=max_epochs,
            logger=logger,
            log_every_n_steps=1,
            callbacks=[callback, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Whole(), loader([without_routes(seven), without_routes(seven)]), ckpt_path=ckpt_path)
        return logger

    with pytest.warns(UserWarning, match=FLAG):
        first = run(RouterReplayCallback(), 1)
    assert first.series("router_replay/batches_without_routes") == [1.0, 2.0]
    resumed = RouterReplayCallback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = run(resumed, 2, ckpt_path=tmp_path / "last.ckpt")
    assert second.series("router_replay/batches_without_routes") == [3.0, 4.0]
    assert not [w for w in caught if FLAG in str(w.message)]  # warned once per run, before the resume
    assert resumed.state_dict() == {"batches_without_routes": 4, "warned": ["r3"]}


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"batches_without_routes": -1}, "batches_without_routes must be an int >= 0, got -1"),
        ({"batches_without_routes": "2"}, "batches_without_routes must be an int >= 0, got '2'"),
        ({"warned": "r3"}, "warned must be a list of 'r3' / 'r2', got 'r3'"),
        ({"warned": ["r4"]}, r"warned must be a list of 'r3' / 'r2', got \['r4'\]"),
    ],
)
def test_a_bad_saved_state_is_refused_and_changes_nothing(state, field):
    callback = RouterReplayCallback()
    callback.load_state_dict({"batches_without_routes": 3, "warned": ["r3"]})
    with pytest.raises(ValueError, match=f"RouterReplayCallback state: {field}"):
        callback.load_state_dict(state)
    assert callback.state_dict() == {"batches_without_routes": 3, "warned": ["r3"]}
    assert callback.batches_without_routes == 3


class NoRoutedForward(MicroPolicy):
    """A step that never runs the routed model (e.g. a loop that only steps a value head)."""

    def __init__(self):
        super().__init__([])

    def training_step(self, batch, batch_idx):
        pass


def test_r2_strict_raises_when_a_step_runs_no_routed_forward(seven):
    """The strict pre-forward check never fires without a forward: the end-of-step check must
    (r2's batches come from an engine without routes)."""
    routeless = without_routes(seven)
    message = (
        r"mode='r2', strict=True\): no old_policy_forward\(batch\) in this training step recorded routes"
    )
    with pytest.raises(ValueError, match=message):
        fit(NoRoutedForward(), [copy.deepcopy(routeless)], RouterReplayCallback(mode="r2", strict=True))
    with pytest.warns(
        UserWarning, match=r"mode='r2'\): no old_policy_forward\(batch\) .*; nothing was replayed"
    ):
        _, logger = fit(NoRoutedForward(), [copy.deepcopy(routeless)] * 2, RouterReplayCallback(mode="r2"))
    assert logger.series("router_replay/batches_without_routes") == [1.0, 2.0]
