"""``R3DataModule``: replay buffer -> sharded, threaded, pinned ``RolloutBatch`` es for Lightning.

An epoch is one pass over a *snapshot* of the buffer, taken at each ``train_dataloader`` call
(every ``trainer.fit``, or every epoch with ``reload_dataloaders_every_n_epochs=1``) or, for an
epoch nothing was drawn from yet, when its loader starts iterating. The module's own epoch counter
(shuffle seed ``seed + epoch``) advances when a new snapshot follows an epoch that was drawn from,
or a loader is iterated again. Rank ``r`` takes every ``world``-th index of the epoch's order.

A batch is consumed when ``transfer_batch_to_device`` moves it for a training step (not for
evaluation, the sanity check or a prefetch). An epoch cut short is continued while its
trajectories are still in the buffer or in the restored ``state_dict``, so a run restored
mid-epoch yields exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader

from r3lightning._keywords import refuse_moved_keywords
from r3lightning.checks import check_fields, check_int
from r3lightning.data import position
from r3lightning.data.batch import RolloutBatch
from r3lightning.data.buffer import ReplayBuffer, check_state, pack_trajectories, unpack_trajectories
from r3lightning.data.collate import RolloutCollator
from r3lightning.data.options import DataOptions
from r3lightning.data.stream import StreamingReplayBuffer
from r3lightning.rollout.trajectory import Trajectory

__all__ = ["DataOptions", "R3DataModule"]

_STATE_VERSION = 1


# 0.1 keywords -> DataOptions' fields in 0.2
_OPTIONS_MOVED = {
    name: f"options=DataOptions({name}=) (r3lightning.data.datamodule)"
    for name in ("pad_token_id", "width_multiple", "shard", "eval_buffer")
}


class R3DataModule(pl.LightningDataModule):
    """LightningDataModule over a [`ReplayBuffer`][r3lightning.data.buffer.ReplayBuffer] yielding [`RolloutBatch`][r3lightning.data.batch.RolloutBatch] es; the
    settings other than the buffers are saved as ``hparams``.

    Args:
        buffer: the replay buffer, read at every ``train_dataloader`` call. A
            `StreamingReplayBuffer` streams one RL step per epoch:
            a new epoch waits for its step, filled by a producer thread while earlier ones train.
        batch_size: trajectories per batch on each data-parallel rank.
        shuffle, seed: permute each epoch with seed ``seed + epoch``; else buffer order.
        collate_threads: fill threads per collation; ``None``: ``cpus.collate_pool_size()``.
        pin_memory: collate into a pinned buffer pool; ``None``: when training on a CUDA device.
        drop_last: drop each rank's incomplete last batch instead of adding zero-loss placeholders.
        options: [`DataOptions`][r3lightning.data.options.DataOptions].

    Raises:
        TypeError: ``buffer`` is not a ``ReplayBuffer``, ``options`` not a ``DataOptions``, or a
            keyword of 0.1 (named with its replacement).
        ValueError: A bad ``batch_size``, ``shuffle``, ``seed``, ``drop_last``,
            ``collate_threads`` or ``pin_memory`` (the message names it).
    """

    @refuse_moved_keywords(_OPTIONS_MOVED)
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
        options: DataOptions | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(buffer, ReplayBuffer):
            raise TypeError(f"buffer must be a ReplayBuffer, got {type(buffer).__name__}")
        options = options or DataOptions()
        if not isinstance(options, DataOptions):
            raise TypeError(f"options must be a DataOptions or None, got {type(options).__name__}")
        # checked here, not at the first train_dataloader, so a bad config fails at construction
        plan = dict(batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, num_replicas=1)
        check_fields(plan, position.PLAN_FIELDS)
        if collate_threads is not None:
            check_int("collate_threads", collate_threads)
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise ValueError(f"pin_memory must be a bool or None, got {pin_memory!r}")
        self.save_hyperparameters(ignore=["buffer", "options"])
        self.save_hyperparameters({k: v for k, v in vars(options).items() if k != "eval_buffer"})
        self.buffer = buffer
        self.eval_buffer = options.eval_buffer
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.options = options
        self.collate_threads = collate_threads
        self.pin_memory = pin_memory
        self.shard = options.shard
        self._cursor = position.Cursor()
        self._plan: position.Plan | None = None  # the plan of the epoch in progress
        self._snapshot: tuple[Trajectory, ...] | None = None
        self._snapshot_restored = False  # snapshot came with a checkpoint, not from the buffer
        self._collator: RolloutCollator | None = None
        if self.eval_buffer is not None:
            # only with evaluation data, so Lightning sees (and warns about) no validation loop; bound
            # per instance, hence setattr (type checkers refuse assigning to a method)
            for hook in ("val_dataloader", "test_dataloader", "predict_dataloader"):
                setattr(self, hook, self._eval_dataloader)

    @property
    def epoch(self) -> int:
        """Data epoch counter (-1 before the first ``train_dataloader``)."""
        return self._cursor.epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch already moved to the device for training."""
        return self._cursor.consumed

    def _data_parallel(self) -> tuple[int, int]:
        """(size, rank) from the Trainer's strategy, else ``torch.distributed``; (1, 0) unsharded."""
        if not self.shard:
            return 1, 0
        if self.trainer is not None:
            kwargs = self.trainer.distributed_sampler_kwargs
            return (int(kwargs["num_replicas"]), int(kwargs["rank"])) if kwargs else (1, 0)
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    def _get_collator(self) -> RolloutCollator:
        pin = self.pin_memory
        if pin is None:
            on_cuda = self.trainer is None or self.trainer.strategy.root_device.type == "cuda"
            pin = torch.cuda.is_available() and on_cuda
        if self._collator is None or self._collator.pin_memory != pin:
            if self._collator is not None:
                self._collator.close()
            o = self.options
            self._collator = RolloutCollator(
                num_threads=self.collate_threads,
                num_experts=self.buffer.num_experts,
                pin_memory=pin,
                layers=o.layers,
                pad_token_id=o.pad_token_id,
                width_multiple=o.width_multiple,
            )
        return self._collator

    def train_dataloader(self) -> DataLoader:
        """This rank's loader over the epoch's snapshot (continued or new). O(len(buffer))."""
        world, rank = self._data_parallel()
        plan = position.Plan(self.batch_size, self.shuffle, self.seed, self.drop_last, world)
        cursor = self._cursor
        snapshot = None
        available = self._snapshot_restored or self.buffer.covers(cursor.start, cursor.stop)
        if cursor.in_progress and available:
            snapshot = self._snapshot or self.buffer.window(cursor.start, cursor.stop)
            if self._plan is not None and self._plan != plan:
                now = asdict(plan)
                changed = {k: (v, now[k]) for k, v in asdict(self._plan).items() if v != now[k]}
                raise ValueError(
                    f"cannot continue epoch {cursor.epoch} mid-way with changed settings "
                    f"(saved, now): {changed}; restore the original settings"
                )
        if snapshot is None:
            new_epoch = cursor.epoch < 0 or cursor.consumed > 0 or cursor.exhausted
            if new_epoch and isinstance(self.buffer, StreamingReplayBuffer):  # one RL step per epoch
                self._check_reload()
                self.buffer.advance()  # waits for the step
            cursor.start = self.buffer.start
            cursor.stop = self.buffer.stop
            snapshot = tuple(self.buffer)
            if new_epoch:
                cursor.epoch += 1  # an epoch nothing was drawn from keeps its number (and its step)
            cursor.consumed = 0
            cursor.exhausted = False
            self._snapshot_restored = False
        self._snapshot = snapshot
        self._plan = plan
        sampler = position.EpochShardSampler(
            position.Snapshot(snapshot), cursor, plan, rank, refresh=self._fresh_snapshot
        )
        # num_workers=0: collation is already threaded, and pinned pools live in this process
        collate = self._get_collator()
        return position.PositionedLoader(
            sampler.dataset, batch_size=self.batch_size, sampler=sampler, collate_fn=collate, cursor=cursor
        )

    def _check_reload(self) -> None:
        every = None if self.trainer is None else self.trainer.reload_dataloaders_every_n_epochs
        if every not in (None, 1):
            raise ValueError(
                "a StreamingReplayBuffer holds one RL step per epoch: the Trainer must reload the data "
                f"every epoch (reload_dataloaders_every_n_epochs=1), got {every}"
            )

    def _fresh_snapshot(self) -> tuple[Trajectory, ...] | None:
        """The buffer's contents as a new snapshot, ``None`` when they are the current one (or a
        stream's: its next step comes with the next ``train_dataloader``)."""
        if isinstance(self.buffer, StreamingReplayBuffer):
            return None
        cursor = self._cursor
        start = self.buffer.start
        stop = self.buffer.stop
        if not self._snapshot_restored and (start, stop) == (cursor.start, cursor.stop):
            return None
        cursor.start = start
        cursor.stop = stop
        self._snapshot = self.buffer.window(start, stop)
        self._snapshot_restored = False
        return self._snapshot

    def _eval_dataloader(self) -> DataLoader:
        """This rank's loader over the whole ``eval_buffer`` in order (val / test / predict)."""
        assert self.eval_buffer is not None
        world, rank = self._data_parallel()
        plan = position.Plan(self.batch_size, False, self.seed, False, world)
        snapshot = position.Snapshot(tuple(self.eval_buffer))
        sampler = position.EpochShardSampler(snapshot, position.Cursor(), plan, rank)  # no resume state
        collate = self._get_collator()
        return DataLoader(snapshot, batch_size=self.batch_size, sampler=sampler, collate_fn=collate)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a ``RolloutBatch`` (``non_blocking`` from pinned memory) and hand its pooled buffers
        back behind an event recorded after the copies; a training batch moved here is consumed."""
        if not isinstance(batch, RolloutBatch):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        device = torch.device(device)
        non_blocking = device.type == "cuda" and batch.is_pinned()
        moved = batch.to(device, non_blocking=non_blocking)
        if moved is batch and batch._lease is not None:
            moved = copy.deepcopy(batch)  # pooled buffers trained on in place would never go back
        if moved is not batch:
            fence = None
            if non_blocking:
                fence = torch.cuda.Event()
                fence.record(torch.cuda.current_stream(device))
            batch.release(after=fence)
        # only training batches advance the resume position (not validation, test, predict, sanity)
        if self.trainer is not None and self.trainer.state.stage == RunningStage.TRAINING:
            self._cursor.consumed += 1
        return moved

    def teardown(self, stage: str) -> None:
        if self._collator is not None:
            self._collator.close()

    def state_dict(self) -> dict[str, Any]:
        """Buffer, position and (when some left the buffer) the snapshot; ``weights_only`` safe."""
        cursor = self._cursor
        snapshot = self._snapshot
        gone = self._snapshot_restored or not self.buffer.covers(cursor.start, cursor.stop)
        packed = pack_trajectories(snapshot) if cursor.in_progress and snapshot and gone else None
        return {
            "version": _STATE_VERSION,
            "buffer": self.buffer.state_dict(),
            "cursor": asdict(cursor),
            "plan": None if self._plan is None else asdict(self._plan),
            "snapshot": packed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the buffer (in place) and the position, checked first: a bad state changes nothing."""
        where = "R3DataModule state"
        check_state(state, ("buffer", "cursor", "plan", "snapshot"), where, version=_STATE_VERSION)
        cursor, plan = position.restore_position(state["cursor"], state["plan"], where)
        snapshot = None
        if state["snapshot"] is not None:
            snapshot = tuple(unpack_trajectories(state["snapshot"], where=f"{where} snapshot"))
            if len(snapshot) != cursor.stop - cursor.start:
                raise ValueError(
                    f"{where} snapshot holds {len(snapshot)} trajectories, not the "
                    f"cursor.stop - cursor.start = {cursor.stop - cursor.start} of its range"
                )
        self.buffer.load_state_dict(state["buffer"])  # validates before it changes anything
        self._cursor = cursor
        self._plan = plan
        self._snapshot = snapshot
        self._snapshot_restored = snapshot is not None
