"""Threaded collation of trajectories into a [`RolloutBatch`][r3lightning.data.batch.RolloutBatch], optionally into pinned buffers.

With ``pin_memory=True`` outputs are carved out of a few reusable buffer sets ("slots"): a batch
leases the free slot released longest ago (fresh buffers when none is free: ``misses``), given
back by ``batch.release(after=event)`` (the next write waits on the event) or after
``recycle_after`` further batches. The allocator is injectable, so the pool runs without a GPU.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from r3lightning._keywords import refuse_moved_keywords
from r3lightning.checks import check_int
from r3lightning.data.batch import RolloutBatch
from r3lightning.data.cpus import collate_pool_size
from r3lightning.data.fill import Allocator, Buffers, collate_fields, pinned_empty, plain_empty
from r3lightning.rollout.trajectory import Trajectory, padding_trajectories, route_signature
from r3lightning.routes import check_layers

__all__ = ["PinnedBufferPool", "RolloutCollator", "collate_trajectories", "pinned_empty"]


@dataclass(eq=False)
class _Slot:
    storage: dict[str, Tensor] = field(default_factory=dict)
    generation: int = 0  # bumped on every lease; stale leases cannot return the slot
    leased_at: int | None = None  # pool step of the current lease, None = free
    released_at: int = 0  # release counter value at the last release (0 = never leased)
    fence: Any = None  # event to wait on before the next write


class PinnedBufferPool:
    """A few reusable output buffer sets (the module's docs): 2 ``slots`` cover one batch in training
    and the next in collation. Thread-safe.

    Args:
        slots: Buffer sets, >= 1.
        allocator: ``(shape, dtype) -> tensor`` (default: pinned CPU memory, which needs an
            accelerator runtime).
        recycle_after: Take a leased slot back after this many further batches even if its batch
            was never released (None: never).

    Raises:
        ValueError: ``slots`` or ``recycle_after`` below 1.
    """

    def __init__(
        self, slots: int = 2, *, allocator: Allocator | None = None, recycle_after: int | None = None
    ) -> None:
        if recycle_after is not None:
            check_int("recycle_after", recycle_after)
        self.allocator = allocator or pinned_empty
        self.recycle_after = recycle_after
        self._slots = [_Slot() for _ in range(check_int("slots", slots))]
        self._lock = threading.Lock()
        self._step = 0  # acquisitions so far
        self._releases = 0  # releases so far: orders the free slots by when they came back
        self.hits = 0  # batches served from a slot
        self.misses = 0  # batches that found no free slot (fresh buffers)

    def acquire(self) -> tuple[Buffers, Callable[..., None] | None]:
        """Buffers for one batch and the lease that returns them (``None`` on a pool miss)."""
        with self._lock:
            self._step += 1
            limit = math.inf if self.recycle_after is None else self.recycle_after
            free = [s for s in self._slots if s.leased_at is None or self._step - s.leased_at > limit]
            if not free:
                self.misses += 1
                return Buffers(self.allocator), None
            # least recently released: its fence is the oldest copy, most likely finished already
            slot = min(free, key=lambda s: s.released_at)
            fence = slot.fence
            slot.fence = None
            slot.generation = slot.generation + 1
            slot.leased_at = self._step
            lease = functools.partial(self._give_back, slot, slot.generation)
            self.hits += 1
        if fence is not None:
            fence.synchronize()  # an async copy out of this slot may still be reading it
        return Buffers(self.allocator, slot.storage), lease

    def _give_back(self, slot: _Slot, generation: int, fence: Any = None) -> None:
        with self._lock:
            if slot.generation == generation and slot.leased_at is not None:
                self._releases += 1
                slot.leased_at = None
                slot.fence = fence
                slot.released_at = self._releases

    @property
    def free_slots(self) -> int:
        with self._lock:
            return sum(slot.leased_at is None for slot in self._slots)


def collate_trajectories(
    trajectories: Sequence[Trajectory], *, pad_token_id: int = 0, width_multiple: int = 1
) -> RolloutBatch:
    """Serial collation into fresh (unpinned) memory; see `RolloutCollator`.

    Args:
        trajectories: At least one trajectory, one route schema.
        pad_token_id: The padding id of ``input_ids``.
        width_multiple: The padded width rounds up to a multiple of it.

    Returns:
        The batch on the CPU.
    """
    collator = RolloutCollator(num_threads=1, pad_token_id=pad_token_id, width_multiple=width_multiple)
    return collator(trajectories)


# 0.1 keywords -> PinnedBufferPool's arguments in 0.2
_POOL_MOVED = {"pool_slots": "pin_memory=PinnedBufferPool(slots)"}
_POOL_MOVED |= {name: f"pin_memory=PinnedBufferPool({name}=)" for name in ("allocator", "recycle_after")}


class RolloutCollator:
    """``collate_fn``: a list of trajectories -> one left-padded [`RolloutBatch`][r3lightning.data.batch.RolloutBatch]; one host pass
    to plan, then ``O(B * S + route bytes)`` copies over the threads, no device work.

    Args:
        num_threads: fill threads (1: serial); ``None``: `collate_pool_size`.
        pad_token_id, width_multiple: the padding id, and a multiple the padded width rounds up to.
        num_experts: sizes the dummy route row of a placeholder (a ``None`` entry).
        pin_memory: collate into a `PinnedBufferPool` (``True``: a default one).
        layers: keep routes only on these decoder layers (``Trajectory.on_layers``).

    Collations may run concurrently (threads share the fill pool; `close` is safe meanwhile).

    Raises:
        ValueError: A bad thread count, ``width_multiple``, ``pad_token_id`` or ``layers``.
        TypeError: A keyword of 0.1 (named with its replacement).
    """

    @refuse_moved_keywords(_POOL_MOVED)
    def __init__(
        self,
        *,
        num_threads: int | None = None,
        pad_token_id: int = 0,
        width_multiple: int = 1,
        num_experts: int | None = None,
        pin_memory: bool | PinnedBufferPool = False,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.num_threads = (
            collate_pool_size() if num_threads is None else check_int("num_threads", num_threads)
        )
        self.width_multiple = check_int("width_multiple", width_multiple)
        self.pad_token_id = check_int("pad_token_id", pad_token_id, 0)
        self.num_experts = num_experts
        self.pin_memory = bool(pin_memory)
        self.layers = check_layers("layers", layers)
        self.pool = PinnedBufferPool() if pin_memory is True else pin_memory or None
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._executor_users: dict[ThreadPoolExecutor, int] = {}  # collations running on each pool

    @contextmanager
    def _fill_pool(self) -> Iterator[ThreadPoolExecutor | None]:
        """The fill threads of one collation (None: serial); the last user shuts a closed pool down."""
        if self.num_threads <= 1:
            yield None
            return
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.num_threads, thread_name_prefix="r3-collate")
            executor = self._executor
            self._executor_users[executor] = self._executor_users.get(executor, 0) + 1
        try:
            yield executor
        finally:
            with self._executor_lock:
                left = self._executor_users.pop(executor) - 1
                if left:
                    self._executor_users[executor] = left
            if not left and executor is not self._executor:  # closed while this one ran
                executor.shutdown(wait=False)  # its tasks are done: the collation waited for them

    def __call__(self, trajectories: Sequence[Trajectory | None]) -> RolloutBatch:
        where = "trajectory {} of the batch".format
        items = [t if t is None else t.on_layers(self.layers, where(i)) for i, t in enumerate(trajectories)]
        missing = sum(t is None for t in items)
        if missing:
            real = (t for t in items if t is not None)
            schema, layers = route_signature(real, "trajectories in one batch")
            fillers = iter(
                padding_trajectories(
                    missing,
                    pad_token_id=self.pad_token_id,
                    route_schema=schema,
                    num_experts=self.num_experts,
                    route_layers=layers,
                )
            )
            items = [next(fillers) if t is None else t for t in items]
        buffers, lease = (Buffers(plain_empty), None) if self.pool is None else self.pool.acquire()
        try:
            with self._fill_pool() as executor:
                fields = collate_fields(
                    items,
                    buffers,
                    pad_token_id=self.pad_token_id,
                    executor=executor,
                    width_multiple=self.width_multiple,
                    tasks=self.num_threads,
                )
            batch = RolloutBatch(**fields)
        except BaseException:
            if lease is not None:
                lease()
            raise
        batch._lease = lease
        return batch

    def close(self) -> None:
        """Stop the fill threads (a later collation restarts them); safe while others collate."""
        with self._executor_lock:
            executor = self._executor
            self._executor = None
            busy = executor is not None and executor in self._executor_users
        if executor is not None and not busy:
            executor.shutdown(wait=True)

    def __getstate__(self) -> dict[str, Any]:
        # threads, locks and pinned pages do not travel between processes
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_executor")}
        pool = self.pool
        if pool is not None:
            state["pool"] = PinnedBufferPool(
                len(pool._slots), allocator=pool.allocator, recycle_after=pool.recycle_after
            )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _executor=None, _executor_lock=threading.Lock(), _executor_users={})
