"""``R3DataModule``: replay buffer -> sharded, threaded, pinned ``RolloutBatch`` es for Lightning.

Epochs and the RL loop
----------------------
The buffer changes between RL steps, so an epoch is defined over a *snapshot*: each call of
:meth:`R3DataModule.train_dataloader` (every ``trainer.fit``, or every epoch with
``Trainer(reload_dataloaders_every_n_epochs=1)``) takes the buffer's current contents, and one
epoch is one pass over them. Both shapes of the main loop work:

* ``collect rollouts -> buffer.extend -> trainer.fit(...)`` repeated (a new or re-armed
  Trainer per RL step): each fit sees the latest contents;
* one long ``trainer.fit`` with ``reload_dataloaders_every_n_epochs=1`` and rollouts collected
  in ``on_train_epoch_end`` (Lightning reloads before ``on_train_epoch_start``).

The data module keeps its own epoch counter (the shuffle seed is ``seed + epoch``), so repeated
fits never replay the same order; Lightning's ``set_epoch`` is ignored. The counter advances when
a new snapshot is taken after an epoch was drawn from, or when a loader is iterated again after
finishing its epoch (several epochs over one snapshot without reloading). An epoch cut short
(``max_steps``, ``limit_train_batches``, a crash after a checkpoint) is *continued*, not
restarted, by the next iteration or ``train_dataloader`` call, provided its trajectories are
still in the buffer; once they are gone (e.g. ``buffer.clear()``) a fresh epoch over the current
contents starts instead. An epoch nothing was drawn from yet takes the buffer's contents when its
loader starts iterating, so rows appended after Lightning built the loader (``on_train_start``,
``on_train_epoch_start``) are in it. (Lightning counts the epoch's batches when it builds the
loader; batches beyond that count are continued by the next iteration or fit, never lost.)

Evaluation: with ``eval_buffer=`` the data module also has ``val_dataloader``,
``test_dataloader`` and ``predict_dataloader``: the whole eval buffer in order, sharded per rank
like training. Evaluation never moves the training position.

Sharding: the sampler is a ``DistributedSampler`` that knows the data-parallel rank (from the
Trainer's strategy or ``torch.distributed``), so Lightning keeps it instead of injecting its own.
Rank ``r`` takes every ``world``-th index of the epoch's permutation, draws only those
trajectories and collates only its own batches, once per batch, in the DataLoader's
``collate_fn``. Shards are disjoint; with ``drop_last=False`` they are evened out with placeholder
trajectories (zero loss), never with repeated samples, so every rank runs the same number of
equally sized steps. With ``shard=False`` each rank draws its whole buffer instead: for buffers
that already hold only that rank's trajectories (filled per rank by ``RolloutCollector``, which
gives every rank the same number of them).

Resuming: a batch counts as consumed when it is moved to the device for a training step
(``transfer_batch_to_device`` while the trainer is training: never for validation, test,
predict or the sanity check), not when it is prefetched. (Iterating ``train_dataloader()`` by
hand, outside a Trainer, consumes nothing: such a loop restarts its epoch unless it runs to the
end.) ``state_dict`` stores the buffer, the
epoch, the consumed count and the snapshot's sequence-number range (plus the snapshot's
trajectories themselves if some were already evicted), so a run restored from a mid-epoch
checkpoint yields exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from r3lightning.align.layout import check_int
from r3lightning.data.batch import RolloutBatch
from r3lightning.data.buffer import ReplayBuffer, pack_trajectories, unpack_trajectories
from r3lightning.data.collate import RolloutCollator
from r3lightning.data.position import Cursor as _Cursor
from r3lightning.data.position import Plan as _Plan
from r3lightning.data.position import restore_position
from r3lightning.data.trajectory import Trajectory

__all__ = ["R3DataModule"]

_STATE_VERSION = 1


class _Snapshot(Dataset):
    """One epoch's trajectories; index -1 is a placeholder that evens out the shards."""

    def __init__(self, trajectories: tuple[Trajectory, ...]) -> None:
        self.trajectories = trajectories

    def __len__(self) -> int:
        return len(self.trajectories)

    def __getitem__(self, index: int) -> Trajectory | None:
        return None if index < 0 else self.trajectories[index]


class _EpochShardSampler(DistributedSampler):
    """This rank's indices for the cursor's epoch, starting after the consumed batches."""

    def __init__(
        self,
        dataset: _Snapshot,
        cursor: _Cursor,
        plan: _Plan,
        rank: int,
        refresh: Callable[[], tuple[Trajectory, ...] | None] | None = None,
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=plan.num_replicas,
            rank=rank,
            shuffle=plan.shuffle,
            seed=plan.seed,
            drop_last=plan.drop_last,
        )
        self.cursor, self.plan, self.refresh = cursor, plan, refresh
        self._size()

    def _size(self) -> None:
        count, world = len(self.dataset), self.plan.num_replicas  # type: ignore[arg-type]
        plan = self.plan
        self.per_rank = count // world if plan.drop_last else math.ceil(count / world)
        b = plan.batch_size
        self.num_batches = self.per_rank // b if plan.drop_last else math.ceil(self.per_rank / b)
        self.cursor.batches = self.num_batches

    def shard(self, epoch: int) -> list[int]:
        """This rank's full index list for ``epoch`` (-1 = placeholder)."""
        count, world = len(self.dataset), self.plan.num_replicas  # type: ignore[arg-type]
        if self.plan.shuffle:
            generator = torch.Generator().manual_seed(self.plan.seed + epoch)
            order = torch.randperm(count, generator=generator).tolist()
        else:
            order = list(range(count))
        total = self.per_rank * world
        order = order[:total] + [-1] * (total - count)
        mine = order[self.rank :: world]
        return mine[: self.num_batches * self.plan.batch_size]

    def __iter__(self):  # type: ignore[override]
        cursor = self.cursor
        if cursor.exhausted or (cursor.batches > 0 and cursor.consumed >= cursor.batches):
            # another epoch over the same snapshot (no reload in between)
            cursor.epoch, cursor.consumed, cursor.exhausted = cursor.epoch + 1, 0, False
        elif cursor.consumed == 0 and self.refresh is not None:
            # the epoch this loader was built for, nothing drawn yet: it covers what the buffer
            # holds now, rows appended after the loader was built included
            fresh = self.refresh()
            if fresh is not None:
                self.dataset.trajectories = fresh  # type: ignore[attr-defined]
                self._size()
        yield from self.shard(cursor.epoch)[cursor.consumed * self.plan.batch_size :]
        cursor.exhausted = True

    def __len__(self) -> int:
        # the full epoch, also when resuming: Lightning counts batches from the epoch start
        return min(self.per_rank, self.num_batches * self.plan.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the data module's own epoch counter drives the order (see module docs)."""


class _PositionedLoader(DataLoader):
    """DataLoader that reports its data position into Lightning's loop state.

    The position itself is restored by the data module's state (before the loader exists), so
    ``load_state_dict`` has nothing left to do; being stateful tells Lightning that a mid-epoch
    checkpoint resumes exactly.
    """

    def __init__(self, *args: Any, cursor: _Cursor, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cursor = cursor

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.cursor.epoch, "consumed": self.cursor.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Nothing to do: ``R3DataModule.load_state_dict`` already restored the position."""


class R3DataModule(pl.LightningDataModule):
    """LightningDataModule over a :class:`ReplayBuffer` yielding :class:`RolloutBatch` es.

    Args:
        buffer: the replay buffer to draw from (read at every ``train_dataloader`` call).
        batch_size: trajectories per batch on each data-parallel rank.
        shuffle: permute each epoch (seed ``seed + epoch``); else buffer order.
        seed: base shuffle seed.
        collate_threads: fill threads per collation; ``None`` =
            :func:`~r3lightning.data.cpus.collate_pool_size` (affinity and cgroup quota aware).
        pin_memory: collate into a pinned buffer pool; ``None`` = only when training on a CUDA
            device. The pool's buffers are handed back when a batch is moved to the GPU; with a
            CPU target nothing is moved, so forcing ``True`` there only costs pool misses.
        drop_last: drop each rank's last incomplete batch (and the tail that does not divide
            evenly among ranks) instead of evening shards out with placeholders.
        shard: split the buffers among the data-parallel ranks; ``False`` when every rank's
            buffers already hold only its own trajectories (per-rank rollout collection): each
            rank then reads its training and eval buffers whole.
        pad_token_id: id at ``input_ids`` padding positions and in placeholders.
        width_multiple: round each batch's padded width up to a multiple of this.
        eval_buffer: trajectories for ``val_dataloader`` / ``test_dataloader`` /
            ``predict_dataloader`` (read whole, in order, sharded like training with placeholders
            evening out the ranks); ``None`` = no evaluation data (those loaders are not defined).

    The settings other than the buffers are saved as ``hparams`` (and in checkpoints).
    """

    def __init__(
        self,
        buffer: ReplayBuffer,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        collate_threads: int | None = None,
        pin_memory: bool | None = None,
        drop_last: bool = False,
        pad_token_id: int = 0,
        width_multiple: int = 1,
        eval_buffer: ReplayBuffer | None = None,
        shard: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(buffer, ReplayBuffer):
            raise TypeError(f"buffer must be a ReplayBuffer, got {type(buffer).__name__}")
        if eval_buffer is not None and not isinstance(eval_buffer, ReplayBuffer):
            raise TypeError(f"eval_buffer must be a ReplayBuffer or None, got {type(eval_buffer).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        # checked here, not at the first train_dataloader, so a bad config fails at construction
        if collate_threads is not None:
            check_int("collate_threads", collate_threads)
        check_int("width_multiple", width_multiple)
        check_int("pad_token_id", pad_token_id, 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        for name, flag in (
            ("shuffle", shuffle),
            ("drop_last", drop_last),
            ("pin_memory", pin_memory),
            ("shard", shard),
        ):
            if not isinstance(flag, bool) and not (name == "pin_memory" and flag is None):
                expected = "a bool or None" if name == "pin_memory" else "a bool"
                raise ValueError(f"{name} must be {expected}, got {flag!r}")
        self.save_hyperparameters(ignore=["buffer", "eval_buffer"])
        self.buffer = buffer
        self.eval_buffer = eval_buffer
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.collate_threads = collate_threads
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.pad_token_id = pad_token_id
        self.width_multiple = width_multiple
        self.shard = shard
        self._cursor = _Cursor()
        self._plan: _Plan | None = None  # the plan of the epoch in progress
        self._snapshot: tuple[Trajectory, ...] | None = None
        self._snapshot_restored = False  # snapshot came with a checkpoint, not from the buffer
        self._collator: RolloutCollator | None = None
        if eval_buffer is not None:
            # defined only with evaluation data, so Lightning sees no validation loop (and warns
            # about none) for modules trained without it
            self.val_dataloader = self.test_dataloader = self.predict_dataloader = self._eval_dataloader  # type: ignore[method-assign]

    # ------------------------------------------------------------------------ introspection

    @property
    def epoch(self) -> int:
        """Data epoch counter (-1 before the first ``train_dataloader``)."""
        return self._cursor.epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch already moved to the device for training."""
        return self._cursor.consumed

    # ------------------------------------------------------------------------ Lightning hooks

    def setup(self, stage: str) -> None:
        """Nothing to prepare: the buffer is filled by the caller, and read per dataloader."""

    def _data_parallel(self) -> tuple[int, int]:
        """(data-parallel size, rank) from the Trainer's strategy, else ``torch.distributed``;
        (1, 0) when the buffer is this rank's own (``shard=False``)."""
        if not self.shard:
            return 1, 0
        trainer = self.trainer
        if trainer is not None:
            kwargs = trainer.distributed_sampler_kwargs
            if kwargs:
                return int(kwargs["num_replicas"]), int(kwargs["rank"])
            return 1, 0
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    def _should_pin(self) -> bool:
        if self.pin_memory is not None:
            return self.pin_memory
        if not torch.cuda.is_available():
            return False
        trainer = self.trainer
        return trainer is None or trainer.strategy.root_device.type == "cuda"

    def _get_collator(self) -> RolloutCollator:
        pin = self._should_pin()
        if self._collator is None or self._collator.pin_memory != pin:
            if self._collator is not None:
                self._collator.close()
            self._collator = RolloutCollator(
                num_threads=self.collate_threads,
                pad_token_id=self.pad_token_id,
                width_multiple=self.width_multiple,
                num_experts=self.buffer.num_experts,
                pin_memory=pin,
            )
        return self._collator

    def train_dataloader(self) -> DataLoader:
        """This rank's loader over the current epoch's snapshot (see module docs for when a
        snapshot is continued and when a new one is taken). O(len(buffer)) to snapshot."""
        world, rank = self._data_parallel()
        plan = _Plan(self.batch_size, self.shuffle, self.seed, self.drop_last, world)
        cursor = self._cursor
        snapshot = None
        available = self._snapshot_restored or self.buffer.covers(cursor.start, cursor.stop)
        if cursor.in_progress and available:
            snapshot = self._snapshot or self.buffer.window(cursor.start, cursor.stop)
            if self._plan is not None and self._plan != plan:
                changed = {
                    k: (v, getattr(plan, k)) for k, v in asdict(self._plan).items() if getattr(plan, k) != v
                }
                raise ValueError(
                    f"cannot continue epoch {cursor.epoch} mid-way with changed settings "
                    f"(saved, now): {changed}; restore the original settings"
                )
        if snapshot is None:
            cursor.start, cursor.stop = self.buffer.start, self.buffer.stop
            snapshot = self.buffer.window(cursor.start, cursor.stop)
            if cursor.epoch < 0 or cursor.consumed > 0 or cursor.exhausted:
                cursor.epoch += 1  # an epoch nothing was drawn from keeps its number
            cursor.consumed, cursor.exhausted = 0, False
            self._snapshot_restored = False
        self._snapshot, self._plan = snapshot, plan
        sampler = _EpochShardSampler(_Snapshot(snapshot), cursor, plan, rank, refresh=self._fresh_snapshot)
        return _PositionedLoader(
            sampler.dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=self._get_collator(),
            num_workers=0,  # collation is already threaded; pinned pools live in this process
            cursor=cursor,
        )

    def _fresh_snapshot(self) -> tuple[Trajectory, ...] | None:
        """The buffer's current contents as the snapshot of an epoch nothing was drawn from yet,
        or ``None`` when the buffer still holds exactly the current snapshot."""
        cursor = self._cursor
        start, stop = self.buffer.start, self.buffer.stop
        if not self._snapshot_restored and (start, stop) == (cursor.start, cursor.stop):
            return None
        cursor.start, cursor.stop = start, stop
        self._snapshot, self._snapshot_restored = self.buffer.window(start, stop), False
        return self._snapshot

    def _eval_dataloader(self) -> DataLoader:
        """This rank's loader over the whole ``eval_buffer`` in order (``val_dataloader``,
        ``test_dataloader`` and ``predict_dataloader`` when an ``eval_buffer`` is given)."""
        assert self.eval_buffer is not None
        world, rank = self._data_parallel()
        plan = _Plan(self.batch_size, False, self.seed, False, world)
        snapshot = _Snapshot(self.eval_buffer.window(self.eval_buffer.start, self.eval_buffer.stop))
        sampler = _EpochShardSampler(snapshot, _Cursor(), plan, rank)  # its own cursor: no resume state
        return DataLoader(
            snapshot,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=self._get_collator(),
            num_workers=0,
        )

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a ``RolloutBatch`` (every field and the packed routes) to ``device``.

        From pinned memory to a CUDA device the copies are ``non_blocking`` and the pooled host
        buffers are handed back behind an event recorded after them; otherwise a plain ``.to``
        (a pooled batch already on ``device``, i.e. a forced pool on the CPU, is copied out of the
        pool so its buffers go back).
        Anything else (e.g. the model summary's example input) takes Lightning's default path.
        During training, each batch moved here counts as consumed for resuming.
        """
        if not isinstance(batch, RolloutBatch):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        device = torch.device(device)
        non_blocking = device.type == "cuda" and batch.is_pinned()
        moved = batch.to(device, non_blocking=non_blocking)
        if moved is batch and batch._lease is not None:
            # pooled buffers trained on in place would never be handed back: copy out, as to a GPU
            moved = copy.deepcopy(batch)
        if moved is not batch:
            fence = None
            if non_blocking:
                fence = torch.cuda.Event()
                fence.record(torch.cuda.current_stream(device))
            batch.release(after=fence)
        trainer = self.trainer
        # only training batches advance the resume position (not validation inside fit, nor
        # validate / test / predict, nor the sanity check)
        if trainer is not None and trainer.state.stage == RunningStage.TRAINING:
            self._cursor.consumed += 1
        return moved

    def teardown(self, stage: str) -> None:
        if self._collator is not None:
            self._collator.close()

    # ------------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Buffer contents, data epoch, consumed batches and the epoch's snapshot range (plus its
        trajectories when some left the buffer). Tensors and ints only (``weights_only`` safe);
        packs every stored trajectory once."""
        cursor = self._cursor
        snapshot = None
        if (
            cursor.in_progress
            and self._snapshot is not None
            and (self._snapshot_restored or not self.buffer.covers(cursor.start, cursor.stop))
        ):
            snapshot = pack_trajectories(self._snapshot)
        return {
            "version": _STATE_VERSION,
            "buffer": self.buffer.state_dict(),
            "cursor": asdict(cursor),
            "plan": None if self._plan is None else asdict(self._plan),
            "snapshot": snapshot,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the buffer (in place) and the position; the next ``train_dataloader``
        continues the saved epoch after its consumed batches."""
        where = "R3DataModule state"
        if not isinstance(state, dict):
            raise ValueError(f"{where} must be a dict, got {type(state).__name__}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"{where} version {state.get('version')!r} is not {_STATE_VERSION}")
        if missing := [key for key in ("buffer", "cursor", "plan", "snapshot") if key not in state]:
            raise ValueError(f"{where} lacks {missing}")
        # everything is checked before anything changes: a bad state leaves buffer and position
        cursor, plan = restore_position(state["cursor"], state["plan"], where)
        snapshot = None
        if state["snapshot"] is not None:
            snapshot = tuple(unpack_trajectories(state["snapshot"], where=f"{where} snapshot"))
            if len(snapshot) != cursor.stop - cursor.start:
                raise ValueError(
                    f"{where} snapshot holds {len(snapshot)} trajectories, not the "
                    f"cursor.stop - cursor.start = {cursor.stop - cursor.start} of its range"
                )
        self.buffer.load_state_dict(state["buffer"])  # validates before it changes anything
        self._cursor, self._plan = cursor, plan
        self._snapshot, self._snapshot_restored = snapshot, snapshot is not None
