"""The staleness rule and the rollout worker that follows it: step ``s`` starts once the trainer
asked for step ``s - k``, not one step earlier (a bound off by one) nor later (no overlap)."""

from __future__ import annotations

import threading
import time

import pytest

from r3lightning.data.ahead import AheadConfig, RolloutWorker, may_collect
from r3lightning.data.stream import StreamingReplayBuffer
from r3lightning.rollout.stats import CollectedRollouts
from r3lightning.rollout.trajectory import Trajectory


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_the_rule_allows_exactly_k_versions(k):
    for requested in range(4):
        for step in range(requested, requested + k + 3):
            assert may_collect(step, requested, k) == (step <= requested + k)
    assert may_collect(3 + k, 3, k) and not may_collect(4 + k, 3, k)  # the boundary, both sides


class _Collector:
    """Instant rollouts; records the trainer's step (``buffer.requested``) when each step starts."""

    def __init__(self, buffer: StreamingReplayBuffer, fail_at: int | None = None) -> None:
        self.buffer, self.fail_at = buffer, fail_at
        self.started: dict[int, int] = {}
        self.exact: dict[int, int | None] = {}  # the version the collector was told to expect
        self.closed = False

    async def collect_async(self, prompts, *, step, weight_version=None):
        self.started[step] = self.buffer.requested
        self.exact[step] = weight_version
        if step == self.fail_at:
            raise ConnectionError(f"engine down at step {step}")
        return CollectedRollouts([Trajectory(prompts, [1, 2])], [0], None)

    async def aclose(self):
        self.closed = True


def _worker(k: int, steps: int, fail_at: int | None = None):
    buffer = StreamingReplayBuffer(AheadConfig(k).ahead)
    collector = _Collector(buffer, fail_at)
    info = lambda step, rollouts: {"step_seen": float(step)}  # noqa: E731
    served = lambda step: 10 * step + 7  # noqa: E731  (the weight version pushed for a trainer step)
    worker = RolloutWorker(
        collector,
        lambda step: [step + 1],
        buffer,
        steps=steps,
        config=AheadConfig(k),
        summarize=info,
        served=served,
    )
    return buffer, collector, worker


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_worker_runs_exactly_k_steps_ahead(k):
    steps = 6
    buffer, collector, worker = _worker(k, steps)
    worker.start()
    try:
        for step in range(steps):
            assert buffer.advance() == step
            assert buffer.info["step_seen"] == step and [t.prompt_ids.tolist() for t in buffer] == [
                [step + 1]
            ]
            # while step `step` trains, the worker reaches step + k (overlap) ...
            last = min(step + k, steps - 1)
            _wait_for(lambda last=last: last in collector.started, f"step {last} to start")
            time.sleep(0.2)  # ... and goes no further: a worker one step too eager would start now
            assert max(collector.started) == last
            # an engine that reports no weight version: the oldest one possible
            assert [t.weight_version for t in buffer] == [10 * collector.started[step] + 7]
            # on-policy the collector checks the engines serve exactly that version
            assert collector.exact[step] == (10 * step + 7 if k == 0 else None)
    finally:
        worker.stop()
    assert sorted(collector.started) == list(range(steps)) and collector.closed
    assert all(step - requested <= k for step, requested in collector.started.items())
    assert [collector.started[s] for s in range(k, steps)] == list(range(steps - k))  # as soon as allowed


def test_a_collection_error_reaches_the_trainer_and_stop_ends_waits():
    buffer, collector, worker = _worker(1, 5, fail_at=2)
    worker.start()
    assert [buffer.advance(), buffer.advance()] == [0, 1]
    with pytest.raises(ConnectionError, match=r"engine down at step 2"):
        buffer.advance()
    worker.stop()
    buffer, collector, worker = _worker(0, 5)
    worker.start()
    thread = threading.Thread(target=worker.stop)
    thread.start()  # the worker waits for the trainer's first request: stop wakes it
    thread.join(60)
    assert not thread.is_alive() and collector.started == {} and collector.closed


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r"max_staleness must be an integer >= 0, got -1"):
        AheadConfig(-1)
    with pytest.raises(ValueError, match=r"max_staleness=3 lets 3 steps wait, but the buffer's ahead is 1"):
        RolloutWorker(None, list, StreamingReplayBuffer(1), steps=2, config=AheadConfig(3))
    with pytest.raises(TypeError, match=r"buffer must be a StreamingReplayBuffer, got list"):
        RolloutWorker(None, list, [], steps=2, config=AheadConfig(0))
