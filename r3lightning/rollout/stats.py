"""One rollout step's outcome: its trajectories and statistics (reduced over ranks), or why it failed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from r3lightning.rollout.trajectory import Trajectory
from r3lightning.wire.errors import RemoteGenerateError

__all__ = [
    "CollectedRollouts",
    "EnginesUnavailableError",
    "GroupsDroppedError",
    "OtherRankFailedError",
    "RolloutStats",
    "StepCounters",
    "outage",
    "reduce_step_stats",
]


@dataclass
class RolloutStats:
    """One step's statistics summed over *all* ranks (``engines_out``, ``rollout_s``: the largest).

    ``attempts``: HTTP attempts, retries included; ``engine_errors``: requests that exhausted an
    engine's retries and went to another engine; ``dropped_groups``: GRPO groups a failing
    environment turn took out. ``turn_rewards[k]``, ``turn_route_bytes[k]``: means over the kept
    trajectories that reached turn ``k`` (0: the first); ``turns``: the mean number of turns.
    """

    groups: int
    trajectories: int
    reward_mean: float
    reward_std: float  # unbiased, over every trajectory of the step
    response_length_mean: float
    requests: int
    attempts: int
    engine_errors: int
    engines_out: int
    rollout_s: float
    dropped_groups: int = 0
    turns: float = 0.0
    turn_rewards: tuple[float, ...] = ()
    turn_route_bytes: tuple[float, ...] = ()

    def as_dict(self) -> dict[str, float]:
        """Every field as a float, the per-turn ones as in `turn_metrics`."""
        scalars = {k: float(v) for k, v in asdict(self).items() if not isinstance(v, tuple)}
        return {**scalars, **self.turn_metrics()}

    def turn_metrics(self) -> dict[str, float]:
        """``turns``, ``dropped_groups``, ``turn_reward/turn_{k}`` and ``route_bytes/turn_{k}`` (k from 1)."""
        out = {"turns": self.turns, "dropped_groups": float(self.dropped_groups)}
        for k, (reward, size) in enumerate(zip(self.turn_rewards, self.turn_route_bytes, strict=True), 1):
            out[f"turn_reward/turn_{k}"] = reward
            out[f"route_bytes/turn_{k}"] = size
        return out


class GroupsDroppedError(RuntimeError):
    """Every group of a step was dropped by a failing environment turn.

    Raised by `RolloutCollector.collect_async` when environments are used and no group survived.

    Args:
        step: The RL step.
        errors: Each dropped group's error (the message names the first group's).

    Attributes:
        errors: ``group -> error``.
    """

    def __init__(self, step: int, errors: Mapping[int, BaseException]):
        group, first = next(iter(sorted(errors.items(), key=lambda item: item[0])))
        super().__init__(
            f"every group of step {step} was dropped; group {group}: {type(first).__name__}: {first} "
            "(the log has each group's error)"
        )
        self.errors = dict(errors)


class OtherRankFailedError(RuntimeError):
    """Collection failed on another rank of the step (that rank raises its own error)."""


@dataclass
class CollectedRollouts:
    """This rank's share of one step, as `RolloutCollector.collect_async` returns it.

    Args:
        trajectories: This rank's trajectories, group after group (``group_size`` each).
        groups: The global index of each of this rank's groups, in order.
        stats: The step's statistics over every rank.
    """

    trajectories: list[Trajectory]
    groups: list[int]
    stats: RolloutStats


class EnginesUnavailableError(RemoteGenerateError):
    """Every engine of the collector exhausted its retries within one step.

    Raised by `RolloutCollector.collect_async` (on every rank) once the last engine still up is
    out; a `RemoteGenerateError`, so ``except RemoteGenerateError`` catches it.

    Args:
        step: The RL step.
        errors: Each engine's URL and the `RetriesExhaustedError` that took it out; the message
            has one short clause per engine.

    Attributes:
        errors: ``url -> error``.
    """

    def __init__(self, step: int, errors: Mapping[str, BaseException]):
        detail = "; ".join(f"{url}: {outage(err)}" for url, err in errors.items())
        super().__init__(f"all {len(errors)} rollout engine(s) failed at step {step}: {detail}")
        self.errors = dict(errors)


def outage(error: BaseException) -> str:
    """Why an engine is out, in a clause: ``HTTP 503 after 5 attempt(s)``, ``timed out ...``, etc.

    Args:
        error: Usually a `RetriesExhaustedError`; its ``last_error`` and that error's cause decide.

    Returns:
        The clause.
    """
    last = getattr(error, "last_error", error)
    cause = last.__cause__
    if getattr(last, "status", None) is not None:
        what = f"HTTP {last.status}"
    elif isinstance(cause, TimeoutError):
        what = "timed out"
    elif isinstance(cause, OSError):
        what = "connection failed"
    else:
        what = str(last) if cause is None else type(cause).__name__
    attempts = getattr(error, "attempts", None)
    return what if attempts is None else f"{what} after {attempts} attempt(s)"


@dataclass
class StepCounters:
    """One rank's request counters for one step."""

    requests: int = 0
    attempts: int = 0
    engine_errors: int = 0
    engines_out: int = 0
    dropped_groups: int = 0
    # per turn index of the kept trajectories: [trajectories, reward sum, route bytes sum]; as many
    # entries as the longest trajectory has turns (never max_turns: most episodes end far earlier)
    turns: list[list[float]] = field(default_factory=list)

    def add_turns(self, rewards: list[float], route_bytes: list[int]) -> None:
        """Count one kept trajectory's turns.

        Args:
            rewards: Its reward per turn.
            route_bytes: The route payload bytes received per turn.
        """
        self.turns += [[0.0, 0.0, 0.0] for _ in range(len(rewards) - len(self.turns))]
        for k, (reward, size) in enumerate(zip(rewards, route_bytes, strict=True)):
            self.turns[k] = [a + b for a, b in zip(self.turns[k], (1, reward, size), strict=True)]


def reduce_step_stats(
    step: int,
    num_groups: int,
    trajectories: list[Trajectory],
    counters: StepCounters,
    seconds: float,
    failed: bool,
    *,
    world_size: int,
    group: Any = None,
) -> RolloutStats:
    """The step's statistics over every rank of ``group``.

    Args:
        step: The RL step.
        num_groups: The step's groups over all ranks.
        trajectories: This rank's kept trajectories.
        counters: This rank's counters.
        seconds: This rank's collection time.
        failed: Whether collection failed on this rank.
        world_size: Ranks in ``group``; 1 reduces nothing.
        group: The process group (None: the world).

    Returns:
        The statistics, equal on every rank. Cost with ``world_size > 1``: one MAX and one SUM
        all-reduce of a few float64s (on the current GPU with NCCL, read back: a sync).

    Raises:
        OtherRankFailedError: Another rank reported ``failed`` and this one did not.
    """
    c = counters
    rewards = [t.reward for t in trajectories]
    lengths = sum(t.response_length for t in trajectories)
    maxima = torch.tensor([c.engines_out, seconds, len(c.turns)], dtype=torch.float64)
    device = torch.device("cpu")
    if world_size > 1:
        import torch.distributed as dist

        # NCCL reduces only GPU tensors
        if "nccl" in str(dist.get_backend(group)).lower():
            device = torch.device("cuda", torch.cuda.current_device())
        maxima = maxima.to(device)
        dist.all_reduce(maxima, dist.ReduceOp.MAX, group=group)
    engines_out, rollout_s, num_turns = maxima.tolist()
    # every rank sums per-turn counters up to the turn the longest trajectory of any rank reached
    per_turn = [v for turn in c.turns for v in turn] + [0.0] * (3 * (int(num_turns) - len(c.turns)))
    per_rank = [len(rewards), sum(rewards), sum(r * r for r in rewards), lengths, c.requests, c.attempts]
    per_rank += [c.engine_errors, failed, c.dropped_groups, *per_turn]
    sums = torch.tensor(per_rank, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(sums, dist.ReduceOp.SUM, group=group)
    count, reward_sum, reward_sq, lengths, requests, attempts, errors, failures, dropped, *turns = (
        sums.tolist()
    )
    if failures and not failed:
        raise OtherRankFailedError(
            f"rollout collection failed on {int(failures)} other rank(s) at step {step}; see their errors"
        )
    n = max(count, 1)  # every sum is 0 without trajectories
    mean = reward_sum / n
    var = (reward_sq - count * mean * mean) / (count - 1) if count > 1 else 0.0
    reached = turns[0::3]  # per turn: trajectories that reached it, reward sum, route bytes sum
    return RolloutStats(
        groups=num_groups,
        trajectories=int(count),
        reward_mean=mean,
        reward_std=math.sqrt(max(var, 0.0)),
        response_length_mean=lengths / n,
        requests=int(requests),
        attempts=int(attempts),
        engine_errors=int(errors),
        engines_out=int(engines_out),
        rollout_s=rollout_s,
        dropped_groups=int(dropped),
        turns=sum(reached) / n,
        turn_rewards=tuple(r / max(k, 1) for k, r in zip(reached, turns[1::3], strict=True)),
        turn_route_bytes=tuple(b / max(k, 1) for k, b in zip(reached, turns[2::3], strict=True)),
    )
