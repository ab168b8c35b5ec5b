"""``Trajectory``: one rollout (prompt + response tokens, per-token RL fields, captured routes),
normalised once to CPU tensors it owns: ids int64, masks and logprobs float32, routes in the
compact dtype of their largest id after the route check (about 10 ms for 32k x 48 x 8 ids).

It is what the rollout stage produces, so it lives here; ``data`` (buffer, collation) consumes it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from r3lightning.checks import check_int
from r3lightning.routes import check_layers, compact_route_dtype, dummy_routes, mark_missing, missing_rows
from r3lightning.wire.route_check import check_routes

__all__ = ["Trajectory", "TrajectorySink", "padding_trajectories", "route_signature"]

ArrayLike = Tensor | np.ndarray | Sequence[int] | Sequence[float]


def _as_host_tensor(name: str, data: Any) -> Tensor:
    """``data`` as a detached CPU tensor of its own, or ``TypeError`` naming the field."""
    if isinstance(data, Tensor):
        # a copy: callers reuse their tensors for the next rollout, which must not rewrite this one
        return data.detach().to("cpu", copy=True)
    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.array(data, copy=True))
    if isinstance(data, (list, tuple)):
        try:
            return torch.as_tensor(data) if len(data) else torch.empty(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"Trajectory.{name} must be numeric, got {data!r:.80}") from err
    raise TypeError(f"Trajectory.{name} must be a tensor, ndarray or list, got {type(data).__name__}")


def _token_ids(name: str, data: Any) -> Tensor:
    ids = _as_host_tensor(name, data)
    if ids.dim() != 1:
        raise ValueError(f"Trajectory.{name} must be 1-D [tokens], got shape {tuple(ids.shape)}")
    if ids.numel() and (ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex()):
        raise TypeError(f"Trajectory.{name} must hold integer token ids, got dtype {ids.dtype}")
    ids = ids.to(torch.int64)
    if ids.numel() and int(ids.min()) < 0:
        bad = int(torch.nonzero(ids < 0)[0, 0])
        raise ValueError(f"Trajectory.{name} must hold token ids >= 0, got {name}[{bad}] = {int(ids[bad])}")
    return ids


def _per_response_token(name: str, data: Any, count: int, default: float) -> Tensor:
    """``[count]`` finite float32 values (a loss mask: in [0, 1]), all ``default`` when ``data`` is None."""
    if data is None:
        return torch.full((count,), default, dtype=torch.float32)
    values = _as_host_tensor(name, data)
    if values.dim() != 1 or values.numel() != count:
        got = f"shape {tuple(values.shape)}"
        raise ValueError(f"Trajectory.{name} must have one entry per response token ({count}), got {got}")
    if values.is_complex():
        raise TypeError(f"Trajectory.{name} must be real, got dtype {values.dtype}")
    values = values.to(torch.float32)
    # a NaN logprob marks a token the engine gave no logprob for (it answered ``logprobs: null``)
    rules = {"be finite": values.isinf() if name == "rollout_logprobs" else ~values.isfinite()}
    if name == "loss_mask":
        rules["hold values in [0, 1]"] = (values < 0) | (values > 1)
    for rule, bad in rules.items():
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"Trajectory.{name} must {rule}, got {name}[{i}] = {float(values[i])}")
    return values


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return not isinstance(a, Tensor) and not isinstance(b, Tensor) and a == b


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _scalar(name: str, value: Any) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"Trajectory.{name} must be a scalar, got shape {tuple(value.shape)}")
        value = value.item()
    try:
        out = float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"Trajectory.{name} must be a real number, got {value!r}") from err
    if not math.isfinite(out):
        raise ValueError(f"Trajectory.{name} must be finite, got {out}")
    if abs(out) > _FLOAT32_MAX:  # collated as float32: it would turn into inf there
        raise ValueError(
            f"Trajectory.{name} must be within float32 range (|x| <= {_FLOAT32_MAX:.4g}), got {out}"
        )
    return out


def _weight_version(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise ValueError(f"Trajectory.weight_version must be an integer >= 0 or None, got {value!r}")
    return value


def _routes(data: Any, num_tokens: int, layers: tuple[int, ...] | None) -> Tensor:
    """``data`` through the route check, in the compact dtype of its largest id (signed when rows
    are marked missing with -1: the trainer routes those tokens natively)."""
    routes = _as_host_tensor("routed_experts", data)
    if routes.dtype == torch.bool or routes.is_floating_point() or routes.is_complex():
        raise TypeError(f"Trajectory.routed_experts must hold integer expert ids, got dtype {routes.dtype}")
    high = check_routes(
        routes.numpy(),
        num_layers=None if layers is None else len(layers),  # route_layers names every column
        rows=range(num_tokens + 1),
        rows_rule=f"at most one per token, {num_tokens} (len(prompt_ids) + len(response_ids))",
        where="Trajectory.routed_experts" + ("" if layers is None else f" on route_layers {list(layers)}"),
        layers=layers,
        missing=True,
    )
    absent = missing_rows(routes.numpy())
    if absent.any():  # every id of a missing row is the sentinel
        return torch.from_numpy(mark_missing(routes.numpy(), absent)).contiguous()
    return routes.to(compact_route_dtype(high)).contiguous()


class Trajectory:
    """One rollout, validated (``TypeError`` / ``ValueError`` naming the field and the expected
    value) and normalised to compact CPU tensors.

    Args:
        prompt_ids, response_ids: ``[P >= 1]`` and ``[R >= 0]`` token ids (``n = P + R``).
        loss_mask: ``[R]`` in [0, 1], 1 = loss target; default all ones.
        rollout_logprobs: ``[R]`` engine logprob per response token; default zeros. NaN marks
            a token the engine gave no logprob for (the collector writes it when an engine
            answers ``logprobs: null``); a loss that needs engine logprobs refuses such a batch.
        reward, advantage: scalars; ``advantage`` defaults to ``reward``.
        routed_experts: ``[captured <= n, L, K]`` route rows: row ``t`` = the experts token
            ``t`` used as an input (later tokens route natively); ``None``: all native.
        route_layers: the sorted absolute decoder layer of each route column (None: ``j`` is ``j``).
        weight_version: the engine's weight version that generated the response (the oldest one
            when the turns of a multi-turn trajectory saw several); ``None``: unknown.

    Cost: host copies of the fields, and the route check over the routes (its distinct-experts
    part, about 10 ms for 32k x 48 x 8 ids); device inputs are copied to the host (a sync).

    Raises:
        TypeError: Non-integer ids or routes, or complex values.
        ValueError: An empty prompt, a per-token field of the wrong length or out of range, a
            route array of the wrong shape, too many rows, a repeated or out-of-range expert, or
            ``route_layers`` without routes (each naming the field).
    """

    __slots__ = (
        "advantage",
        "loss_mask",
        "prompt_ids",
        "response_ids",
        "reward",
        "rollout_logprobs",
        "route_layers",
        "routed_experts",
        "weight_version",
    )

    def __init__(
        self,
        prompt_ids: ArrayLike,
        response_ids: ArrayLike,
        *,
        loss_mask: ArrayLike | None = None,
        rollout_logprobs: ArrayLike | None = None,
        reward: float = 0.0,
        advantage: float | None = None,
        routed_experts: Tensor | np.ndarray | None = None,
        route_layers: Sequence[int] | None = None,
        weight_version: int | None = None,
    ) -> None:
        self.prompt_ids = _token_ids("prompt_ids", prompt_ids)
        if self.prompt_ids.numel() == 0:
            raise ValueError("Trajectory.prompt_ids must hold at least one token, got 0")
        self.response_ids = _token_ids("response_ids", response_ids)
        count = self.response_ids.numel()
        self.loss_mask = _per_response_token("loss_mask", loss_mask, count, 1.0)
        self.rollout_logprobs = _per_response_token("rollout_logprobs", rollout_logprobs, count, 0.0)
        self.reward = _scalar("reward", reward)
        self.advantage = self.reward if advantage is None else _scalar("advantage", advantage)
        self.route_layers = layers = check_layers("Trajectory.route_layers", route_layers)
        if layers is not None and routed_experts is None:
            raise ValueError(f"Trajectory.route_layers {list(layers)} given without routed_experts")
        self.routed_experts = (
            None if routed_experts is None else _routes(routed_experts, self.num_tokens, layers)
        )
        self.weight_version = _weight_version(weight_version)

    @property
    def prompt_length(self) -> int:
        return self.prompt_ids.numel()

    @property
    def response_length(self) -> int:
        return self.response_ids.numel()

    @property
    def num_tokens(self) -> int:
        """``n = len(prompt_ids) + len(response_ids)``."""
        return self.prompt_ids.numel() + self.response_ids.numel()

    @property
    def route_rows(self) -> int:
        """Captured route rows (0 without routes)."""
        return 0 if self.routed_experts is None else self.routed_experts.shape[0]

    @property
    def route_schema(self) -> tuple[int, int] | None:
        """``(num_layers, top_k)`` of the routes, ``None`` without routes."""
        return None if self.routed_experts is None else tuple(self.routed_experts.shape[1:])

    def on_layers(self, layers: tuple[int, ...] | None, where: str = "Trajectory") -> Trajectory:
        """The trajectory with its routes cut to some decoder layers.

        Args:
            layers: Sorted absolute decoder-layer ids (None: as it is).
            where: Names the trajectory in the error.

        Returns:
            ``self`` when nothing changes, else a copy with ``routes [captured, len(layers), K]``.

        Raises:
            ValueError: Routes held on another layer set.
        """
        routes = self.routed_experts
        have = self.route_layers
        if layers is None or routes is None or have == layers:
            return self
        if have is not None or layers[-1] >= routes.shape[1]:
            held = f"routes on all {routes.shape[1]} layers" if have is None else f"route_layers {list(have)}"
            raise ValueError(
                f"{where}: {held}, expected route_layers {list(layers)} or routes on every layer"
            )
        out = copy.copy(self)
        out.routed_experts = routes.index_select(1, torch.tensor(layers))  # [captured, len(layers), K]
        out.route_layers = layers
        return out

    def validate(
        self,
        *,
        vocab_size: int | None = None,
        num_experts: int | None = None,
        route_schema: tuple[int, int] | None = None,
    ) -> None:
        """Checks against the model and the buffer; one pass over the ids and routes.

        Args:
            vocab_size: Token ids must be below it (None: unchecked).
            num_experts: Expert ids must be below it (None: unchecked).
            route_schema: The routes' ``(num_layers, top_k)`` (None: unchecked).

        Raises:
            ValueError: The first id or route out of range, naming the field.
        """
        if vocab_size is not None:
            for name in ("prompt_ids", "response_ids"):
                ids = getattr(self, name)
                if ids.numel() and int(ids.max()) >= vocab_size:
                    bad = int(torch.nonzero(ids >= vocab_size)[0, 0])
                    raise ValueError(
                        f"Trajectory.{name}[{bad}] = {int(ids[bad])} is out of range for a vocabulary "
                        f"of {vocab_size} tokens"
                    )
        if self.routed_experts is not None and (num_experts is not None or route_schema is not None):
            layers, top_k = (None, None) if route_schema is None else route_schema
            check_routes(
                self.routed_experts.numpy(),
                num_experts=num_experts,
                num_layers=layers,
                top_k=top_k,
                distinct=False,  # checked when the trajectory was built
                where="Trajectory.routed_experts",
                missing=True,
            )

    def equal(self, other: object) -> bool:
        """Same values and dtypes in every field.

        Args:
            other: Any object (only a `Trajectory` can be equal).
        """
        if not isinstance(other, Trajectory):
            return False
        return all(_same(getattr(self, n), getattr(other, n)) for n in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return self.equal(other) if isinstance(other, Trajectory) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # value equality on mutable tensors: unhashable

    def __repr__(self) -> str:
        r = self.routed_experts
        routes = "None" if r is None else f"{tuple(r.shape)} {r.dtype}"
        routes += "" if self.route_layers is None else f" on layers {list(self.route_layers)}"
        version = "" if self.weight_version is None else f", weight_version={self.weight_version}"
        return (
            f"Trajectory(prompt={self.prompt_length}, response={self.response_length}, "
            f"reward={self.reward:g}, advantage={self.advantage:g}, routed_experts={routes}{version})"
        )


class TrajectorySink(Protocol):
    """Where a collector puts a step's trajectories: a
    [`ReplayBuffer`][r3lightning.data.buffer.ReplayBuffer], or anything with its ``extend``."""

    def extend(self, trajectories: Iterable[Trajectory]) -> None:
        """Take the trajectories (validating them first is up to the sink).

        Args:
            trajectories: One step's trajectories of this rank.
        """


def route_signature(
    trajectories: Iterable[Trajectory], where: str
) -> tuple[tuple[int, int] | None, tuple[int, ...] | None]:
    """The one ``(route_schema, route_layers)`` of the routed trajectories.

    Args:
        trajectories: Trajectories with or without routes.
        where: Names them in the error.

    Returns:
        ``((num_layers, top_k), route_layers)``, or ``(None, None)`` without routes.

    Raises:
        ValueError: Different schemas or layer sets.
    """
    routed = [t for t in trajectories if t.routed_experts is not None]
    schemas = {t.route_schema for t in routed}
    layer_sets = {t.route_layers for t in routed}
    if len(schemas) > 1 or len(layer_sets) > 1:
        raise ValueError(
            f"{where} have different route schemas (num_layers, top_k) or route_layers: "
            f"{sorted(schemas)}, {sorted(layer_sets, key=str)}"
        )
    return next(iter(schemas), None), next(iter(layer_sets), None)


def padding_trajectories(
    count: int,
    *,
    pad_token_id: int = 0,
    route_schema: tuple[int, int] | None = None,
    num_experts: int | None = None,
    route_layers: tuple[int, ...] | None = None,
) -> list[Trajectory]:
    """Zero-loss placeholders: one ``pad_token_id`` prompt token, an empty response.

    Args:
        count: How many, >= 0.
        pad_token_id: The prompt token.
        route_schema: ``(num_layers, top_k)`` of the batch's routes (None: no routes).
        num_experts: With ``route_schema``: one `dummy_routes` row each; without: zero rows.
        route_layers: The batch's route layers.

    Returns:
        ``count`` trajectories.
    """
    routes: list[Tensor | None] = [None] * check_int("count", count, 0)
    if route_schema is not None and num_experts is None:
        routes = [torch.empty((0, *route_schema), dtype=torch.uint8)] * count
    elif route_schema is not None:
        rows = dummy_routes(count, route_schema[0], route_schema[1], num_experts)  # [count, L, K]
        routes = [rows[i : i + 1] for i in range(count)]
    return [
        Trajectory([pad_token_id], [], routed_experts=r, route_layers=None if r is None else route_layers)
        for r in routes
    ]
