"""Where an ``R3DataModule`` is in its data: the cursor and plan of the epoch in progress (saved as
plain dicts), and the sampler and loader that walk and report them."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from r3lightning.checks import check_fields
from r3lightning.rollout.trajectory import Trajectory

__all__ = ["Cursor", "EpochShardSampler", "Plan", "PositionedLoader", "Snapshot", "restore_position"]


@dataclass
class Cursor:
    """Where this rank is in the data: shared by the data module and its sampler."""

    epoch: int = -1  # -1 = no epoch started yet
    consumed: int = 0  # batches trained in the epoch
    batches: int = 0  # this rank's batches in the epoch
    exhausted: bool = False  # an iterator has yielded the whole epoch
    start: int = 0  # snapshot = buffer sequence numbers [start, stop)
    stop: int = 0

    @property
    def in_progress(self) -> bool:
        return self.epoch >= 0 and not self.exhausted and 0 < self.consumed < self.batches


@dataclass(frozen=True)
class Plan:
    """Settings that decide the epoch's batches; a mid-epoch resume needs them unchanged."""

    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    num_replicas: int


# field -> (type, lower bound of an int field or None)
CURSOR_FIELDS = {
    "epoch": (int, -1),
    "consumed": (int, 0),
    "batches": (int, 0),
    "exhausted": (bool, None),
    "start": (int, 0),
    "stop": (int, 0),
}
PLAN_FIELDS = {
    "batch_size": (int, 1),
    "shuffle": (bool, None),
    "seed": (int, None),
    "drop_last": (bool, None),
    "num_replicas": (int, 1),
}


def restore_position(cursor: Any, plan: Any, where: str) -> tuple[Cursor, Plan | None]:
    """The saved cursor and plan dicts as objects, every field checked.

    Args:
        cursor: The saved `Cursor` fields.
        plan: The saved `Plan` fields, or None.
        where: Names the state in errors.

    Returns:
        ``(cursor, plan or None)``.

    Raises:
        ValueError: A missing or malformed field, ``consumed > batches`` or ``start > stop``.
    """
    c = Cursor(**check_fields(cursor, CURSOR_FIELDS, f"{where} cursor"))
    if c.consumed > c.batches:
        raise ValueError(
            f"{where} cursor.consumed = {c.consumed} is past the epoch's cursor.batches = {c.batches}"
        )
    if c.start > c.stop:
        raise ValueError(f"{where} cursor.start = {c.start} is after cursor.stop = {c.stop}")
    return c, None if plan is None else Plan(**check_fields(plan, PLAN_FIELDS, f"{where} plan"))


class Snapshot(Dataset):
    """One epoch's trajectories; index -1 is a placeholder that evens out the shards.

    Args:
        trajectories: The epoch's trajectories.
    """

    def __init__(self, trajectories: tuple[Trajectory, ...]) -> None:
        self.trajectories = trajectories

    def __len__(self) -> int:
        return len(self.trajectories)

    def __getitem__(self, index: int) -> Trajectory | None:
        return None if index < 0 else self.trajectories[index]


class EpochShardSampler(DistributedSampler):
    """This rank's indices for the cursor's epoch (not Lightning's ``set_epoch``) after its consumed
    batches; shard ``r`` takes every ``num_replicas``-th index of the epoch's order.

    Args:
        dataset: The epoch's snapshot.
        cursor: The data module's cursor, shared.
        plan: The epoch's plan.
        rank: This rank's index.
        refresh: Renews an epoch nothing was drawn from (returns None: unchanged).
    """

    def __init__(
        self,
        dataset: Snapshot,
        cursor: Cursor,
        plan: Plan,
        rank: int,
        refresh: Callable[[], tuple[Trajectory, ...] | None] | None = None,
    ) -> None:
        super().__init__(dataset, plan.num_replicas, rank, plan.shuffle, plan.seed, plan.drop_last)
        self.snapshot = dataset  # ``self.dataset`` as its own type: a refresh swaps its trajectories
        self.cursor = cursor
        self.plan = plan
        self.refresh = refresh
        self._size()

    def _size(self) -> None:
        divide = operator.floordiv if self.plan.drop_last else lambda a, b: -(-a // b)  # else round up
        self.per_rank = divide(len(self.snapshot), self.plan.num_replicas)
        self.num_batches = self.cursor.batches = divide(self.per_rank, self.plan.batch_size)

    def shard(self, epoch: int) -> list[int]:
        """This rank's full index list of an epoch (-1: a placeholder).

        Args:
            epoch: Seeds the shuffle with ``plan.seed + epoch``.
        """
        count = len(self.snapshot)
        world = self.plan.num_replicas
        generator = torch.Generator().manual_seed(self.plan.seed + epoch)
        order = torch.randperm(count, generator=generator) if self.plan.shuffle else torch.arange(count)
        total = self.per_rank * world
        mine = (order.tolist()[:total] + [-1] * (total - count))[self.rank :: world]
        return mine[: self.num_batches * self.plan.batch_size]

    def __iter__(self) -> Iterator[int]:
        cursor = self.cursor
        if cursor.exhausted or (cursor.batches > 0 and cursor.consumed >= cursor.batches):
            # another epoch over the same snapshot (no reload in between)
            cursor.epoch = cursor.epoch + 1
            cursor.consumed = 0
            cursor.exhausted = False
        elif cursor.consumed == 0 and self.refresh is not None:
            # nothing drawn yet: the epoch covers what the buffer holds now, later rows included
            fresh = self.refresh()
            if fresh is not None:
                self.snapshot.trajectories = fresh
                self._size()
        yield from self.shard(cursor.epoch)[cursor.consumed * self.plan.batch_size :]
        cursor.exhausted = True

    def __len__(self) -> int:
        # the full epoch, also when resuming: Lightning counts batches from the epoch start
        return min(self.per_rank, self.num_batches * self.plan.batch_size)


class PositionedLoader(DataLoader):
    """A DataLoader whose state tells Lightning that a mid-epoch checkpoint resumes exactly.

    Args:
        *args, **kwargs: As for ``DataLoader``.
        cursor: The data module's cursor, read by ``state_dict``.
    """

    def __init__(self, *args: Any, cursor: Cursor, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cursor = cursor

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.cursor.epoch, "consumed": self.cursor.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Nothing to do: ``R3DataModule.load_state_dict`` already restored the position."""
