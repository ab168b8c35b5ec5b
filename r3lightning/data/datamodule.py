"""``R3DataModule``: replay buffer -> sharded, threaded, pinned ``RolloutBatch`` es for Lightning.

Epochs: the buffer changes between RL steps, so an epoch is one pass over a *snapshot*, taken at
each :meth:`R3DataModule.train_dataloader` call (every ``trainer.fit``, or every epoch with
``reload_dataloaders_every_n_epochs=1`` and rollouts collected in ``on_train_epoch_end``). The
module keeps its own epoch counter (shuffle seed ``seed + epoch``; Lightning's ``set_epoch`` is
ignored), advanced when a new snapshot is taken after an epoch was drawn from, or when a loader is
iterated again after its epoch. An epoch cut short (``max_steps``, ``limit_train_batches``, a
crash) is *continued* by the next iteration or ``train_dataloader`` while its trajectories are
still in the buffer, else a fresh epoch starts. An epoch nothing was drawn from takes the buffer's
contents when its loader starts iterating (rows added in ``on_train_start`` are in it).

Evaluation (``DataOptions(eval_buffer=)``): ``val_dataloader`` / ``test_dataloader`` / ``predict_dataloader``
read the whole eval buffer in order, sharded per rank; they never move the training position.

Sharding: rank ``r`` takes every ``world``-th index of the epoch's permutation (world and rank
from the Trainer's strategy or ``torch.distributed``) and collates only its own batches. Shards
are disjoint; with ``drop_last=False`` they are evened out with zero-loss placeholders, never
repeated samples. ``DataOptions(shard=False)``: each rank reads its buffer whole (per-rank collection).

Routes of a rank that holds some decoder layers (``DataOptions(layers=...)``, e.g. a pipeline
stage's ``backend.moe_layers``): batches carry only those columns and their ids
(``RolloutBatch.route_layers``), so host-to-device route bytes are ``layers held / num_layers``
of the full routes'.

Resuming: a batch is consumed when ``transfer_batch_to_device`` moves it for a training step
(not for validation, test, predict, the sanity check, nor a prefetch; a hand-iterated loader
consumes nothing). ``state_dict`` stores the buffer, the epoch, the consumed count and the
snapshot's sequence range (plus its trajectories if some were evicted), so a run restored from a
mid-epoch checkpoint yields exactly the batches an uninterrupted run would have.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader

from r3lightning.align.layout import check_int
from r3lightning.data.batch import RolloutBatch
from r3lightning.data.buffer import ReplayBuffer, pack_trajectories, unpack_trajectories
from r3lightning.data.collate import RolloutCollator
from r3lightning.data.position import Cursor as _Cursor
from r3lightning.data.position import EpochShardSampler as _EpochShardSampler
from r3lightning.data.position import Plan as _Plan
from r3lightning.data.position import PositionedLoader, restore_position
from r3lightning.data.position import Snapshot as _Snapshot
from r3lightning.data.trajectory import Trajectory
from r3lightning.routes import check_layers

__all__ = ["DataOptions", "R3DataModule"]

_STATE_VERSION = 1


@dataclass(frozen=True)
class DataOptions:
    """The less common settings of an :class:`R3DataModule` (the data config's ``options``).

    Args:
        pad_token_id: id at ``input_ids`` padding positions and in placeholders.
        width_multiple: round each batch's padded width up to a multiple of this.
        shard: split the buffers among data-parallel ranks; ``False`` when each rank's buffers
            hold only its own trajectories (per-rank rollout collection).
        layers: the absolute decoder layers this rank's model holds (e.g. ``backend.moe_layers``
            of its pipeline stage); batches keep only their route columns
            (:class:`~r3lightning.data.collate.RolloutCollator`). ``None``: routes as they come.
        eval_buffer: trajectories for the val / test / predict loaders (whole, in order, sharded
            like training); ``None`` = those loaders are not defined.
    """

    pad_token_id: int = 0
    width_multiple: int = 1
    shard: bool = True
    layers: Sequence[int] | None = None
    eval_buffer: ReplayBuffer | None = None

    def __post_init__(self) -> None:
        check_int("width_multiple", self.width_multiple)
        check_int("pad_token_id", self.pad_token_id, 0)
        if not isinstance(self.shard, bool):
            raise ValueError(f"shard must be a bool, got {self.shard!r}")
        object.__setattr__(self, "layers", check_layers("layers", self.layers))
        if self.eval_buffer is not None and not isinstance(self.eval_buffer, ReplayBuffer):
            raise TypeError(
                f"eval_buffer must be a ReplayBuffer or None, got {type(self.eval_buffer).__name__}"
            )


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
            device. Pooled buffers go back when a batch is moved to the GPU; with a CPU target
            forcing ``True`` only costs pool misses.
        drop_last: drop each rank's last incomplete batch (and the tail that does not divide
            among ranks) instead of evening shards out with placeholders.
        options: :class:`DataOptions` (padding, sharding, route layers, evaluation data).

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
        options: DataOptions | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(buffer, ReplayBuffer):
            raise TypeError(f"buffer must be a ReplayBuffer, got {type(buffer).__name__}")
        if not isinstance(options := options or DataOptions(), DataOptions):
            raise TypeError(f"options must be a DataOptions or None, got {type(options).__name__}")
        check_int("batch_size", batch_size)
        # checked here, not at the first train_dataloader, so a bad config fails at construction
        if collate_threads is not None:
            check_int("collate_threads", collate_threads)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        for name, flag in {"shuffle": shuffle, "drop_last": drop_last, "pin_memory": pin_memory}.items():
            if not isinstance(flag, bool) and not (name == "pin_memory" and flag is None):
                raise ValueError(f"{name} must be a bool{' or None' * (name == 'pin_memory')}, got {flag!r}")
        self.save_hyperparameters(ignore=["buffer", "options"])
        self.save_hyperparameters({k: v for k, v in vars(options).items() if k != "eval_buffer"})
        self.buffer, self.eval_buffer, self.batch_size = buffer, options.eval_buffer, batch_size
        self.shuffle, self.seed, self.drop_last, self.options = shuffle, seed, drop_last, options
        self.collate_threads, self.pin_memory, self.shard = collate_threads, pin_memory, options.shard
        self._cursor = _Cursor()
        self._plan: _Plan | None = None  # the plan of the epoch in progress
        self._snapshot: tuple[Trajectory, ...] | None = None
        self._snapshot_restored = False  # snapshot came with a checkpoint, not from the buffer
        self._collator: RolloutCollator | None = None
        if self.eval_buffer is not None:
            # only with evaluation data, so Lightning sees (and warns about) no validation loop
            self.val_dataloader = self.test_dataloader = self.predict_dataloader = self._eval_dataloader  # type: ignore[method-assign]

    @property
    def epoch(self) -> int:
        """Data epoch counter (-1 before the first ``train_dataloader``)."""
        return self._cursor.epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch already moved to the device for training."""
        return self._cursor.consumed

    def setup(self, stage: str) -> None:
        """Nothing to prepare: the buffer is filled by the caller, and read per dataloader."""

    def _data_parallel(self) -> tuple[int, int]:
        """(data-parallel size, rank) from the Trainer's strategy, else ``torch.distributed``;
        (1, 0) when the buffer is this rank's own (``shard=False``)."""
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
            self._collator = RolloutCollator(num_threads=self.collate_threads, num_experts=self.buffer.num_experts,
                                             pin_memory=pin, layers=o.layers, pad_token_id=o.pad_token_id,
                                             width_multiple=o.width_multiple)  # fmt: skip
        return self._collator

    def train_dataloader(self) -> DataLoader:
        """This rank's loader over the current epoch's snapshot (continued or new: see module
        docs). O(len(buffer)) to snapshot."""
        world, rank = self._data_parallel()
        plan = _Plan(self.batch_size, self.shuffle, self.seed, self.drop_last, world)
        cursor, snapshot = self._cursor, None
        available = self._snapshot_restored or self.buffer.covers(cursor.start, cursor.stop)
        if cursor.in_progress and available:
            snapshot = self._snapshot or self.buffer.window(cursor.start, cursor.stop)
            if self._plan is not None and self._plan != plan:
                old = asdict(self._plan)
                changed = {k: (v, getattr(plan, k)) for k, v in old.items() if getattr(plan, k) != v}
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
        # num_workers=0: collation is already threaded, and pinned pools live in this process
        return PositionedLoader(
            sampler.dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=self._get_collator(),
            cursor=cursor,
        )

    def _fresh_snapshot(self) -> tuple[Trajectory, ...] | None:
        """The buffer's contents as the snapshot of an epoch nothing was drawn from yet, or
        ``None`` when the buffer still holds exactly the current snapshot."""
        cursor, (start, stop) = self._cursor, (self.buffer.start, self.buffer.stop)
        if not self._snapshot_restored and (start, stop) == (cursor.start, cursor.stop):
            return None
        cursor.start, cursor.stop = start, stop
        self._snapshot, self._snapshot_restored = self.buffer.window(start, stop), False
        return self._snapshot

    def _eval_dataloader(self) -> DataLoader:
        """This rank's loader over the whole ``eval_buffer`` in order (val / test / predict)."""
        assert self.eval_buffer is not None
        world, rank = self._data_parallel()
        plan = _Plan(self.batch_size, False, self.seed, False, world)
        snapshot = _Snapshot(self.eval_buffer.window(self.eval_buffer.start, self.eval_buffer.stop))
        sampler = _EpochShardSampler(snapshot, _Cursor(), plan, rank)  # its own cursor: no resume state
        return DataLoader(
            snapshot, batch_size=self.batch_size, sampler=sampler, collate_fn=self._get_collator()
        )

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a ``RolloutBatch`` (every field and the packed routes) to ``device``.

        From pinned memory to CUDA the copies are ``non_blocking`` and the pooled host buffers go
        back behind an event recorded after them; otherwise a plain ``.to`` (a pooled batch
        already on ``device`` is copied out of the pool so its buffers go back). Anything else
        takes Lightning's default path. During training each batch moved here is consumed.
        """
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
        """Buffer contents, data epoch, consumed batches and the epoch's snapshot range (plus its
        trajectories when some left the buffer). Tensors and ints only (``weights_only`` safe);
        packs every stored trajectory once."""
        cursor, snapshot = self._cursor, None
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
        continues the saved epoch after its consumed batches. Checks everything first: a bad
        state leaves buffer and position unchanged."""
        where = "R3DataModule state"
        if not isinstance(state, dict):
            raise ValueError(f"{where} must be a dict, got {type(state).__name__}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"{where} version {state.get('version')!r} is not {_STATE_VERSION}")
        if missing := [key for key in ("buffer", "cursor", "plan", "snapshot") if key not in state]:
            raise ValueError(f"{where} lacks {missing}")
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
