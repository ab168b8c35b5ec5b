"""``Trajectory``: one rollout (prompt + response tokens, per-token RL fields, captured routes).

``n = len(prompt_ids) + len(response_ids)`` real tokens; per response token a loss mask (1 = loss
target) and the engine's sampling logprob. ``routed_experts`` ``[captured, num_layers, top_k]``,
``captured <= n``: row ``t`` = the experts token ``t`` used as an input (engines usually return
``n - 1`` rows; later rows route natively); column ``j`` is decoder layer ``route_layers[j]`` (None:
layer ``j``, every layer present). Normalised once, at construction, to CPU tensors the
trajectory owns: ids int64, masks and logprobs float32, routes in the compact dtype of their largest
id, after :func:`~r3lightning.wire.route_check.check_routes` (about 10 ms for 32k x 48 x 8 ids).
Checks against a model run in :meth:`Trajectory.validate`, which the replay buffer calls on insert.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from r3lightning.align.dummy import dummy_routes
from r3lightning.routes import check_layers, compact_route_dtype
from r3lightning.wire.route_check import check_routes

__all__ = ["Trajectory", "padding_trajectories"]

ArrayLike = Tensor | np.ndarray | Sequence[int] | Sequence[float]


def _as_host_tensor(name: str, data: Any) -> Tensor:
    """``data`` as a detached CPU tensor of its own, or ``TypeError`` naming the field."""
    if isinstance(data, Tensor):
        # never a view: callers reuse their tensors for the next rollout, which must not rewrite
        # a trajectory already in the buffer
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


def _per_response_token(name: str, data: Any, count: int, *, unit: bool = False) -> Tensor:
    """``[count]`` finite float32 values (``unit``: each in [0, 1])."""
    values = _as_host_tensor(name, data)
    if values.dim() != 1 or values.numel() != count:
        got = tuple(values.shape)
        raise ValueError(
            f"Trajectory.{name} must have one entry per response token ({count}), got shape {got}"
        )
    if values.is_complex():
        raise TypeError(f"Trajectory.{name} must be real, got dtype {values.dtype}")
    values = values.to(torch.float32)
    rules = [("be finite", torch.isfinite)] + ([("hold values in [0, 1]", _in_unit)] if unit else [])
    for rule, ok in rules:
        if not bool((good := ok(values)).all()):
            bad = int(torch.nonzero(~good)[0, 0])
            raise ValueError(f"Trajectory.{name} must {rule}, got {name}[{bad}] = {float(values[bad])}")
    return values


def _in_unit(values: Tensor) -> Tensor:
    return (values >= 0) & (values <= 1)


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
    return out


def _routes(data: Any, num_tokens: int, layers: tuple[int, ...] | None) -> Tensor:
    """``data`` through the route check (shape, at most one row per token, ids in int32 range,
    distinct experts per row), in the compact dtype of its largest id."""
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
    )
    return routes.to(compact_route_dtype(high)).contiguous()


class Trajectory:
    """One rollout, validated and normalised to compact CPU tensors.

    Args:
        prompt_ids: ``[P]`` int64 token ids, ``P >= 1`` (the prompt's last position predicts the
            first response token).
        response_ids: ``[R]`` int64 sampled token ids, ``R >= 0``.
        loss_mask: ``[R]`` float32 in [0, 1], 1 = loss target; default all ones.
        rollout_logprobs: ``[R]`` float32 engine logprob per response token; default zeros.
        reward: scalar reward of the whole trajectory.
        advantage: scalar advantage; default ``reward`` (GRPO passes the group-normalised value).
        routed_experts: ``[captured, L, K]`` uint8 / int16 / int32 captured route rows,
            ``captured <= n``, or ``None`` (native routing for every token).
        route_layers: the absolute decoder-layer id of each of the ``L`` route columns (sorted),
            for routes kept only on some layers; ``None``: column ``j`` is layer ``j``.

    Raises ``TypeError`` / ``ValueError`` naming the field and the expected value.
    """

    __slots__ = ("advantage", "loss_mask", "prompt_ids", "response_ids", "reward", "rollout_logprobs",
                 "route_layers", "routed_experts")  # fmt: skip

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
    ) -> None:
        self.prompt_ids = _token_ids("prompt_ids", prompt_ids)
        if self.prompt_ids.numel() == 0:
            raise ValueError("Trajectory.prompt_ids must hold at least one token, got 0")
        self.response_ids = _token_ids("response_ids", response_ids)
        count = self.response_ids.numel()
        self.loss_mask = (
            torch.ones(count, dtype=torch.float32)
            if loss_mask is None
            else _per_response_token("loss_mask", loss_mask, count, unit=True)
        )
        self.rollout_logprobs = (
            torch.zeros(count, dtype=torch.float32)
            if rollout_logprobs is None
            else _per_response_token("rollout_logprobs", rollout_logprobs, count)
        )
        self.reward = _scalar("reward", reward)
        self.advantage = self.reward if advantage is None else _scalar("advantage", advantage)
        self.route_layers = layers = check_layers("Trajectory.route_layers", route_layers)
        if layers is not None and routed_experts is None:
            raise ValueError(f"Trajectory.route_layers {list(layers)} given without routed_experts")
        self.routed_experts = (
            None if routed_experts is None else _routes(routed_experts, self.num_tokens, layers)
        )

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
        if self.routed_experts is None:
            return None
        return (self.routed_experts.shape[1], self.routed_experts.shape[2])

    def on_layers(self, layers: tuple[int, ...] | None, where: str = "Trajectory") -> Trajectory:
        """This trajectory with routes on decoder layers ``layers`` only (None: as it is): itself
        when they are there already (or it has no routes), else a copy whose routes are those
        columns of its routes on every layer (one copy of them). ``ValueError`` naming ``where``
        for routes on another layer set or without one of ``layers``."""
        routes, have = self.routed_experts, self.route_layers
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
        """Check against a model (each bound only when given): token ids ``< vocab_size``, expert
        ids ``< num_experts``, routes' ``(num_layers, top_k) == route_schema``; ``ValueError``
        naming the field otherwise. One pass over the ids and routes (a ``max`` each)."""
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
            )

    def equal(self, other: object) -> bool:
        """Same values and dtypes in every field."""
        if not isinstance(other, Trajectory):
            return False
        if (self.reward, self.advantage) != (other.reward, other.advantage):
            return False
        for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine.dtype != theirs.dtype or not torch.equal(mine, theirs):
                return False
        a, b = self.routed_experts, other.routed_experts
        if a is None or b is None:
            return a is b
        return a.dtype == b.dtype and self.route_layers == other.route_layers and torch.equal(a, b)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return self.equal(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        r = self.routed_experts
        routes = "None" if r is None else f"{tuple(r.shape)} {r.dtype}"
        routes += "" if self.route_layers is None else f" on layers {list(self.route_layers)}"
        return (
            f"Trajectory(prompt={self.prompt_length}, response={self.response_length}, "
            f"reward={self.reward:g}, advantage={self.advantage:g}, routed_experts={routes})"
        )

    @classmethod
    def _trusted(
        cls,
        prompt_ids: Tensor,
        response_ids: Tensor,
        loss_mask: Tensor,
        rollout_logprobs: Tensor,
        reward: float,
        advantage: float,
        routed_experts: Tensor | None,
        route_layers: tuple[int, ...] | None = None,
    ) -> Trajectory:
        """Build from fields already normalised by this class (placeholders): no checks."""
        out = cls.__new__(cls)
        out.prompt_ids, out.response_ids = prompt_ids, response_ids
        out.loss_mask, out.rollout_logprobs = loss_mask, rollout_logprobs
        out.reward, out.advantage = reward, advantage
        out.routed_experts, out.route_layers = routed_experts, route_layers
        return out


def padding_trajectories(
    count: int,
    *,
    pad_token_id: int = 0,
    route_schema: tuple[int, int] | None = None,
    num_experts: int | None = None,
    route_layers: tuple[int, ...] | None = None,
) -> list[Trajectory]:
    """``count`` placeholders that add work but no loss: one ``pad_token_id`` prompt token, empty
    response, reward and advantage 0. With ``route_schema`` and ``num_experts`` each gets one
    :func:`~r3lightning.align.dummy.dummy_routes` row (consecutive rows, spreading over all
    experts) on ``route_layers``; with a schema but no ``num_experts``, zero rows (routed natively)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    routes: list[Tensor | None]
    if route_schema is None:
        routes = [None] * count
    elif num_experts is None:
        routes = [torch.empty((0, *route_schema), dtype=torch.uint8)] * count
    else:
        rows = dummy_routes(count, route_schema[0], route_schema[1], num_experts)  # [count, L, K]
        routes = [rows[i : i + 1] for i in range(count)]
    prompt = torch.tensor([pad_token_id], dtype=torch.int64)
    nothing_i = torch.empty(0, dtype=torch.int64)
    nothing_f = torch.empty(0, dtype=torch.float32)
    fields = (prompt, nothing_i, nothing_f, nothing_f, 0.0, 0.0)
    return [Trajectory._trusted(*fields, r, route_layers) for r in routes]
