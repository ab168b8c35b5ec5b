"""``RolloutCollector``: prompts -> rollout engines -> scored groups -> advantages -> a ``ReplayBuffer``
(the recipes page "Several engines and many ranks" has how groups meet engines and ranks)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from r3lightning.checks import check_setting
from r3lightning.data.trajectory import Trajectory
from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.config import CollectorConfig, route_schema
from r3lightning.rollout.environment import Environments
from r3lightning.rollout.episode import Episode, plain_call, run_episode, single_turn
from r3lightning.rollout.prompts import RewardFn, RolloutPrompt, SamplingConfig, sampling_seed, score_value
from r3lightning.rollout.stats import (
    CollectedRollouts,
    EnginesUnavailableError,
    GroupsDroppedError,
    StepCounters,
    outage,
    reduce_step_stats,
)
from r3lightning.rollout.trace import RoutedExpertTrace
from r3lightning.wire.errors import RetriesExhaustedError
from r3lightning.wire.request import RouteSchema

if TYPE_CHECKING:
    from r3lightning.data.buffer import ReplayBuffer

__all__ = ["AdvantageFn", "CollectedRollouts", "EnginesUnavailableError", "RolloutCollector"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# One group's rewards, float64 [group_size] in sample order, -> their advantages [group_size]
AdvantageFn = Callable[[Tensor], Tensor]


async def _gather_or_cancel(work: Iterable[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` that cancels (and awaits) the other tasks when one fails, then raises."""
    jobs = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*jobs)
    except BaseException:
        for job in jobs:  # gather leaves the others running
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        raise


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
    through ``advantages``, and every sample becomes a [`Trajectory`][r3lightning.data.trajectory.Trajectory]
    with its routes. Under ``torch.distributed`` every rank collects only its own block of whole
    groups. Cost per step: host-side only, and one all-reduce of a few scalars; no device sync.

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
        if isinstance(engines, str | RemoteGenerateClient):
            engines = [engines]
        if not engines:
            raise ValueError("engines must name at least one engine URL or client")
        options = {"protocol": config.protocol, "schema": self.schema, **(client_options or {})}
        self.clients: list[RemoteGenerateClient] = []
        for engine in engines:
            if isinstance(engine, str):
                engine = RemoteGenerateClient(engine, **options)
                engine.max_connections = config.max_in_flight
            elif not isinstance(engine, RemoteGenerateClient):
                raise TypeError(
                    f"engines: expected a URL or a RemoteGenerateClient, got {type(engine).__name__}"
                )
            self.clients.append(engine)
        urls = [c.base_url for c in self.clients]
        if len(set(urls)) != len(urls):
            raise ValueError(f"engines: each URL at most once, got {urls}")
        self.reward_fn = reward_fn
        self.advantages = advantages
        self.environments = reward_fn if isinstance(reward_fn, Environments) else None
        self.config = config
        self.sampling = sampling if sampling is not None else SamplingConfig()
        self.process_group = process_group
        self._pool: ThreadPoolExecutor | None = None

    @staticmethod
    def assigned_groups(num_groups: int, rank: int, world_size: int) -> range:
        """The global indices of the groups rank ``rank`` collects: a contiguous block, the same
        size on every rank (so every rank trains the same number of steps)."""
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
        buffer: ReplayBuffer | None = None,
        weight_version: int | None = None,
    ) -> CollectedRollouts:
        """Synchronous `collect_async` (on its own event loop)."""
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
        buffer: ReplayBuffer | None = None,
        weight_version: int | None = None,
    ) -> CollectedRollouts:
        """Collect this rank's groups of step ``step`` and add them to ``buffer`` (if given).
        ``prompts``: the step's global list, the same on every rank; group ``g`` samples
        ``prompts[g]``. ``weight_version``: the policy version the engines were synced to, recorded on
        every trajectory whose engine reports none (vLLM), checked against the one an engine reports. A failure on any rank raises on every rank (after the stats'
        all-reduce)."""
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
        slots = asyncio.Semaphore(self.config.max_in_flight)
        out: dict[int, BaseException] = {}  # engine index -> the error that took it out this step
        from tqdm.auto import tqdm  # a transitive dependency, slow to import: only when collecting

        total = len(groups) * self.config.group_size
        bar = tqdm(
            total=total, desc=f"rollout step {step}", leave=False, disable=not show, dynamic_ncols=True
        )
        envs = self.environments
        dropped: dict[int, Exception] = {}  # group -> the error that dropped it

        async def generate(group: int, index: int, tokens: list[int], turn: int, start: int | None):
            seed = sampling_seed(self.config.seed, step, group, index, turn)
            while True:
                async with slots:
                    engine = group % len(self.clients)
                    if engine in out:  # only the groups of an engine that is out move
                        up = [e for e in range(len(self.clients)) if e not in out]
                        if not up:
                            raise EnginesUnavailableError(
                                step, {self.clients[e].base_url: out[e] for e in sorted(out)}
                            )
                        engine = up[group % len(up)]
                    client = self.clients[engine]
                    counters.requests += 1
                    try:
                        result = await client.generate(
                            tokens,
                            self.sampling.wire_params(client.protocol, seed),
                            return_routed_experts=self.config.request_routes,
                            routed_experts_prompt_start=start,
                        )
                    except RetriesExhaustedError as exc:
                        counters.attempts += exc.attempts
                        counters.engine_errors += 1
                        if engine not in out:
                            out[engine] = exc
                            logger.warning(
                                f"rollout engine {client.base_url} is out for step {step}: {outage(exc)}; "
                                "its requests go to the other engines"
                            )
                        continue
                counters.attempts += result.attempts
                return result

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
                return await _gather_or_cancel(sample(group, j) for j in range(self.config.group_size))
            except Exception as exc:
                if envs is None or isinstance(exc, EnginesUnavailableError):
                    raise
                counters.dropped_groups += 1  # one failed turn drops the whole group, never part of it
                dropped[group] = exc
                logger.warning("group %d of step %d dropped: %s", group, step, exc)
                return []

        try:
            kept = await _gather_or_cancel(whole_group(g) for g in groups)
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
        counters.engines_out = len(out)
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
