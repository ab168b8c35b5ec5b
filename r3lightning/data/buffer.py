"""``ReplayBuffer``: validated FIFO store of trajectories with resumable state.

Each trajectory gets a global sequence number when added (never reused). Eviction is FIFO, so the
buffer holds one contiguous range ``[start, stop)``: ``stop`` counts every trajectory ever added,
``start`` every one evicted or cleared. The data module names an epoch's snapshot by such a range,
which lets a checkpointed run find exactly the trajectories it was iterating. Insertion validates
first and mutates after: a rejected trajectory (or ``extend`` batch) leaves the buffer unchanged.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from r3lightning.align.layout import check_int
from r3lightning.data.trajectory import Trajectory
from r3lightning.routes import check_layers, widest_route_dtype

__all__ = ["ReplayBuffer", "pack_trajectories", "unpack_trajectories"]

_STATE_VERSION = 1


def pack_trajectories(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """Trajectories -> a dict of a few flat tensors (``weights_only`` safe): token fields
    concatenated with per-trajectory lengths, routes in the widest dtype present with one row count
    per trajectory (-1 = no routes), each one's id sum (``route_sums``: a restore refuses rows
    that moved to a neighbour) and their one ``route_layers``. One copy of every field plus one
    pass over the routes."""
    count = len(trajectories)
    layer_sets = {t.route_layers for t in trajectories if t.routed_experts is not None}
    if len(layer_sets) > 1:
        raise ValueError(
            f"trajectories to pack hold routes on different layers: {sorted(layer_sets, key=str)}"
        )
    (layers,) = layer_sets or {None}
    prompt_lengths = torch.tensor([t.prompt_length for t in trajectories], dtype=torch.int64)
    response_lengths = torch.tensor([t.response_length for t in trajectories], dtype=torch.int64)
    route_rows = torch.tensor(
        [-1 if t.routed_experts is None else t.route_rows for t in trajectories], dtype=torch.int64
    )
    with_routes = [t.routed_experts for t in trajectories if t.routed_experts is not None]
    routes: Tensor | None = None
    route_sums = torch.zeros(count, dtype=torch.int64)
    if with_routes:
        dtype = widest_route_dtype(r.dtype for r in with_routes)
        routes = torch.cat([r.to(dtype) for r in with_routes])  # [sum rows, L, K]
        rows = route_rows.clamp(min=0)  # [count]
        running = torch.cat(
            [torch.zeros(1, dtype=torch.int64), routes.flatten(1).sum(1, dtype=torch.int64).cumsum(0)]
        )
        ends = rows.cumsum(0)  # one past each trajectory's last row
        route_sums = running[ends] - running[ends - rows]

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
        "route_sums": route_sums,
        "routes": routes,
        "route_layers": None if layers is None else list(layers),
    }


_PACKED_KEYS = ("count", "prompt_lengths", "response_lengths", "prompt_ids", "response_ids", "loss_mask",
                "rollout_logprobs", "rewards", "advantages", "route_rows", "routes")  # fmt: skip


def _missing(state: Any, keys: Sequence[str], where: str) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"{where} must be a dict, got {type(state).__name__}")
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"{where} lacks {missing}")


def _vector(packed: dict[str, Any], name: str, size: int | None, where: str) -> Tensor:
    value = packed[name]
    if not isinstance(value, Tensor) or value.dim() != 1 or (size is not None and value.numel() != size):
        got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        expected = "a 1-D tensor" + ("" if size is None else f" of {size} entries")
        raise ValueError(f"{where}: {name} must be {expected}, got {got}")
    return value


def _lengths(packed: dict[str, Any], name: str, count: int, low: int, where: str) -> list[int]:
    value = _vector(packed, name, count, where)
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{where}: {name} must hold integers, got dtype {value.dtype}")
    lengths = value.tolist()
    bad = next((i for i, n in enumerate(lengths) if n < low), None)
    if bad is not None:
        raise ValueError(f"{where}: {name}[{bad}] must be >= {low}, got {lengths[bad]}")
    return lengths


def unpack_trajectories(packed: dict[str, Any], *, where: str = "packed trajectories") -> list[Trajectory]:
    """Inverse of :func:`pack_trajectories`; each route tensor regains its compact dtype. Builds
    every :class:`Trajectory` anew (the same checks as fresh ones) and checks the packing (keys,
    lengths, sizes, ``route_sums``); ``ValueError`` naming ``where``, the field and the trajectory.
    Cost: one copy and one validation pass of every field."""
    _missing(packed, _PACKED_KEYS, where)
    count = packed["count"]
    if isinstance(count, Tensor) and count.numel() == 1 and not count.is_floating_point():
        count = count.item()
    count = check_int(f"{where}: count", count, 0)
    prompt_lengths = _lengths(packed, "prompt_lengths", count, 1, where)
    response_lengths = _lengths(packed, "response_lengths", count, 0, where)
    route_rows = _lengths(packed, "route_rows", count, -1, where)
    per_field = {"prompt_ids": prompt_lengths, "response_ids": response_lengths}
    per_field |= {"loss_mask": response_lengths, "rollout_logprobs": response_lengths}
    fields = {name: _vector(packed, name, sum(n), where).split(n) for name, n in per_field.items()}
    rewards = _vector(packed, "rewards", count, where).tolist()
    advantages = _vector(packed, "advantages", count, where).tolist()
    sums = None if packed.get("route_sums") is None else _vector(packed, "route_sums", count, where).tolist()
    layers = packed.get("route_layers")  # absent from states of earlier releases: every layer
    kept_rows = [r for r in route_rows if r >= 0]
    routes_all = packed["routes"]
    if routes_all is None:
        if kept_rows:
            raise ValueError(f"{where}: routes is None but route_rows counts {sum(kept_rows)} rows")
        routes_split: list[Tensor] = []
    else:
        is_tensor = isinstance(routes_all, Tensor)
        if not is_tensor or routes_all.dim() != 3 or routes_all.shape[0] != sum(kept_rows):
            got = f"shape {tuple(routes_all.shape)}" if is_tensor else type(routes_all).__name__
            raise ValueError(
                f"{where}: routes must be a [rows, num_layers, top_k] tensor with the {sum(kept_rows)} rows "
                f"route_rows counts, got {got}"
            )
        routes_split = list(routes_all.split(kept_rows))
    routes_iter = iter(routes_split)
    out = []
    for i in range(count):
        try:
            out.append(
                Trajectory(
                    fields["prompt_ids"][i],
                    fields["response_ids"][i],
                    loss_mask=fields["loss_mask"][i],
                    rollout_logprobs=fields["rollout_logprobs"][i],
                    reward=rewards[i],
                    advantage=advantages[i],
                    routed_experts=next(routes_iter) if route_rows[i] >= 0 else None,
                    route_layers=layers if route_rows[i] >= 0 else None,
                )
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: trajectory {i} rejected: {err}") from None
        routes = out[-1].routed_experts
        if (
            sums is not None
            and routes is not None
            and (total := int(routes.sum(dtype=torch.int64))) != sums[i]
        ):
            raise ValueError(
                f"{where}: trajectory {i} rejected: its {len(routes)} route rows add up to {total}, "
                f"not to route_sums[{i}] = {sums[i]} (route_rows out of step with routes)"
            )
    return out


class ReplayBuffer:
    """FIFO buffer of :class:`Trajectory` with validation, eviction and checkpoint state.

    Args:
        capacity: most trajectories kept; adding one when full evicts the oldest (an oversized
            ``extend`` keeps its newest ``capacity``). ``None`` = unbounded.
        vocab_size: when given, token ids must be ``< vocab_size``.
        num_experts: when given, expert ids must be ``< num_experts``; also sizes placeholder routes.
        layers: keep routes only on these absolute decoder layers (a pipeline stage's, a partial
            model's): routes on every layer are cut to their columns on insert (one copy of them),
            routes on another layer set are refused. ``None``: routes are kept as they come.

    The first routes fix the schema ``(num_layers, top_k)`` and their ``route_layers`` until
    :meth:`clear`; others are rejected. Iteration yields the stored trajectories oldest first.
    """

    def __init__(
        self,
        capacity: int | None = None,
        *,
        vocab_size: int | None = None,
        num_experts: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> None:
        for name, value in (("capacity", capacity), ("vocab_size", vocab_size), ("num_experts", num_experts)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ReplayBuffer {name} must be a positive int or None, got {value!r}")
        self.capacity, self.vocab_size, self.num_experts = capacity, vocab_size, num_experts
        self.layers = check_layers("ReplayBuffer layers", layers)
        self._items: deque[Trajectory] = deque()
        self._start = 0  # sequence number of the oldest stored trajectory
        self._fixed: tuple[Any, Any] = (None, None)  # the stored routes' (num_layers, top_k), route_layers

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
        return self._fixed[0]

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

    def add(self, trajectory: Trajectory) -> None:
        """Validate and append one trajectory (evicting the oldest when full)."""
        self.extend([trajectory])

    def extend(self, trajectories: Iterable[Trajectory]) -> None:
        """Validate all, then append all (all-or-nothing); oldest evicted beyond ``capacity``.
        One pass over every new trajectory's ids and routes (range checks)."""
        batch = list(trajectories)
        where = "trajectory {i} of the batch" if len(batch) > 1 else "trajectory"
        batch, self._fixed = self._validated(batch, *self._fixed, where)
        self._items.extend(batch)
        overflow = 0 if self.capacity is None else max(len(self._items) - self.capacity, 0)
        for _ in range(overflow):
            self._items.popleft()
        self._start += overflow

    def _validated(
        self, batch: Sequence[Trajectory], schema: tuple[int, int] | None, layers: Any, where: str
    ) -> tuple[list[Trajectory], tuple[Any, Any]]:
        """``batch`` on :attr:`layers`, checked against the bounds, one route schema and one layer
        set (``schema`` / ``layers``, else the first routes'), with that schema and layer set.
        Changes nothing. ``where`` names a rejected item."""
        out = []
        for i, t in enumerate(batch):
            if not isinstance(t, Trajectory):
                raise TypeError(
                    f"ReplayBuffer takes Trajectory objects, got {type(t).__name__} at position {i}"
                )
            try:
                t = t.on_layers(self.layers or layers)
                t.validate(vocab_size=self.vocab_size, num_experts=self.num_experts, route_schema=schema)
                if schema is not None and t.routed_experts is not None and t.route_layers != layers:
                    raise ValueError(
                        f"Trajectory.route_layers is {list(t.route_layers)}, expected routes on every layer"
                    )
            except ValueError as err:
                raise ValueError(f"{where.format(i=i)} rejected: {err}") from None
            if schema is None and t.routed_experts is not None:
                schema, layers = t.route_schema, t.route_layers
            out.append(t)
        return out, (schema, layers)

    def clear(self) -> None:
        """Drop every trajectory (their sequence numbers are not reused) and the route schema."""
        self._start, self._fixed = self.stop, (None, None)
        self._items.clear()

    def state_dict(self) -> dict[str, Any]:
        """Contents and position: a few flat tensors plus ints (``torch.load(weights_only=True)``
        safe). Copies every stored trajectory once."""
        return {
            "version": _STATE_VERSION,
            "start": self._start,
            "route_schema": None if self._fixed[0] is None else list(self._fixed[0]),
            "route_layers": None if self._fixed[1] is None else list(self._fixed[1]),
            "trajectories": pack_trajectories(tuple(self._items)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace contents and position with ``state``, validated as fresh trajectories are (and
        against this buffer's bounds); on any ``ValueError`` (naming the field) the buffer is
        unchanged."""
        where = "ReplayBuffer state"
        _missing(state, ("version", "start", "route_schema", "trajectories"), where)
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"{where} version {state['version']!r} is not {_STATE_VERSION}")
        start = check_int(f"{where} start", state["start"], 0)
        saved = state["route_schema"]
        if saved is not None:
            if (
                not isinstance(saved, list | tuple)
                or len(saved) != 2
                or not all(type(n) is int and n >= 1 for n in saved)
            ):
                raise ValueError(f"{where} route_schema must be None or [num_layers, top_k] >= 1, got {saved!r}")  # fmt: skip
            saved = tuple(saved)
        layers = check_layers(f"{where} route_layers", state.get("route_layers"))  # absent in older states
        if saved is not None and self.layers not in (None, layers):  # routes on every layer: cut
            if layers is not None:
                raise ValueError(f"{where} route_layers is {list(layers)}, expected {list(self.layers)}")
            saved, layers = (len(self.layers), saved[1]), self.layers
        items = unpack_trajectories(state["trajectories"], where=f"{where} trajectories")
        if self.capacity is not None and len(items) > self.capacity:
            raise ValueError(
                f"{where} holds {len(items)} trajectories, more than this buffer's capacity "
                f"{self.capacity}; loading it would lose samples"
            )
        items, fixed = self._validated(items, saved, layers, where + ": trajectory {i}")
        self._items, self._start, self._fixed = deque(items), start, fixed

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(len={len(self)}, capacity={self.capacity}, range=[{self._start}, {self.stop}), "
            f"route_schema={self._fixed[0]}, route_layers={self._fixed[1]})"
        )
