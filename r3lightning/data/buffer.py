"""``ReplayBuffer``: validated FIFO store of trajectories with resumable state. Each trajectory gets
a sequence number when added (never reused), so the buffer holds one range ``[start, stop)``; a
rejected trajectory (or ``extend`` batch) leaves it unchanged."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from r3lightning.checks import check_int
from r3lightning.data.fill import weight_versions
from r3lightning.ragged import host_int64
from r3lightning.rollout.trajectory import Trajectory, route_signature
from r3lightning.routes import check_layers, widest_route_dtype

__all__ = ["ReplayBuffer", "pack_trajectories", "unpack_trajectories"]

_STATE_VERSION = 1


def pack_trajectories(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """Trajectories as a dict of flat tensors (``weights_only`` safe), with per-trajectory route id
    sums so that a restore refuses rows moved to a neighbour.

    Args:
        trajectories: Trajectories of one route schema and layer set.

    Returns:
        ``count``, per-trajectory lengths, rewards and advantages (float64: exact round trip), the
        concatenated token fields, ``routes [sum rows, L, K]`` (or None) and ``route_layers``. One
        copy of every field, one pass over the routes.

    Raises:
        ValueError: Different route schemas or layer sets.
    """
    _, layers = route_signature(trajectories, "trajectories to pack")
    per_trajectory = [t.routed_experts for t in trajectories]  # None: no routes
    routed = [r for r in per_trajectory if r is not None]
    dtype = widest_route_dtype(r.dtype for r in routed) if routed else None
    routes = torch.cat([r.to(dtype) for r in routed]) if routed else None  # [sum rows, L, K]

    def cat(name: str, dtype: torch.dtype) -> Tensor:
        return torch.cat([torch.empty(0, dtype=dtype), *(getattr(t, name) for t in trajectories)])

    return {
        "count": len(trajectories),
        "prompt_lengths": torch.tensor([t.prompt_length for t in trajectories], dtype=torch.int64),
        "response_lengths": torch.tensor([t.response_length for t in trajectories], dtype=torch.int64),
        "prompt_ids": cat("prompt_ids", torch.int64),
        "response_ids": cat("response_ids", torch.int64),
        "loss_mask": cat("loss_mask", torch.float32),
        "rollout_logprobs": cat("rollout_logprobs", torch.float32),
        # float64 keeps Python float rewards and advantages exact through a round trip
        "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float64),
        "advantages": torch.tensor([t.advantage for t in trajectories], dtype=torch.float64),
        "route_rows": torch.tensor([-1 if r is None else len(r) for r in per_trajectory], dtype=torch.int64),
        "route_sums": torch.tensor(
            [0 if r is None else int(r.sum(dtype=torch.int64)) for r in per_trajectory], dtype=torch.int64
        ),
        "routes": routes,
        "route_layers": None if layers is None else list(layers),
        "weight_versions": weight_versions(trajectories),  # -1: unknown
    }


_PACKED_KEYS = (
    "count",
    "prompt_lengths",
    "response_lengths",
    "prompt_ids",
    "response_ids",
    "loss_mask",
    "rollout_logprobs",
    "rewards",
    "advantages",
    "route_rows",
    "routes",
)


def check_state(state: Any, keys: Sequence[str], where: str, *, version: int | None = None) -> None:
    """Refuses a saved state that is not a dict with the expected keys.

    Args:
        state: The loaded value.
        keys: Keys it must hold.
        where: Names the state in the error.
        version: The ``version`` entry it must carry (None: unchecked).

    Raises:
        ValueError: Not a dict, another version, or missing keys.
    """
    if not isinstance(state, dict):
        raise ValueError(f"{where} must be a dict, got {type(state).__name__}")
    if version is not None and state.get("version") != version:
        raise ValueError(f"{where} version {state.get('version')!r} is not {version}")
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"{where} lacks {missing}")


def _vector(packed: dict[str, Any], name: str, size: int, where: str) -> Tensor:
    value = packed[name]
    if not isinstance(value, Tensor) or value.dim() != 1 or value.numel() != size:
        got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{where}: {name} must be a 1-D tensor of {size} entries, got {got}")
    return value


def _lengths(packed: dict[str, Any], name: str, count: int, low: int, where: str) -> list[int]:
    lengths = host_int64(_vector(packed, name, count, where), f"{where}: {name}").tolist()
    bad = next((i for i, n in enumerate(lengths) if n < low), None)
    if bad is not None:
        raise ValueError(f"{where}: {name}[{bad}] must be >= {low}, got {lengths[bad]}")
    return lengths


def unpack_trajectories(packed: dict[str, Any], *, where: str = "packed trajectories") -> list[Trajectory]:
    """Inverse of `pack_trajectories`, every trajectory checked as a fresh one.

    Args:
        packed: A dict from `pack_trajectories` (possibly from an untrusted checkpoint).
        where: Names the data in errors.

    Returns:
        The trajectories. One copy and one check of every field.

    Raises:
        ValueError: A missing key, a malformed field, lengths that do not add up, or routes whose
            sums differ, naming ``where``, the field and the trajectory.
    """
    check_state(packed, _PACKED_KEYS, where)
    count = packed["count"]
    if isinstance(count, Tensor) and count.numel() == 1 and not count.is_floating_point():
        count = count.item()
    count = check_int(f"{where}: count", count, 0)
    prompt_lengths = _lengths(packed, "prompt_lengths", count, 1, where)
    response_lengths = _lengths(packed, "response_lengths", count, 0, where)
    route_rows = _lengths(packed, "route_rows", count, -1, where)
    per_field = {"prompt_ids": prompt_lengths, "response_ids": response_lengths}
    per_field |= {"loss_mask": response_lengths, "rollout_logprobs": response_lengths}
    fields: dict[str, Any] = {k: _vector(packed, k, sum(n), where).split(n) for k, n in per_field.items()}
    fields["reward"] = _vector(packed, "rewards", count, where).tolist()
    fields["advantage"] = _vector(packed, "advantages", count, where).tolist()
    if packed.get("weight_versions") is not None:  # absent from states of earlier releases: unknown
        versions = _lengths(packed, "weight_versions", count, -1, where)
        fields["weight_version"] = [None if v < 0 else v for v in versions]
    sums = None if packed.get("route_sums") is None else _vector(packed, "route_sums", count, where).tolist()
    layers = packed.get("route_layers")  # absent from states of earlier releases: every layer
    kept = [r for r in route_rows if r >= 0]
    routes = packed["routes"]
    fits = isinstance(routes, Tensor) and routes.dim() == 3 and routes.shape[0] == sum(kept)
    if not fits and (routes is not None or kept):
        got = f"shape {tuple(routes.shape)}" if isinstance(routes, Tensor) else type(routes).__name__
        raise ValueError(
            f"{where}: routes must be a [rows, num_layers, top_k] tensor with the {sum(kept)} rows "
            f"route_rows counts, got {got}"
        )
    parts = iter(() if routes is None else routes.split(kept))
    out = []
    for i in range(count):
        mine = next(parts) if route_rows[i] >= 0 else None
        try:
            values = {name: column[i] for name, column in fields.items()}
            out.append(
                Trajectory(**values, routed_experts=mine, route_layers=None if mine is None else layers)
            )
            total = None if sums is None or mine is None else int(mine.sum(dtype=torch.int64))
            if total is not None and total != sums[i]:
                raise ValueError(
                    f"its {len(mine)} route rows add up to {total}, not to route_sums[{i}] = {sums[i]} "
                    "(route_rows out of step with routes)"
                )
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: trajectory {i} rejected: {err}") from None
    return out


class ReplayBuffer:
    """FIFO buffer of [`Trajectory`][r3lightning.rollout.trajectory.Trajectory] with validation, eviction and checkpoint state; the first
    routes fix the schema ``(num_layers, top_k)`` and ``route_layers`` until `clear`.

    Args:
        capacity: most trajectories kept (the oldest are evicted); ``None`` = unbounded.
        vocab_size, num_experts: bounds of token and expert ids, when given (``num_experts``
            also sizes the data module's placeholder routes).
        layers: keep routes only on these absolute decoder layers: routes on every layer are cut
            on insert, others refused. ``None``: routes as they come.

    Not thread-safe: one writer, or a lock around it (`StreamingReplayBuffer` is the threaded one).

    Raises:
        ValueError: A size below 1, or ``layers`` that are not sorted, unique ids >= 0.
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
            if value is not None:
                check_int(f"ReplayBuffer {name}", value)
        self.capacity = capacity
        self.vocab_size = vocab_size
        self.num_experts = num_experts
        self.layers = check_layers("ReplayBuffer layers", layers)
        self._items: deque[Trajectory] = deque(maxlen=capacity)  # evicts the oldest when full
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
        """Sequence number of the oldest stored trajectory."""
        return self._start

    @property
    def stop(self) -> int:
        """One past the newest sequence number."""
        return self._start + len(self._items)

    @property
    def route_schema(self) -> tuple[int, int] | None:
        """``(num_layers, top_k)`` of the stored routes, ``None`` before any routes arrived."""
        return self._fixed[0]

    def window(self, start: int, stop: int) -> tuple[Trajectory, ...]:
        """Trajectories by sequence number.

        Args:
            start, stop: The range ``[start, stop)``.

        Raises:
            KeyError: Some were evicted or cleared, or never added.
        """
        if not self.covers(start, stop):
            raise KeyError(
                f"trajectories [{start}, {stop}) are not all in the buffer, which holds [{self._start}, {self.stop})"
            )
        first = start - self._start
        return tuple(itertools.islice(self._items, first, first + (stop - start)))

    def covers(self, start: int, stop: int) -> bool:
        """Whether every sequence number of ``[start, stop)`` is still stored.

        Args:
            start, stop: The range.
        """
        return self._start <= start <= stop <= self.stop

    def add(self, trajectory: Trajectory) -> None:
        """Validate and append one trajectory, evicting the oldest when full.

        Args:
            trajectory: The trajectory (routes cut to ``layers`` when those are set).

        Raises:
            TypeError, ValueError: As `extend`.
        """
        self.extend([trajectory])

    def extend(self, trajectories: Iterable[Trajectory]) -> None:
        """Validate all, then append all (a refused one adds none); one pass over their ids and routes.

        Args:
            trajectories: The trajectories, in order.

        Raises:
            TypeError: Something other than a `Trajectory`.
            ValueError: An id out of range, another route schema or layer set, naming the trajectory.
        """
        batch = list(trajectories)
        where = "trajectory {i} of the batch" if len(batch) > 1 else "trajectory"
        batch, self._fixed = self._validated(batch, *self._fixed, where)
        added = len(self._items) + len(batch)
        self._items.extend(batch)
        self._start += added - len(self._items)  # evicted

    def _validated(
        self, batch: Sequence[Trajectory], schema: tuple[int, int] | None, layers: Any, where: str
    ) -> tuple[list[Trajectory], tuple[Any, Any]]:
        """``batch`` on `layers`, checked, with its one route schema and layer set."""
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
                schema = t.route_schema
                layers = t.route_layers
            out.append(t)
        return out, (schema, layers)

    def clear(self) -> None:
        """Drop every trajectory (their sequence numbers are not reused) and the route schema."""
        self._start = self.stop
        self._fixed = (None, None)
        self._items.clear()

    def state_dict(self) -> dict[str, Any]:
        """Contents and position (``weights_only`` safe); copies every stored trajectory once."""
        return {
            "version": _STATE_VERSION,
            "start": self._start,
            "route_schema": None if self._fixed[0] is None else list(self._fixed[0]),
            "route_layers": None if self._fixed[1] is None else list(self._fixed[1]),
            "trajectories": pack_trajectories(tuple(self._items)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace contents and position, checked first: a ``ValueError`` changes nothing."""
        where = "ReplayBuffer state"
        check_state(state, ("start", "route_schema", "trajectories"), where, version=_STATE_VERSION)
        start = check_int(f"{where} start", state["start"], 0)
        saved = state["route_schema"]
        pair = isinstance(saved, list | tuple) and len(saved) == 2
        if saved is not None and not (pair and all(type(n) is int and n >= 1 for n in saved)):
            raise ValueError(f"{where} route_schema must be None or [num_layers, top_k] >= 1, got {saved!r}")
        saved = None if saved is None else tuple(saved)
        layers = check_layers(f"{where} route_layers", state.get("route_layers"))  # absent in older states
        if saved is not None and self.layers not in (None, layers):  # routes on every layer: cut
            if layers is not None:
                raise ValueError(f"{where} route_layers is {list(layers)}, expected {list(self.layers)}")
            saved = (len(self.layers), saved[1])
            layers = self.layers
        items = unpack_trajectories(state["trajectories"], where=f"{where} trajectories")
        if self.capacity is not None and len(items) > self.capacity:
            raise ValueError(
                f"{where} holds {len(items)} trajectories, more than this buffer's capacity "
                f"{self.capacity}; loading it would lose samples"
            )
        items, fixed = self._validated(items, saved, layers, where + ": trajectory {i}")
        self._items = deque(items, maxlen=self.capacity)
        self._start = start
        self._fixed = fixed

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(len={len(self)}, capacity={self.capacity}, range=[{self._start}, {self.stop}), "
            f"route_schema={self._fixed[0]}, route_layers={self._fixed[1]})"
        )
