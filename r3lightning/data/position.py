"""Where an ``R3DataModule`` is in its data: the cursor and the plan of the epoch in progress.

Both are saved in the data module's ``state_dict`` as plain dicts and checked field by field
when a state is restored, before anything changes (:func:`restore_position`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Cursor", "Plan", "restore_position"]


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


# field -> (expected type, lower bound or None)
_CURSOR = {"epoch": (int, -1), "consumed": (int, 0), "batches": (int, 0), "exhausted": (bool, None),
           "start": (int, 0), "stop": (int, 0)}  # fmt: skip
_PLAN = {"batch_size": (int, 1), "shuffle": (bool, None), "seed": (int, None), "drop_last": (bool, None),
         "num_replicas": (int, 1)}  # fmt: skip


def _fields(state: Any, rules: dict[str, tuple[type, int | None]], where: str) -> dict[str, Any]:
    if not isinstance(state, dict) or set(state) != set(rules):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{where} must be a dict with the keys {sorted(rules)}, got {got}")
    for name, (kind, low) in rules.items():
        value = state[name]
        # bool is an int subclass: an int field takes no bool, a bool field no int
        if type(value) is not kind or (low is not None and value < low):
            expected = ("an int" if kind is int else "a bool") + ("" if low is None else f" >= {low}")
            raise ValueError(f"{where}.{name} must be {expected}, got {value!r}")
    return state


def restore_position(cursor: Any, plan: Any, where: str) -> tuple[Cursor, Plan | None]:
    """The saved ``cursor`` and ``plan`` (dicts, ``plan`` may be None) as objects, each field
    checked: types, bounds, ``consumed <= batches`` (a count past the epoch would skip batches)
    and ``start <= stop``. Raises ``ValueError`` naming ``where`` and the field."""
    restored = Cursor(**_fields(cursor, _CURSOR, f"{where} cursor"))
    if restored.consumed > restored.batches:
        raise ValueError(
            f"{where} cursor.consumed = {restored.consumed} is past the epoch's "
            f"cursor.batches = {restored.batches}"
        )
    if restored.start > restored.stop:
        raise ValueError(f"{where} cursor.start = {restored.start} is after cursor.stop = {restored.stop}")
    return restored, None if plan is None else Plan(**_fields(plan, _PLAN, f"{where} plan"))
