"""``RolloutCollector``: prompts -> rollout engines -> scored groups -> advantages -> a ``ReplayBuffer``
(the recipes page "Several engines and many ranks" has how groups meet engines and ranks)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from r3lightning.checks import check_setting
from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.config import CollectorConfig, route_schema
from r3lightning.rollout.dispatch import StepDispatch, build_clients, gather_or_cancel
from r3lightning.rollout.environment import Environments
from r3lightning.rollout.episode import Episode, plain_call, run_episode, single_turn
from r3lightning.rollout.prompts import RewardFn, RolloutPrompt, SamplingConfig, score_value
from r3lightning.rollout.stats import (
    CollectedRollouts,
    EnginesUnavailableError,
    GroupsDroppedError,
    StepCounters,
    reduce_step_stats,
)
from r3lightning.rollout.trace import RoutedExpertTrace
from r3lightning.rollout.trajectory import Trajectory, TrajectorySink
from r3lightning.wire.request import RouteSchema

__all__ = ["AdvantageFn", "CollectedRollouts", "EnginesUnavailableError", "RolloutCollector"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# One group's rewards, float64 [group_size] in sample order, -> their advantages [group_size]
AdvantageFn = Callable[[Tensor], Tensor]


def _record_version(episode: Episode, served: int | None, step: int) -> None:
    """The policy version the engines were synced to (``served``) on an episode whose engine sent
    none; an engine that answered with another one serves stale weights: ``RuntimeError``."""
    if served is None:
        return
    if episode.weight_version is None:
        episode.weight_version = served
    elif episode.weight_version != served:
        raise RuntimeError(
            f"a rollout of step {step} came from engine weight version {episode.weight_version}, but the "
            f"engines were synced to version {served}: an engine serves stale weights"
        )


class RolloutCollector:
    """Collects, scores and groups one RL step's rollouts from one or more engines.

    Each prompt is sampled ``config.group_size`` times; the group's rewards become advantages
    through ``advantages``, and every sample becomes a [`Trajectory`][r3lightning.rollout.trajectory.Trajectory]
    with its routes. Under ``torch.distributed`` every rank collects only its own block of whole
    groups. Cost per step: host-side work, and two all-reduces of a few float64s (`collect_async`).
    One step at a time: the clients serve one event loop at a time.

    Args:
        engines: Engine URLs (each gets a [`RemoteGenerateClient`][r3lightning.rollout.client.RemoteGenerateClient]
            with ``config.protocol``, ``schema`` and ``client_options``) and/or configured clients;
            each URL at most once.
        reward_fn: ``(prompt, response_ids) -> float | {"score": float}`` (sync or async), or
            [`Environments`][r3lightning.rollout.environment.Environments] for multi-turn episodes.
        config: The collector's settings.
        advantages: One group's rewards, float64 ``[group_size]`` in sample order, to their
            advantages ``[group_size]``. The collector applies no algorithm of its own: the job
            passes GRPO's ([`GRPOAdvantages`][r3lightning.app.job.algorithm.GRPOAdvantages]).
        schema: A ``RouteSchema`` (with ``layers``: only those decoder layers' routes are kept) or
            the model's config; needed when ``config.request_routes``.
        sampling: The sampling settings of every request (default: ``SamplingConfig()``).
        client_options: Keyword arguments of every client built from a URL, such as
            ``retry=RetryPolicy(...)`` (how an engine is given up on) or ``api_key``.
        process_group: The data-parallel group (default: the world).

    Raises:
        TypeError: ``config`` is not a ``CollectorConfig``, or ``reward_fn`` or ``advantages`` is
            not callable.
        ValueError: No engine, an engine named twice, or ``config.request_routes`` without a
            complete route schema.
    """

    def __init__(
        self,
        engines: str | RemoteGenerateClient | Sequence[str | RemoteGenerateClient],
        reward_fn: RewardFn | Environments,
        config: CollectorConfig,
        *,
        advantages: AdvantageFn,
        schema: RouteSchema | Mapping[str, Any] | Any = None,
        sampling: SamplingConfig | None = None,
        client_options: Mapping[str, Any] | None = None,
        process_group: Any = None,
    ) -> None:
        if not isinstance(config, CollectorConfig):
            raise TypeError(f"config must be a CollectorConfig, got {type(config).__name__}")
        if not callable(reward_fn) and not isinstance(reward_fn, Environments):
            raise TypeError(f"reward_fn must be callable or Environments, got {type(reward_fn).__name__}")
        if not callable(advantages):
            raise TypeError(f"advantages must be callable, got {type(advantages).__name__}")
        self.schema = None if schema is None else route_schema(schema)
        if config.request_routes and (
            self.schema is None or None in (self.schema.num_layers, self.schema.top_k)
        ):
            raise ValueError(
                "request_routes=True needs the route schema: schema=RouteSchema(num_layers, top_k, "
                "num_experts) or the model's config"
            )
        options = {"protocol": config.protocol, "schema": self.schema, **(client_options or {})}
        self.clients = build_clients(engines, options, config.max_in_flight)
        self.reward_fn = reward_fn
        self.advantages = advantages
        self.environments = reward_fn if isinstance(reward_fn, Environments) else None
        self.config = config
        self.sampling = sampling if sampling is not None else SamplingConfig()
        self.process_group = process_group
        self._pool: ThreadPoolExecutor | None = None

    @staticmethod
    def assigned_groups(num_groups: int, rank: int, world_size: int) -> range:
        """The global indices of the groups one rank collects: a contiguous block, the same size on
        every rank, so every rank trains the same number of steps.

        Args:
            num_groups: The step's groups (one per prompt).
            rank, world_size: The rank and the size of the data-parallel group.

        Returns:
            ``range(rank * per_rank, (rank + 1) * per_rank)``.

        Raises:
            ValueError: ``num_groups`` does not divide evenly by ``world_size``.
        """
        if num_groups % world_size:
            raise ValueError(
                f"the step's {num_groups} prompts (groups) must divide evenly among {world_size} ranks, "
                "so every rank trains on the same number of whole groups"
            )
        per_rank = num_groups // world_size
        return range(rank * per_rank, (rank + 1) * per_rank)

    def collect(
        self,
        prompts: Sequence[RolloutPrompt | Sequence[int]],
        *,
        step: int,
        buffer: TrajectorySink | None = None,
        weight_version: int | None = None,
    ) -> CollectedRollouts:
        """`collect_async` run to its end on a new event loop, which closes the clients' sessions.

        Args:
            prompts, step, buffer, weight_version: As for `collect_async`.

        Returns:
            This rank's `CollectedRollouts`.

        Raises:
            RuntimeError: Called inside a running event loop (await `collect_async` there).
        """
        work = functools.partial(
            self.collect_async, prompts, step=step, buffer=buffer, weight_version=weight_version
        )
        return self._run_closing("collect", work)

    def _run_closing(self, name: str, work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` on a new event loop that closes the clients' sessions before it ends."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(f"{name}() cannot run inside a running event loop; use await {name}_async()")

        async def run() -> T:
            try:
                return await work()
            finally:
                await self._close_clients()

        return asyncio.run(run())

    async def collect_async(
        self,
        prompts: Sequence[RolloutPrompt | Sequence[int]],
        *,
        step: int,
        buffer: TrajectorySink | None = None,
        weight_version: int | None = None,
    ) -> CollectedRollouts:
        """Collect this rank's groups of one step and add them to ``buffer``.

        Under ``torch.distributed`` every rank must call it with the same ``prompts``; a failure on any
        rank raises on every rank, after the stats' all-reduces (others raise ``OtherRankFailedError``).
        Host-side work only, plus two all-reduces of a few float64s (with NCCL on the current GPU, read
        back: a sync).

        Args:
            prompts: The step's global list, the same on every rank: group ``g`` samples ``prompts[g]``
                ``config.group_size`` times. Token id lists are wrapped as `RolloutPrompt`.
            step: The RL step (>= 0), hashed into every sampling seed.
            buffer: Where the trajectories go: a [`ReplayBuffer`][r3lightning.data.buffer.ReplayBuffer]
                or any `TrajectorySink` (None: only returned).
            weight_version: The policy version the engines were synced to (>= 0): recorded on every
                trajectory whose engine reports none (vLLM), checked against the one an engine reports.

        Returns:
            ``trajectories`` group after group, the global ``groups`` they sample, and the step's
            global ``stats``.

        Raises:
            ValueError: A bad ``step`` or ``weight_version``, a prompt count that does not divide among
                the ranks, or a reward or advantage that is not a finite number.
            EnginesUnavailableError: Every engine exhausted its retries within the step.
            GroupsDroppedError: With environments, every group was dropped by a failing turn.
            RuntimeError: An engine answered with weights other than ``weight_version``.
            RemoteGenerateError: A request the engine rejected or answered malformed.
        """
        check_setting("step", step, low=0, integer=True)
        check_setting("weight_version", weight_version, low=0, integer=True, optional=True)
        items = [p if isinstance(p, RolloutPrompt) else RolloutPrompt(p) for p in prompts]
        group = self.process_group
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank(group) if distributed else 0
        world = dist.get_world_size(group) if distributed else 1
        mine = self.assigned_groups(len(items), rank, world)
        start = time.perf_counter()
        counters = StepCounters()
        error: BaseException | None = None
        trajectories: list[Trajectory] = []
        show = rank == 0 and self.config.progress
        try:
            trajectories = await self._collect_groups(items, mine, step, counters, show, weight_version)
        except Exception as exc:
            if world == 1:
                raise
            error = exc
        seconds = time.perf_counter() - start
        failed = error is not None
        stats = reduce_step_stats(
            step, len(items), trajectories, counters, seconds, failed, world_size=world, group=group
        )
        if error is not None:
            raise error
        if buffer is not None:
            buffer.extend(trajectories)
        return CollectedRollouts(trajectories, list(mine), stats)

    async def _collect_groups(
        self,
        prompts: list[RolloutPrompt],
        groups: range,
        step: int,
        counters: StepCounters,
        show: bool,
        weight_version: int | None,
    ) -> list[Trajectory]:
        from tqdm.auto import tqdm  # a transitive dependency, slow to import: only when collecting

        total = len(groups) * self.config.group_size
        bar = tqdm(
            total=total, desc=f"rollout step {step}", leave=False, disable=not show, dynamic_ncols=True
        )
        envs = self.environments
        dispatch = StepDispatch(
            self.clients,
            self.sampling,
            seed=self.config.seed,
            step=step,
            max_in_flight=self.config.max_in_flight,
            request_routes=self.config.request_routes,
            counters=counters,
        )
        generate = dispatch.generate
        dropped: dict[int, Exception] = {}  # group -> the error that dropped it

        async def sample(group: int, index: int) -> Episode:
            prompt = prompts[group]
            where = f"group {group} sample {index} of step {step}"
            if envs is None:
                start = 0 if self.config.request_routes else None
                result = await generate(group, index, prompt.token_ids, 0, start)
                reward = score_value(await self._call(self.reward_fn, prompt, result.response_ids), where)
                episode = single_turn(prompt, result, reward, self._trace())
            else:
                opts = {"max_turns": envs.max_turns, "trace": self._trace(), "timeout_s": envs.timeout_s}
                run = functools.partial(generate, group, index)
                episode = await run_episode(envs.make(), prompt, run, call=self._call, where=where, **opts)
            bar.update(1)
            return episode

        async def whole_group(group: int) -> list[Episode]:
            try:
                return await gather_or_cancel(sample(group, j) for j in range(self.config.group_size))
            except Exception as exc:
                if envs is None or isinstance(exc, EnginesUnavailableError):
                    raise
                counters.dropped_groups += 1  # one failed turn drops the whole group, never part of it
                dropped[group] = exc
                logger.warning("group %d of step %d dropped: %s", group, step, exc)
                return []

        try:
            kept = await gather_or_cancel(whole_group(g) for g in groups)
        finally:
            bar.close()
        if groups and not any(kept):
            raise GroupsDroppedError(step, dropped)
        trajectories = []
        # missing_rows=drop_trajectory: a trajectory with a missing route row stays (its reward is its
        # group's baseline) but leaves the loss
        drop_missing = self.schema is not None and self.schema.missing_rows == "drop_trajectory"
        for episodes in filter(None, kept):  # dropped groups are empty
            rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)  # [group_size]
            advantages = self._group_advantages(rewards)
            for episode, advantage in zip(episodes, advantages.tolist(), strict=True):
                counters.add_turns(episode.turn_rewards, episode.route_bytes)
                _record_version(episode, weight_version, step)
                layers = self.schema and self.schema.layers
                trajectories.append(episode.trajectory(advantage, layers, drop_missing=drop_missing))
        counters.engines_out = len(dispatch.out)
        return trajectories

    def _group_advantages(self, rewards: Tensor) -> Tensor:
        """``self.advantages(rewards)``, refused unless one finite number per sample comes back."""
        advantages = self.advantages(rewards)
        if not isinstance(advantages, Tensor) or advantages.shape != rewards.shape:
            got = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
            raise ValueError(f"advantages must return a tensor of shape {tuple(rewards.shape)}, got {got}")
        if not bool(torch.isfinite(advantages).all()):
            raise ValueError(
                f"advantages must be finite, got {advantages.tolist()} for rewards {rewards.tolist()}"
            )
        return advantages

    def _trace(self) -> RoutedExpertTrace | None:
        if not self.config.request_routes:
            return None
        s = self.schema
        return RoutedExpertTrace(s.num_layers if s.layers is None else len(s.layers), s.top_k, s.num_experts)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A reward or environment method: in the ``reward_threads`` pool if plain, else awaited."""
        if not self.config.reward_threads or inspect.iscoroutinefunction(fn):
            return await plain_call(fn, *args)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.reward_threads, thread_name_prefix="r3-reward")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def check_engines_async(self) -> dict[str, bool]:
        """Whether each engine answers ``GET /health`` (one attempt each, concurrently)."""
        answers = await asyncio.gather(*(c.health() for c in self.clients))
        return {c.base_url: ok for c, ok in zip(self.clients, answers, strict=True)}

    def check_engines(self) -> dict[str, bool]:
        """Synchronous `check_engines_async`."""
        return self._run_closing("check_engines", self.check_engines_async)

    async def _close_clients(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def aclose(self) -> None:
        """Close the clients' HTTP sessions and the reward thread pool."""
        await self._close_clients()
        self.close()

    def close(self) -> None:
        """Shut the reward thread pool down (the clients of `collect` close themselves)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def __aenter__(self) -> RolloutCollector:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"RolloutCollector({[c.base_url for c in self.clients]}, {self.config})"
