"""Threaded collation of trajectories into a :class:`RolloutBatch`, optionally into pinned buffers.

Rows are filled from a thread pool (:func:`~r3lightning.data.fill.collate_fields`). Routes stay
packed (segment ``i`` = trajectory ``i``'s captured rows, in the batch's widest route dtype).

Pinned buffer pool (``pin_memory=True``): pinning fresh memory every step is slow, so outputs are
carved out of a few reusable buffer sets ("slots"):

1. Collating a batch leases a free slot to it (``batch._lease``).
2. The slot is free again when the lease returns: ``batch.release(after=event)`` (as
   ``R3DataModule.transfer_batch_to_device`` does right after issuing the GPU copy), or, with
   ``recycle_after=N``, once ``N`` further batches were collated.
3. Before a slot is written again the pool waits on that event, so an in-flight copy completes.
4. With no free slot the batch gets fresh buffers outside the pool (``misses`` counts it).
5. The slot released longest ago is leased: its copy most likely finished a step ago.

The allocator is injectable, so the pool logic also runs (unpinned) without a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch import Tensor

from r3lightning.align.layout import check_int
from r3lightning.data.batch import RolloutBatch
from r3lightning.data.cpus import collate_pool_size
from r3lightning.data.fill import Allocator, Buffers, collate_fields, pinned_empty, plain_empty
from r3lightning.data.trajectory import Trajectory, padding_trajectories
from r3lightning.routes import check_layers

__all__ = ["PinnedBufferPool", "RolloutCollator", "collate_trajectories", "pinned_empty"]


class _Slot:
    def __init__(self) -> None:
        self.storage: dict[str, Tensor] = {}
        self.generation = 0  # bumped on every lease; stale leases cannot return the slot
        self.leased_at: int | None = None  # pool step of the current lease, None = free
        self.released_at = 0  # release counter value at the last release (0 = never leased)
        self.fence: Any = None  # event to wait on before the next write


class _Lease:
    def __init__(self, pool: PinnedBufferPool, slot: _Slot, generation: int) -> None:
        self._pool, self._slot, self._generation = pool, slot, generation

    def release(self, after: Any = None) -> None:
        self._pool._give_back(self._slot, self._generation, after)


class PinnedBufferPool:
    """A few reusable output buffer sets (lifetime rules: module docs). ``slots``: 2 covers the
    batch in training plus the next; ``allocator``: ``(shape, dtype) -> Tensor``, default
    :func:`pinned_empty`; ``recycle_after``: also free a slot after that many further batches."""

    def __init__(
        self, slots: int = 2, *, allocator: Allocator | None = None, recycle_after: int | None = None
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if recycle_after is not None and recycle_after < 1:
            raise ValueError(f"recycle_after must be >= 1 or None, got {recycle_after}")
        self.allocator = allocator or pinned_empty
        self.recycle_after = recycle_after
        self._slots = [_Slot() for _ in range(slots)]
        self._lock = threading.Lock()
        self._step = self._releases = 0
        self.hits = 0  # batches served from a slot
        self.misses = 0  # batches that found no free slot (fresh allocation)

    def acquire(self) -> tuple[Buffers, _Lease | None]:
        """Buffers for one batch and the lease that returns them (``None`` on a pool miss)."""
        with self._lock:
            self._step += 1
            free = [
                slot
                for slot in self._slots
                if slot.leased_at is None
                or (self.recycle_after is not None and self._step - slot.leased_at > self.recycle_after)
            ]
            if not free:
                self.misses += 1
                return Buffers(self.allocator), None
            # least recently released: its fence is the oldest copy, most likely finished already
            slot = min(free, key=lambda s: s.released_at)
            fence, slot.fence = slot.fence, None
            slot.generation += 1
            slot.leased_at = self._step
            self.hits += 1
        if fence is not None:
            fence.synchronize()  # an async copy out of this slot may still be reading it
        return Buffers(self.allocator, slot.storage), _Lease(self, slot, slot.generation)

    def _give_back(self, slot: _Slot, generation: int, fence: Any) -> None:
        with self._lock:
            if slot.generation == generation and slot.leased_at is not None:
                self._releases += 1
                slot.leased_at, slot.fence, slot.released_at = None, fence, self._releases

    @property
    def free_slots(self) -> int:
        with self._lock:
            return sum(slot.leased_at is None for slot in self._slots)


def collate_trajectories(
    trajectories: Sequence[Trajectory], *, pad_token_id: int = 0, width_multiple: int = 1
) -> RolloutBatch:
    """Serial collation into fresh (unpinned) memory; see :class:`RolloutCollator`."""
    check_int("width_multiple", width_multiple)
    check_int("pad_token_id", pad_token_id, 0)
    return RolloutBatch(**collate_fields(trajectories, Buffers(plain_empty), pad_token_id=pad_token_id,
                                         width_multiple=width_multiple))  # fmt: skip


class RolloutCollator:
    """``collate_fn``: a list of trajectories -> one left-padded :class:`RolloutBatch`.

    Args:
        num_threads: fill threads; ``None`` = :func:`~r3lightning.data.cpus.collate_pool_size`.
            1 fills serially in the calling thread.
        pad_token_id: id written at padding positions of ``input_ids``.
        width_multiple: round the padded width ``S`` up to a multiple of this.
        num_experts: expert count for placeholder routes of ``None`` entries (see below).
        pin_memory: carve outputs out of a :class:`PinnedBufferPool` (for GPU training): ``True``
            for a default one, or the pool itself (its slots, allocator, recycling).
        layers: keep routes only on these decoder layers
            (:meth:`~r3lightning.data.trajectory.Trajectory.on_layers`: routes on every layer are
            cut, others refused naming the trajectory); ``None``: as they come.

    ``None`` entries (shards evened out) become placeholders
    (:func:`~r3lightning.data.trajectory.padding_trajectories`), with a dummy route row when the
    batch has routes and ``num_experts`` is known.

    Cost: one host pass over the trajectories to plan, then ``O(B * S + route bytes)`` copies
    spread over the threads (routes on every layer cut to ``layers`` cost one more copy of the
    kept columns). No device work.
    """

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
        if num_threads is not None:
            check_int("num_threads", num_threads)
        check_int("width_multiple", width_multiple)
        check_int("pad_token_id", pad_token_id, 0)
        self.num_threads = collate_pool_size() if num_threads is None else num_threads
        self.pad_token_id, self.width_multiple = pad_token_id, width_multiple
        self.num_experts, self.pin_memory = num_experts, bool(pin_memory)
        self.layers = check_layers("layers", layers)
        self.pool = PinnedBufferPool() if pin_memory is True else pin_memory or None
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._executor_users: dict[ThreadPoolExecutor, int] = {}  # collations running on each pool

    def _enter_executor(self) -> ThreadPoolExecutor | None:
        """The fill pool for one collation; :meth:`close` never shuts it down under a user."""
        if self.num_threads <= 1:
            return None
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.num_threads, thread_name_prefix="r3-collate")
            executor = self._executor
            self._executor_users[executor] = self._executor_users.get(executor, 0) + 1
        return executor

    def _exit_executor(self, executor: ThreadPoolExecutor | None) -> None:
        if executor is None:
            return
        with self._executor_lock:
            self._executor_users[executor] -= 1
            idle = self._executor_users[executor] == 0
            if idle:
                del self._executor_users[executor]
            retired = idle and executor is not self._executor  # closed while this one ran
        if retired:
            executor.shutdown(wait=False)  # its tasks are done: the collation waited for them

    def __call__(self, trajectories: Sequence[Trajectory | None]) -> RolloutBatch:
        where = "trajectory {} of the batch".format
        items = [t if t is None else t.on_layers(self.layers, where(i)) for i, t in enumerate(trajectories)]
        missing = [i for i, t in enumerate(items) if t is None]
        if missing:
            routed = [t for t in items if t is not None and t.routed_experts is not None]
            schemas = {(t.route_schema, t.route_layers) for t in routed}
            schema, layers = next(iter(schemas)) if len(schemas) == 1 else (None, None)
            fillers = iter(padding_trajectories(len(missing), pad_token_id=self.pad_token_id, route_schema=schema,
                                                num_experts=self.num_experts, route_layers=layers))  # fmt: skip
            items = [next(fillers) if t is None else t for t in items]
        buffers, lease = (Buffers(plain_empty), None) if self.pool is None else self.pool.acquire()
        executor = self._enter_executor()
        try:
            fields = collate_fields(items, buffers, pad_token_id=self.pad_token_id, executor=executor,
                                    width_multiple=self.width_multiple, tasks=self.num_threads)  # fmt: skip
            batch = RolloutBatch(**fields)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        finally:
            self._exit_executor(executor)
        batch._lease = lease
        return batch

    def close(self) -> None:
        """Stop the fill threads (a later collation restarts them). Safe while other threads
        collate: a pool still in use is shut down by its last user."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
            busy = executor is not None and executor in self._executor_users
        if executor is not None and not busy:
            executor.shutdown(wait=True)

    def __getstate__(self) -> dict[str, Any]:
        # threads and pinned pages do not travel between processes
        state = self.__dict__.copy()
        state["_executor"] = None
        del state["_executor_lock"], state["_executor_users"]
        if self.pool is not None:
            state["pool"] = PinnedBufferPool(
                len(self.pool._slots), allocator=self.pool.allocator, recycle_after=self.pool.recycle_after
            )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._executor_lock = threading.Lock()
        self._executor_users = {}
