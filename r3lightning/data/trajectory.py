"""``Trajectory``: one rollout (prompt + response tokens, per-token RL fields, captured routes).

A trajectory holds ``n = len(prompt_ids) + len(response_ids)`` real tokens. Per response token it
carries a loss mask (1 = the token is a loss target) and the logprob the rollout engine sampled it
with. ``routed_experts`` are the route rows the engine captured, ``[captured, num_layers, top_k]``
with ``captured <= n``: row ``t`` is the experts used when token ``t`` was an input (the final
token is never forwarded, so engines usually return ``n - 1`` rows). Rows past ``captured`` are
routed natively by the trainer.

Everything is normalised once, at construction, to CPU tensors the trajectory owns (inputs are
copied, never aliased): ids int64, masks and logprobs float32, routes in the compact dtype of
their largest expert id (uint8 / int16 / int32). Routes go through the route check
(:func:`~r3lightning.wire.route_check.check_routes`: at most one row per token, ids below 2**31,
``top_k`` distinct experts per row except all-zero dense-layer rows; about 10 ms for 32k x 48 x 8
ids). Checks against a model (vocabulary size, expert count, route schema) run in
:meth:`Trajectory.validate`, which the replay buffer calls on insert.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from r3lightning.align.dummy import dummy_routes
from r3lightning.routes import compact_route_dtype
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
        raise ValueError(
            f"Trajectory.{name} must have one entry per response token ({count}), "
            f"got shape {tuple(values.shape)}"
        )
    if values.is_complex():
        raise TypeError(f"Trajectory.{name} must be real, got dtype {values.dtype}")
    values = values.to(torch.float32)
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        bad = int(torch.nonzero(~finite)[0, 0])
        raise ValueError(f"Trajectory.{name} must be finite, got {name}[{bad}] = {float(values[bad])}")
    if unit and values.numel() and not bool(((values >= 0) & (values <= 1)).all()):
        bad = int(torch.nonzero((values < 0) | (values > 1))[0, 0])
        raise ValueError(
            f"Trajectory.{name} must hold values in [0, 1], got {name}[{bad}] = {float(values[bad])}"
        )
    return values


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


def _routes(data: Any, num_tokens: int) -> Tensor:
    """``data`` through the route check (shape, at most one row per token, ids in int32 range,
    distinct experts per row), in the compact dtype of its largest id."""
    routes = _as_host_tensor("routed_experts", data)
    if routes.dtype == torch.bool or routes.is_floating_point() or routes.is_complex():
        raise TypeError(f"Trajectory.routed_experts must hold integer expert ids, got dtype {routes.dtype}")
    high = check_routes(
        routes.numpy(),
        rows=range(num_tokens + 1),
        rows_rule=f"at most one per token, {num_tokens} (len(prompt_ids) + len(response_ids))",
        where="Trajectory.routed_experts",
    )
    return routes.to(compact_route_dtype(high)).contiguous()


class Trajectory:
    """One rollout, validated and normalised to compact CPU tensors.

    Args:
        prompt_ids: ``[P]`` token ids, ``P >= 1`` (the first response token is predicted from
            the prompt's last position).
        response_ids: ``[R]`` sampled token ids, ``R >= 0``.
        loss_mask: ``[R]`` per response token in [0, 1], 1 = loss target; defaults to all ones.
        rollout_logprobs: ``[R]`` logprob of each response token under the rollout engine;
            defaults to zeros (no engine logprobs).
        reward: scalar reward of the whole trajectory.
        advantage: scalar advantage; defaults to ``reward`` (a baseline-free estimate). GRPO
            callers pass the group-normalised value.
        routed_experts: ``[captured, num_layers, top_k]`` captured route rows, ``captured <= n``,
            or ``None`` when the engine returned no routes (native routing for every token).

    Raises:
        TypeError / ValueError naming the field and the expected value.
    """

    __slots__ = (
        "advantage",
        "loss_mask",
        "prompt_ids",
        "response_ids",
        "reward",
        "rollout_logprobs",
        "routed_experts",
    )

    prompt_ids: Tensor  # [P] int64
    response_ids: Tensor  # [R] int64
    loss_mask: Tensor  # [R] float32
    rollout_logprobs: Tensor  # [R] float32
    reward: float
    advantage: float
    routed_experts: Tensor | None  # [captured, L, K] uint8 / int16 / int32

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
        self.routed_experts = None if routed_experts is None else _routes(routed_experts, self.num_tokens)

    # ------------------------------------------------------------------------ properties

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

    # ------------------------------------------------------------------------ validation

    def validate(
        self,
        *,
        vocab_size: int | None = None,
        num_experts: int | None = None,
        route_schema: tuple[int, int] | None = None,
    ) -> None:
        """Check the trajectory against a model; ``ValueError`` naming the field otherwise.

        Token ids must be ``< vocab_size``, expert ids ``< num_experts``, and the routes'
        ``(num_layers, top_k)`` equal ``route_schema`` (each check only when the bound is given;
        the routes go through :func:`~r3lightning.wire.route_check.check_routes`). One pass over
        the ids and routes (a ``max`` each).
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
            )

    # ------------------------------------------------------------------------ equality, repr

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
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return self.equal(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        routes = (
            "None"
            if self.routed_experts is None
            else f"{tuple(self.routed_experts.shape)} {self.routed_experts.dtype}"
        )
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
    ) -> Trajectory:
        """Build from fields already normalised by this class (checkpoint restore): no checks."""
        out = cls.__new__(cls)
        out.prompt_ids, out.response_ids = prompt_ids, response_ids
        out.loss_mask, out.rollout_logprobs = loss_mask, rollout_logprobs
        out.reward, out.advantage, out.routed_experts = reward, advantage, routed_experts
        return out


def padding_trajectories(
    count: int,
    *,
    pad_token_id: int = 0,
    route_schema: tuple[int, int] | None = None,
    num_experts: int | None = None,
) -> list[Trajectory]:
    """``count`` placeholder trajectories that add work but no loss.

    Each is one ``pad_token_id`` prompt token with an empty response (so a zero loss mask), reward
    and advantage 0. With a ``route_schema`` and ``num_experts`` each gets one route row from
    :func:`~r3lightning.align.dummy.dummy_routes`; consecutive placeholders take consecutive rows,
    so they spread over all experts instead of piling onto the first ``top_k``. With a schema but
    no ``num_experts`` each gets zero route rows (routed natively by the trainer).
    """
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
    return [Trajectory._trusted(prompt, nothing_i, nothing_f, nothing_f, 0.0, 0.0, r) for r in routes]
