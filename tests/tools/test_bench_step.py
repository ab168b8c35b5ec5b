"""benchmarks/bench_step.py times what it claims: r3 steps replay the engine's routes, off steps none.

A bench whose r3 arm silently stopped replaying (or whose off arm replayed) would report a ratio of
the wrong thing; its own checks must turn either into a failure.
"""

from __future__ import annotations

import pytest
import torch
from python_process import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("bench_step") as module:
        yield module


@pytest.fixture(scope="module")
def batch(bench):
    case = bench.cases(quick=True)["tiny"]
    trajectories, disagreement = bench.engine_trajectories(case)
    return case, trajectories, disagreement


def time_one_repeat_on_cpu(bench, batch) -> dict:
    """The bench's ``time_steps`` of a fresh seed-0 tiny model over ``batch``: one repeat, CPU."""
    case, trajectories, _ = batch
    model = bench.build_tiny_moe(bench.tiny_moe_config(**case.config), seed=0)
    return bench.time_steps(model, trajectories, torch.device("cpu"), repeats=1)


def test_arms_alternate_evenly_each_going_first_in_every_other_pair(bench):
    assert [bench.arm_of(i) for i in range(8)] == ["r3", "off", "off", "r3", "r3", "off", "off", "r3"]


def test_engine_routes_disagree_with_the_trainer_on_the_simulated_share(bench, batch):
    case, trajectories, disagreement = batch
    assert [t.num_tokens for t in trajectories] == list(case.lengths)
    assert sum(case.lengths) == 128
    for t in trajectories:  # every forwarded token has a route row: n - 1 rows, distinct experts
        assert t.routed_experts.shape == (t.num_tokens - 1, 4, 2)
        assert (t.routed_experts[:, 1:, 0] != t.routed_experts[:, 1:, 1]).all()
    assert abs(disagreement - bench.DISAGREEMENT) < 0.03


@pytest.mark.slow
def test_timed_r3_steps_replay_and_off_steps_route_natively(bench, batch):
    result = time_one_repeat_on_cpu(bench, batch)
    assert result["steps"] == 4 and result["r3"] > 0 and result["off"] > 0
    # the off steps compared native routing with the engine's: the simulated ~10% disagreement
    assert 0.8 < result["native_agreement"] < 0.97


@pytest.mark.slow
def test_an_r3_arm_that_replays_nothing_fails_the_bench(bench, batch, monkeypatch):
    from r3lightning.replay.hf.replay import HFRouterReplay

    monkeypatch.setattr(HFRouterReplay, "install", lambda self, routes, replay_mask=None: None)
    with pytest.raises(
        bench.CheckFailed, match=r"step 0 \(r3\): replayed_fraction, used_agreement = \(0\.0, "
    ):
        time_one_repeat_on_cpu(bench, batch)


@pytest.mark.slow
def test_an_off_arm_that_replays_fails_the_bench(bench, batch, monkeypatch):
    callback = bench.RouterReplayCallback
    monkeypatch.setattr(bench, "RouterReplayCallback", lambda mode: callback(mode="r3"))
    with pytest.raises(
        bench.CheckFailed, match=r"step 1 \(off\): replayed_fraction, used_agreement = \(1\.0, 1\.0\)"
    ):
        time_one_repeat_on_cpu(bench, batch)


@pytest.mark.slow
def test_a_wrong_reference_loss_fails_the_bench(bench, batch, monkeypatch):
    reference = bench.reference_losses
    monkeypatch.setattr(bench, "reference_losses", lambda *a: {**reference(*a), "r3": reference(*a)["off"]})
    with pytest.raises(bench.CheckFailed, match=r"step 0 \(r3\): loss .*, the r3 reference gives"):
        time_one_repeat_on_cpu(bench, batch)
