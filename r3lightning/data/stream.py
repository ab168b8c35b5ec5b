"""``StreamingReplayBuffer``: a replay buffer that holds one RL step at a time while a producer
thread fills the next ones. Thread-safe, bounded (``ahead`` whole steps wait at most: a producer
with more blocks), resumable (the waiting steps are part of its state: a checkpoint taken while
steps wait resumes with each of them trained exactly once; a step still being collected is not
in the state and is collected again)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from r3lightning.checks import check_int
from r3lightning.data.buffer import ReplayBuffer, check_state, pack_trajectories, unpack_trajectories
from r3lightning.rollout.trajectory import Trajectory

__all__ = ["StreamClosedError", "StreamingReplayBuffer"]

_STATE_VERSION = 1


class StreamClosedError(RuntimeError):
    """The stream was closed while a producer or the trainer waited on it."""


class StreamingReplayBuffer(ReplayBuffer):
    """The trainer's [`ReplayBuffer`][r3lightning.data.buffer.ReplayBuffer] of the current RL step, fed step by step from a producer.

    The producer (a rollout worker thread) calls `put` for steps ``0, 1, 2, ...`` in order;
    the consumer (``R3DataModule``, at each new epoch) calls `advance`, which waits for the
    next step and makes it the buffer's contents. `wait_for_request` lets the producer wait
    until the trainer has asked for a given step (the staleness rule's clock).

    Args:
        ahead: most whole steps that may wait beside the current one; `put` blocks beyond.
        vocab_size, num_experts, layers: as for [`ReplayBuffer`][r3lightning.data.buffer.ReplayBuffer].

    Thread-safe between one producer and one consumer (one condition variable guards the queue).

    Raises:
        ValueError: ``ahead`` below 1, or a bad size or ``layers``.
    """

    def __init__(
        self,
        ahead: int = 1,
        *,
        vocab_size: int | None = None,
        num_experts: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(vocab_size=vocab_size, num_experts=num_experts, layers=layers)
        self.ahead = check_int("StreamingReplayBuffer ahead", ahead)
        self._cond = threading.Condition()
        self._waiting: dict[int, tuple[list[Trajectory], dict[str, float]]] = {}  # step -> (items, info)
        self._next_take = 0  # the step advance() returns next
        self._requested = -1  # the last step advance() was asked for
        self._asked = False  # whether advance() was called since the last reopen()
        self._error: BaseException | None = None
        self._closed = False
        self.step = -1  # the step the buffer holds (-1: none yet)
        self.info: dict[str, float] = {}  # the producer's statistics of that step
        self.waited_s = 0.0  # how long the last advance() waited for its step

    @property
    def next_put(self) -> int:
        """The step `put` takes next: after every waiting one."""
        with self._cond:
            return self._next_take + len(self._waiting)

    @property
    def requested(self) -> int:
        """The last step the trainer asked for (-1: none yet)."""
        with self._cond:
            return self._requested

    def put(
        self, step: int, trajectories: Iterable[Trajectory], info: dict[str, float] | None = None
    ) -> float:
        """Queue a step, blocking while ``ahead`` steps wait. Called by the producer thread.

        Args:
            step: The next step in order (`next_put`).
            trajectories: Its trajectories (validated when `advance` takes the step).
            info: The producer's statistics of the step.

        Returns:
            The seconds it blocked.

        Raises:
            ValueError: A step out of order.
            StreamClosedError: The buffer was closed.
        """
        items = list(trajectories)
        start = time.perf_counter()
        with self._cond:
            while len(self._waiting) >= self.ahead and not self._closed:
                self._cond.wait()
            if self._closed:
                raise StreamClosedError("the streaming replay buffer is closed")
            expected = self._next_take + len(self._waiting)
            if step != expected:
                raise ValueError(
                    f"StreamingReplayBuffer.put: steps arrive in order; expected step {expected}, got {step}"
                )
            self._waiting[step] = (items, dict(info or {}))
            self._cond.notify_all()
        return time.perf_counter() - start

    def wait_next(self) -> int:
        """Ask for the next step and wait until it arrived, without taking it; returns the step.
        Raises the producer's error (see `fail`), or ``StreamClosedError``."""
        with self._cond:
            return self._wait_next()

    def _wait_next(self) -> int:
        step = self._next_take
        self._requested = step
        self._asked = True
        self._cond.notify_all()
        while step not in self._waiting and self._error is None and not self._closed:
            self._cond.wait()
        if step not in self._waiting:
            if self._error is not None:
                raise self._error
            raise StreamClosedError(f"the streaming replay buffer closed before step {step} arrived")
        return step

    def advance(self) -> int:
        """Wait for the next step and make it the contents (the previous ones are dropped); returns
        the step. Raises the producer's error (see `fail`), or ``StreamClosedError``."""
        start = time.perf_counter()
        with self._cond:
            step = self._wait_next()
            items, info = self._waiting.pop(step)
            self._next_take = step + 1
            self._cond.notify_all()
        self.clear()
        self.extend(items)
        self.step = step
        self.info = info
        self.waited_s = time.perf_counter() - start
        return step

    def wait_for_request(self, ready: Callable[[int], bool]) -> bool:
        """Block until the trainer has called `advance` and ``ready(requested)`` holds.

        Args:
            ready: ``requested step -> bool`` (e.g. `may_collect`).

        Returns:
            False once closed.
        """
        with self._cond:
            while not (self._asked and ready(self._requested)) and not self._closed:
                self._cond.wait()
            return not self._closed

    def fail(self, error: BaseException) -> None:
        """Report the producer's error: the waiting `advance` (or the next one) raises it.

        Args:
            error: The producer's error.
        """
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiting producer and consumer; idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def reopen(self) -> None:
        """Forget a close and a producer error, for a new producer (a new ``fit``)."""
        with self._cond:
            self._closed = False
            self._error = None
            self._asked = False
            self._requested = self._next_take - 1

    def drop_waiting(self) -> None:
        """Forget the waiting steps (they are collected again from `next_put`)."""
        with self._cond:
            self._waiting.clear()
            self._cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """The current step (as `ReplayBuffer.state_dict`) plus the waiting steps, at one instant."""
        with self._cond:
            waiting = sorted(self._waiting.items())
            next_take = self._next_take
        state = super().state_dict()
        state["stream"] = {
            "version": _STATE_VERSION,
            "step": self.step,
            "info": dict(self.info),
            "next_take": next_take,
            "waiting": [
                {"step": s, "info": dict(i), "trajectories": pack_trajectories(t)} for s, (t, i) in waiting
            ],
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the current step and the waiting ones, checked first: a ``ValueError`` changes
        nothing. A plain [`ReplayBuffer`][r3lightning.data.buffer.ReplayBuffer] state holds no stream: nothing waits."""
        where = "StreamingReplayBuffer state"
        check_state(state, (), where)
        stream = state.get("stream") or {
            "version": _STATE_VERSION,
            "step": -1,
            "info": {},
            "next_take": 0,
            "waiting": [],
        }
        check_state(
            stream, ("step", "info", "next_take", "waiting"), f"{where} stream", version=_STATE_VERSION
        )
        next_take = check_int(f"{where} stream.next_take", stream["next_take"], 0)
        step = stream["step"]
        if type(step) is not int or step < -1:
            raise ValueError(f"{where} stream.step must be an integer >= -1, got {step!r}")
        waiting: dict[int, tuple[list[Trajectory], dict[str, float]]] = {}
        for i, entry in enumerate(stream["waiting"]):
            check_state(entry, ("step", "info", "trajectories"), f"{where} stream.waiting[{i}]")
            if entry["step"] != next_take + i:
                raise ValueError(
                    f"{where} stream.waiting[{i}].step must be {next_take + i} (consecutive from "
                    f"next_take), got {entry['step']!r}"
                )
            items = unpack_trajectories(entry["trajectories"], where=f"{where} stream.waiting[{i}]")
            waiting[entry["step"]] = (items, dict(entry["info"]))
        if len(waiting) > self.ahead:
            raise ValueError(
                f"{where} holds {len(waiting)} waiting steps, more than this buffer's ahead={self.ahead}"
            )
        super().load_state_dict({k: v for k, v in state.items() if k != "stream"})
        with self._cond:
            self._waiting = waiting
            self._next_take = next_take
            self._requested = next_take - 1
            self._error = None
            self._cond.notify_all()
        self.step = step
        self.info = dict(stream["info"])

    def __repr__(self) -> str:
        with self._cond:
            waiting = sorted(self._waiting)
        return (
            f"StreamingReplayBuffer(step={self.step}, len={len(self)}, waiting={waiting}, ahead={self.ahead})"
        )
