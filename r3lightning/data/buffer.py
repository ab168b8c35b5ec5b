"""``ReplayBuffer``: validated FIFO store of trajectories with resumable state.

Every trajectory gets a global sequence number when it is added (0, 1, 2, ... over the life of the
buffer, never reused). Eviction is first-in-first-out, so the buffer always holds one contiguous
range ``[start, stop)`` of sequence numbers: ``stop`` counts every trajectory ever added and
``start`` every one evicted or cleared. The data module names an epoch's snapshot by such a range,
which is what lets a checkpointed run find exactly the trajectories it was iterating.

Insertion validates first and mutates after, so a rejected trajectory (or a rejected ``extend``
batch, all-or-nothing) leaves the buffer unchanged.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from r3lightning.data.trajectory import Trajectory
from r3lightning.routes import compact_routes, widest_route_dtype

__all__ = ["ReplayBuffer", "pack_trajectories", "unpack_trajectories"]

_STATE_VERSION = 1


def pack_trajectories(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """Trajectories -> a dict of a few flat tensors (checkpoint-friendly, ``weights_only`` safe).

    Token fields are concatenated with per-trajectory lengths; routes are concatenated in the
    widest dtype present with one row count per trajectory (-1 = no routes). One copy of every
    field; no per-trajectory Python objects in the result.
    """
    count = len(trajectories)
    prompt_lengths = torch.tensor([t.prompt_length for t in trajectories], dtype=torch.int64)
    response_lengths = torch.tensor([t.response_length for t in trajectories], dtype=torch.int64)
    route_rows = torch.tensor(
        [-1 if t.routed_experts is None else t.route_rows for t in trajectories], dtype=torch.int64
    )
    with_routes = [t.routed_experts for t in trajectories if t.routed_experts is not None]
    routes: Tensor | None = None
    if with_routes:
        dtype = widest_route_dtype(r.dtype for r in with_routes)
        routes = torch.cat([r.to(dtype) for r in with_routes])  # [sum rows, L, K]

    def cat(name: str, dtype: torch.dtype) -> Tensor:
        if not count:
            return torch.empty(0, dtype=dtype)
        return torch.cat([getattr(t, name) for t in trajectories])

    return {
        "count": count,
        "prompt_lengths": prompt_lengths,
        "response_lengths": response_lengths,
        "prompt_ids": cat("prompt_ids", torch.int64),
        "response_ids": cat("response_ids", torch.int64),
        "loss_mask": cat("loss_mask", torch.float32),
        "rollout_logprobs": cat("rollout_logprobs", torch.float32),
        # float64 keeps Python float rewards and advantages exact through a round trip
        "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float64),
        "advantages": torch.tensor([t.advantage for t in trajectories], dtype=torch.float64),
        "route_rows": route_rows,
        "routes": routes,
    }


def unpack_trajectories(packed: dict[str, Any]) -> list[Trajectory]:
    """Inverse of :func:`pack_trajectories`; each route tensor regains its own compact dtype."""
    count = int(packed["count"])
    prompt_lengths = packed["prompt_lengths"].tolist()
    response_lengths = packed["response_lengths"].tolist()
    route_rows = packed["route_rows"].tolist()
    if not (len(prompt_lengths) == len(response_lengths) == len(route_rows) == count):
        raise ValueError(f"packed trajectories: per-trajectory fields disagree with count = {count}")
    prompts = packed["prompt_ids"].split(prompt_lengths)
    responses = packed["response_ids"].split(response_lengths)
    masks = packed["loss_mask"].split(response_lengths)
    logprobs = packed["rollout_logprobs"].split(response_lengths)
    rewards = packed["rewards"].tolist()
    advantages = packed["advantages"].tolist()
    routes_all = packed["routes"]
    routes_split = iter(routes_all.split([r for r in route_rows if r >= 0]) if routes_all is not None else ())
    out = []
    for i in range(count):
        # a copy of its own (not a view of the whole block), in its own compact dtype
        routes = compact_routes(next(routes_split), copy=True) if route_rows[i] >= 0 else None
        out.append(
            Trajectory._trusted(
                prompts[i].clone(),
                responses[i].clone(),
                masks[i].clone(),
                logprobs[i].clone(),
                float(rewards[i]),
                float(advantages[i]),
                routes,
            )
        )
    return out


class ReplayBuffer:
    """FIFO buffer of :class:`Trajectory` with validation, eviction and checkpoint state.

    Args:
        capacity: maximum number of trajectories; when full, adding one evicts the oldest
            (first in, first out). ``None`` = unbounded. An ``extend`` larger than the capacity
            keeps only its newest ``capacity`` trajectories.
        vocab_size: when given, token ids must be ``< vocab_size``.
        num_experts: when given, expert ids in routes must be ``< num_experts``; also used for
            placeholder routes when batches are padded.

    The route schema ``(num_layers, top_k)`` is fixed by the first trajectory with routes and
    kept until :meth:`clear`; later trajectories with another schema are rejected.
    Iteration yields the stored trajectories oldest first.
    """

    def __init__(
        self, capacity: int | None = None, *, vocab_size: int | None = None, num_experts: int | None = None
    ) -> None:
        for name, value in (("capacity", capacity), ("vocab_size", vocab_size), ("num_experts", num_experts)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ReplayBuffer {name} must be a positive int or None, got {value!r}")
        self.capacity = capacity
        self.vocab_size = vocab_size
        self.num_experts = num_experts
        self._items: deque[Trajectory] = deque()
        self._start = 0  # sequence number of the oldest stored trajectory
        self._route_schema: tuple[int, int] | None = None

    # ------------------------------------------------------------------------ inspection

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(tuple(self._items))

    def __getitem__(self, index: int) -> Trajectory:
        return self._items[index]

    @property
    def start(self) -> int:
        """Sequence number of the oldest stored trajectory (= trajectories evicted or cleared)."""
        return self._start

    @property
    def stop(self) -> int:
        """One past the newest sequence number (= trajectories ever added)."""
        return self._start + len(self._items)

    @property
    def route_schema(self) -> tuple[int, int] | None:
        """``(num_layers, top_k)`` of the stored routes, ``None`` before any routes arrived."""
        return self._route_schema

    def window(self, start: int, stop: int) -> tuple[Trajectory, ...]:
        """Trajectories with sequence numbers ``[start, stop)``; ``KeyError`` if any is gone."""
        if not self.covers(start, stop):
            raise KeyError(
                f"trajectories [{start}, {stop}) are not all in the buffer, which holds [{self._start}, {self.stop})"
            )
        first = start - self._start
        return tuple(itertools.islice(self._items, first, first + (stop - start)))

    def covers(self, start: int, stop: int) -> bool:
        return self._start <= start <= stop <= self.stop

    # ------------------------------------------------------------------------ mutation

    def add(self, trajectory: Trajectory) -> None:
        """Validate and append one trajectory (evicting the oldest when full)."""
        self.extend([trajectory])

    def extend(self, trajectories: Iterable[Trajectory]) -> None:
        """Validate all, then append all (all-or-nothing); oldest evicted beyond ``capacity``.

        Costs one pass over every new trajectory's ids and routes (range checks).
        """
        batch = list(trajectories)
        where = "trajectory {i} of the batch" if len(batch) > 1 else "trajectory"
        self._route_schema = self._validated(batch, self._route_schema, where)
        self._items.extend(batch)
        if self.capacity is not None:
            overflow = len(self._items) - self.capacity
            for _ in range(max(overflow, 0)):
                self._items.popleft()
            self._start += max(overflow, 0)

    def _validated(
        self, batch: Sequence[Trajectory], schema: tuple[int, int] | None, where: str
    ) -> tuple[int, int] | None:
        """Check ``batch`` against the bounds and one route schema (``schema``, else the first
        routes' own); returns that schema. Changes nothing. ``where`` names a rejected item."""
        for i, trajectory in enumerate(batch):
            if not isinstance(trajectory, Trajectory):
                raise TypeError(
                    f"ReplayBuffer takes Trajectory objects, got {type(trajectory).__name__} at position {i}"
                )
            try:
                trajectory.validate(
                    vocab_size=self.vocab_size, num_experts=self.num_experts, route_schema=schema
                )
            except ValueError as err:
                raise ValueError(f"{where.format(i=i)} rejected: {err}") from None
            if schema is None:
                schema = trajectory.route_schema
        return schema

    def clear(self) -> None:
        """Drop every trajectory (their sequence numbers are not reused) and the route schema."""
        self._start = self.stop
        self._items.clear()
        self._route_schema = None

    # ------------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Contents and position: a few flat tensors plus ints (``torch.load(weights_only=True)``
        safe). Copies every stored trajectory once."""
        return {
            "version": _STATE_VERSION,
            "start": self._start,
            "route_schema": None if self._route_schema is None else list(self._route_schema),
            "trajectories": pack_trajectories(tuple(self._items)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace contents and position with ``state`` (validated against this buffer's bounds)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"ReplayBuffer state version {state.get('version')!r} is not {_STATE_VERSION}")
        items = unpack_trajectories(state["trajectories"])
        if self.capacity is not None and len(items) > self.capacity:
            raise ValueError(
                f"ReplayBuffer state holds {len(items)} trajectories, more than this buffer's capacity "
                f"{self.capacity}; loading it would lose samples"
            )
        try:
            start = None if isinstance(state["start"], bool) else operator.index(state["start"])
        except TypeError:
            start = None
        if start is None or start < 0:
            raise ValueError(f"ReplayBuffer state start must be an int >= 0, got {state['start']!r}")
        saved = None if state["route_schema"] is None else tuple(state["route_schema"])
        schema = self._validated(items, saved, "ReplayBuffer state: trajectory {i}")
        self._items = deque(items)
        self._start = start
        self._route_schema = schema

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(len={len(self)}, capacity={self.capacity}, range=[{self._start}, {self.stop}), "
            f"route_schema={self._route_schema})"
        )
