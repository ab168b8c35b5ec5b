"""Rollouts ahead of training with bounded staleness: a worker thread with its own event loop
collects RL steps into a `StreamingReplayBuffer` while the trainer
trains earlier ones (docs: "Off-policy training"). The worker composes a rollout collector with
the data stage's streaming buffer, so it lives here, above both.

Policy versions count RL steps: the trainer trains step ``s`` with weights of version ``s`` (the
initial weights are version 0). A step's rollouts start only once the trainer has asked for step
``s - max_staleness`` (`may_collect`); the weights of that version were pushed to the engine
before, so every trajectory of step ``s`` comes from a version in ``[s - max_staleness, s]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from r3lightning.data.stream import StreamClosedError, StreamingReplayBuffer
from r3lightning.rollout.collector import CollectedRollouts, RolloutCollector

# AheadConfig lives with the other rollout settings (the job checks them without torch)
from r3lightning.rollout.config import AheadConfig

__all__ = ["AheadConfig", "RolloutWorker", "may_collect"]

logger = logging.getLogger(__name__)


def may_collect(step: int, requested: int, max_staleness: int) -> bool:
    """Whether rollouts of ``step`` may start once the trainer has asked for step ``requested``: the
    weights of version ``requested`` or newer are then on the engine, so trained at step ``step``
    they are at most ``max_staleness`` versions old.

    Args:
        step: The step to collect.
        requested: The latest step the trainer asked for.
        max_staleness: `AheadConfig.max_staleness`.

    Returns:
        ``step - requested <= max_staleness``.
    """
    return step - requested <= max_staleness


class RolloutWorker:
    """Collects steps ``buffer.next_put, ... , steps - 1`` into ``buffer`` on its own thread and
    event loop, each as soon as `may_collect` allows; an error ends the worker and is
    raised by the trainer's next ``buffer.advance()``.

    Args:
        collector: collects one step (its clients live on the worker's event loop).
        prompts_for_step: ``step -> the step's prompts``.
        buffer: where whole steps go, and the trainer's clock.
        steps: steps of the run (none is collected at or past it).
        config: `AheadConfig`.
        summarize: ``(step, CollectedRollouts) -> {statistic: value}`` kept with the step (``buffer.info``).
        served: ``trainer step -> the weight version pushed for it`` (None: unknown), recorded on
            trajectories whose engine reports no version; on-policy it is also checked against
            the version an engine reports (see ``RolloutCollector.collect_async``).

    Raises:
        TypeError: ``buffer`` is not a `StreamingReplayBuffer`.
        ValueError: The buffer's ``ahead`` is below what ``config.max_staleness`` lets wait.
    """

    def __init__(
        self,
        collector: RolloutCollector,
        prompts_for_step: Callable[[int], Sequence[Any]],
        buffer: StreamingReplayBuffer,
        *,
        steps: int,
        config: AheadConfig,
        summarize: Callable[[int, CollectedRollouts], dict[str, float]] | None = None,
        served: Callable[[int], int | None] | None = None,
    ) -> None:
        if not isinstance(buffer, StreamingReplayBuffer):
            raise TypeError(f"buffer must be a StreamingReplayBuffer, got {type(buffer).__name__}")
        if buffer.ahead < config.ahead:
            raise ValueError(
                f"max_staleness={config.max_staleness} lets {config.ahead} steps wait, but the buffer's "
                f"ahead is {buffer.ahead}: StreamingReplayBuffer(ahead={config.ahead})"
            )
        self.collector = collector
        self.prompts_for_step = prompts_for_step
        self.buffer = buffer
        self.steps = steps
        self.config = config
        self.summarize = summarize
        self.served = served or (lambda step: None)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> RolloutWorker:
        """Start the thread; it waits for the trainer's first ``advance()`` before it collects."""
        if self._thread is not None:
            raise RuntimeError("a RolloutWorker starts once")
        self.buffer.reopen()
        self._thread = threading.Thread(target=self._run, name="r3-rollout-worker", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Cancel the step in progress (its rollouts are dropped), wake every wait, join; idempotent."""
        self.buffer.close()
        loop = self._loop
        task = self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(task.cancel)
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        self._loop = loop = asyncio.new_event_loop()
        try:
            self._task = loop.create_task(self._produce())
            loop.run_until_complete(self._task)
        except (StreamClosedError, asyncio.CancelledError):
            pass
        except BaseException as exc:  # the trainer raises it at its next advance()
            logger.debug("rollout worker failed: %r", exc)
            self.buffer.fail(exc)
        finally:
            loop.run_until_complete(self.collector.aclose())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    async def _produce(self) -> None:
        buffer = self.buffer
        staleness = self.config.max_staleness
        if not await asyncio.to_thread(buffer.wait_for_request, lambda requested: True):
            return  # closed before the trainer asked for anything
        step = buffer.next_put  # after a restore: past the steps that wait in the state
        while step < self.steps:
            start = time.perf_counter()

            def allowed(requested: int, step: int = step) -> bool:
                return may_collect(step, requested, staleness)

            if not await asyncio.to_thread(buffer.wait_for_request, allowed):
                return
            engine_wait = time.perf_counter() - start
            # the weights pushed for the trainer's step serve this one (or newer ones, pushed while
            # it is collected, unless on-policy: then no push comes before the step is trained)
            floor = self.served(buffer.requested)
            exact = floor if staleness == 0 else None
            prompts = self.prompts_for_step(step)
            rollouts = await self.collector.collect_async(prompts, step=step, weight_version=exact)
            for trajectory in rollouts.trajectories:
                if trajectory.weight_version is None:  # an engine that reports none: the oldest possible
                    trajectory.weight_version = floor
            info = dict(self.summarize(step, rollouts)) if self.summarize is not None else {}
            info["engine_wait_s"] = engine_wait
            await asyncio.to_thread(buffer.put, step, rollouts.trajectories, info)
            step += 1
