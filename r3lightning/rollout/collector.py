"""``RolloutCollector``: prompts -> rollout engines -> scored GRPO groups -> a ``ReplayBuffer``.

The public way a training loop (the main job's, or a user's own) collects one RL step of
rollouts, routes included, from one or more engines over HTTP:

    collector = RolloutCollector(["http://engine-a:30000", "http://engine-b:30000"], reward_fn,
                                 group_size=8, num_layers=48, top_k=8, num_experts=128)
    rollouts = collector.collect(prompts, step=step, buffer=buffer)   # or await collect_async(...)

Many ranks: every rank passes the step's *global* prompt list and collects only the whole GRPO
groups it will train on (:meth:`RolloutCollector.assigned_groups`: a contiguous block of
``num_groups / world_size`` groups), so routes never cross ranks; only a few scalar statistics
are all-reduced. Which group goes to which rank and every sampling seed
(:func:`~r3lightning.rollout.prompts.sampling_seed`) are pure functions of ``(seed, step, group index, sample index)``: a run
samples the same trajectories on 1, 2 or 4 ranks and whatever the request timing.

Several engines: group ``g`` goes to engine ``g % n`` of the ``n`` engines (all samples of a
group on one engine, which shares their prompt's KV cache) or, while that one is out, to the
``g % m``-th of the ``m`` still up; groups of healthy engines never move. An engine whose request
exhausts its retries (:class:`~r3lightning.wire.errors.RetriesExhaustedError`) is out for the
rest of the step and that request, like every later one, goes to the others; with every engine
out the step fails with :class:`EnginesUnavailableError`. Other errors (a 4xx, a malformed body)
are bugs, not outages, and fail the step at once. An SGLang router is one URL like any other.

Scoring: ``reward_fn(prompt, response_ids)`` -> a float, or a mapping with a ``"score"`` entry
(what verl's ``compute_score`` may return); a coroutine function is awaited. With
``reward_threads > 0`` a plain function runs in a thread pool of that size, so slow rewards
(a verifier, a sandbox) overlap with generation; :func:`~r3lightning.rollout.prompts.text_reward` adapts a verl-style
``compute_score(data_source, solution_str, ground_truth, extra_info=None)``. The per-prompt
metadata those need travels in :class:`~r3lightning.rollout.prompts.RolloutPrompt`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from r3lightning.correction.grpo import group_advantages
from r3lightning.data.trajectory import Trajectory
from r3lightning.rollout.client import RemoteGenerateClient, RemoteGenerateResult
from r3lightning.rollout.environment import Environment
from r3lightning.rollout.episode import Episode, plain_call, run_episode
from r3lightning.rollout.prompts import RewardFn, RolloutPrompt, SamplingConfig, sampling_seed, score_value
from r3lightning.rollout.stats import RolloutStats, StepCounters, reduce_step_stats
from r3lightning.trace import RoutedExpertTrace
from r3lightning.wire.errors import RemoteGenerateError, RetriesExhaustedError

if TYPE_CHECKING:
    from r3lightning.data.buffer import ReplayBuffer

__all__ = ["CollectedRollouts", "EnginesUnavailableError", "RolloutCollector"]


@dataclass
class CollectedRollouts:
    """This rank's share of one step: ``trajectories`` group after group (``group_size`` each),
    ``groups`` the global index of each, and the step's global ``stats``."""

    trajectories: list[Trajectory]
    groups: list[int]
    stats: RolloutStats


class EnginesUnavailableError(RemoteGenerateError):
    """Every engine of the collector exhausted its retries within one step.

    ``errors`` maps each engine's URL to the error that took it out.
    """

    def __init__(self, step: int, errors: Mapping[str, BaseException]):
        detail = "; ".join(f"{url}: {err}" for url, err in errors.items())
        super().__init__(f"all {len(errors)} rollout engine(s) failed at step {step}: {detail}")
        self.errors = dict(errors)


class RolloutCollector:
    """Collects, scores and groups one RL step's rollouts from one or more engines.

    Args:
        engines: engine URL(s) and/or configured :class:`RemoteGenerateClient` (s). URLs get a
            client with ``protocol``, the route schema, ``max_connections=max_in_flight`` and
            ``client_options``; each engine's requests use its own client's protocol.
        reward_fn: ``(prompt: RolloutPrompt, response_ids: list[int]) -> float | {"score": float}``
            (or a coroutine function).
        group_size: samples per prompt (a GRPO group, >= 2; kept whole on one rank).
        sampling: the requests' sampling settings (the seed is :func:`sampling_seed`'s).
        num_layers, top_k, num_experts: the route schema (every decoder layer, dense included);
            routes are requested when ``request_routes`` and checked against it.
        normalize_std: GRPO advantages divide by the group's reward std (False: Dr. GRPO).
        seed: the run's seed.
        max_in_flight: this rank's requests in flight over all engines.
        reward_threads: > 0 runs a plain ``reward_fn`` in a thread pool of that size.
        process_group: the data-parallel group the groups are spread over (default: the
            default group when ``torch.distributed`` is initialised, else a single rank).
        progress: show a progress bar (rank 0 of the group only).

    Cost per step: host-side only; each rank holds its own trajectories' routes in the
    engine's compact dtype and exchanges one all-reduce of a few scalars.
    """

    def __init__(
        self,
        engines: str | RemoteGenerateClient | Sequence[str | RemoteGenerateClient],
        reward_fn: RewardFn | None,
        *,
        group_size: int,
        sampling: SamplingConfig | None = None,
        protocol: str = "skyrl",
        num_layers: int | None = None,
        top_k: int | None = None,
        num_experts: int | None = None,
        request_routes: bool = True,
        normalize_std: bool = True,
        seed: int = 0,
        max_in_flight: int = 64,
        reward_threads: int = 0,
        client_options: Mapping[str, Any] | None = None,
        process_group: Any = None,
        progress: bool = True,
        environment: Callable[[], Environment] | None = None,
        max_turns: int = 1,
    ) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
            raise ValueError(f"group_size must be an integer >= 2 (GRPO groups), got {group_size!r}")
        for name, value, low in (("max_in_flight", max_in_flight, 1), ("reward_threads", reward_threads, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if environment is None and not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        if environment is not None and (reward_fn is not None or not callable(environment)):
            raise ValueError(
                "environment must be a factory (a class or a partial) building one environment per "
                "trajectory, and reward_fn None: the environment's step rewards are the reward"
            )
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        if request_routes and (num_layers is None or top_k is None):
            raise ValueError("request_routes=True needs num_layers and top_k (the route schema)")
        if isinstance(engines, str | RemoteGenerateClient):
            engines = [engines]
        if not engines:
            raise ValueError("engines must name at least one engine URL or client")
        options = dict(client_options or {})
        self.clients: list[RemoteGenerateClient] = []
        for engine in engines:
            if isinstance(engine, RemoteGenerateClient):
                self.clients.append(engine)
            elif isinstance(engine, str):
                kwargs = {"max_connections": max_in_flight, **options}
                self.clients.append(
                    RemoteGenerateClient(
                        engine,
                        protocol=protocol,  # type: ignore[arg-type]
                        num_layers=num_layers,
                        top_k=top_k,
                        num_experts=num_experts,
                        **kwargs,
                    )
                )
            else:
                raise TypeError(
                    f"engines: expected a URL or a RemoteGenerateClient, got {type(engine).__name__}"
                )
        urls = [c.base_url for c in self.clients]
        if len(set(urls)) != len(urls):
            raise ValueError(f"engines: each URL at most once, got {urls}")
        self.reward_fn = reward_fn
        self.group_size = group_size
        self.sampling = sampling if sampling is not None else SamplingConfig()
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.request_routes = request_routes
        self.normalize_std = normalize_std
        self.seed = seed
        self.max_in_flight = max_in_flight
        self.reward_threads = reward_threads
        self.process_group = process_group
        self.progress = progress
        self.environment, self.max_turns = environment, max_turns
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ ranks

    def _ranks(self) -> tuple[int, int]:
        """(rank, world size) in the collector's process group."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

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

    # ------------------------------------------------------------------ collection

    def collect(
        self,
        prompts: Sequence[RolloutPrompt | Sequence[int]],
        *,
        step: int,
        buffer: ReplayBuffer | None = None,
    ) -> CollectedRollouts:
        """Synchronous :meth:`collect_async` (runs its own event loop; the clients' sessions are
        closed before it ends)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("collect() cannot run inside a running event loop; use await collect_async()")

        async def run() -> CollectedRollouts:
            try:
                return await self.collect_async(prompts, step=step, buffer=buffer)
            finally:
                await self._close_clients()

        return asyncio.run(run())

    async def collect_async(
        self,
        prompts: Sequence[RolloutPrompt | Sequence[int]],
        *,
        step: int,
        buffer: ReplayBuffer | None = None,
    ) -> CollectedRollouts:
        """Collect this rank's groups of step ``step`` and add them to ``buffer`` (if given).

        ``prompts``: the step's global prompt list, the same on every rank (token-id lists or
        :class:`RolloutPrompt`); group ``g`` is ``group_size`` samples of ``prompts[g]``. A
        failure on any rank raises on every rank (after the statistics' all-reduce).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        items = [p if isinstance(p, RolloutPrompt) else RolloutPrompt(p) for p in prompts]
        rank, world = self._ranks()
        mine = self.assigned_groups(len(items), rank, world)
        start = time.perf_counter()
        counters = StepCounters()
        error: BaseException | None = None
        trajectories: list[Trajectory] = []
        try:
            trajectories = await self._collect_groups(items, mine, step, counters, show=rank == 0)
        except Exception as exc:
            if world == 1:
                raise
            error = exc
        stats = reduce_step_stats(
            step,
            len(items),
            trajectories,
            counters,
            time.perf_counter() - start,
            error is not None,
            world_size=world,
            group=self.process_group,
        )
        if error is not None:
            raise error
        if buffer is not None:
            buffer.extend(trajectories)
        return CollectedRollouts(trajectories, list(mine), stats)

    async def _collect_groups(
        self, prompts: list[RolloutPrompt], groups: range, step: int, counters: StepCounters, show: bool
    ) -> list[Trajectory]:
        slots = asyncio.Semaphore(self.max_in_flight)
        out: dict[int, BaseException] = {}  # engine index -> the error that took it out this step
        bar = _progress_bar(len(groups) * self.group_size, f"rollout step {step}", self.progress and show)
        counters.turns = [[0.0, 0.0, 0.0] for _ in range(self.max_turns)]

        async def generate(group: int, index: int, tokens: list[int], turn: int, start: int | None):
            seed = sampling_seed(self.seed, step, group, index, turn)
            while True:
                async with slots:
                    engine = group % len(self.clients)
                    if engine in out:  # only the groups of an engine that is out move
                        up = [e for e in range(len(self.clients)) if e not in out]
                        if not up:
                            raise EnginesUnavailableError(
                                step, {self.clients[e].base_url: out[e] for e in out}
                            )
                        engine = up[group % len(up)]
                    client = self.clients[engine]
                    counters.requests += 1
                    try:
                        result = await client.generate(
                            tokens,
                            self.sampling.wire_params(client.protocol, seed),
                            return_routed_experts=self.request_routes,
                            routed_experts_prompt_start=start,
                        )
                    except RetriesExhaustedError as exc:
                        counters.attempts += exc.attempts
                        counters.engine_errors += 1
                        if engine not in out:
                            out[engine] = exc
                            warnings.warn(
                                f"rollout engine {client.base_url} is out for step {step}: {exc}; "
                                "its requests go to the other engines",
                                RuntimeWarning,
                                stacklevel=2,
                            )
                        continue
                counters.attempts += result.attempts
                return result

        async def sample(group: int, index: int) -> Episode:
            prompt, where = prompts[group], f"group {group} sample {index} of step {step}"
            if self.environment is None:
                start = 0 if self.request_routes else None
                result = await generate(group, index, prompt.token_ids, 0, start)
                reward = score_value(await self._call(self.reward_fn, prompt, result.response_ids), where)
                episode = _single_turn(prompt, result, reward, self._trace())
            else:
                run = functools.partial(generate, group, index)
                episode = await run_episode(
                    self.environment(),
                    prompt,
                    run,
                    max_turns=self.max_turns,
                    trace=self._trace(),
                    call=self._call,
                    where=where,
                )
            bar.update(1)
            return episode

        async def whole_group(group: int) -> list[Episode]:
            jobs = [asyncio.ensure_future(sample(group, j)) for j in range(self.group_size)]
            try:
                return await asyncio.gather(*jobs)
            except Exception as exc:
                for job in jobs:
                    job.cancel()
                await asyncio.gather(*jobs, return_exceptions=True)
                if self.environment is None or isinstance(exc, EnginesUnavailableError):
                    raise
                counters.dropped_groups += 1  # one failed turn drops the whole group, never part of it
                warnings.warn(f"group {group} of step {step} dropped: {exc}", RuntimeWarning, stacklevel=2)
                return []

        jobs = [asyncio.ensure_future(whole_group(g)) for g in groups]
        try:
            kept = await asyncio.gather(*jobs)
        except BaseException:
            for job in jobs:  # gather leaves the others running: stop them before raising
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            raise
        finally:
            bar.close()
        if groups and not any(kept):
            raise RuntimeError(f"every group of step {step} was dropped (see the warnings for each error)")
        trajectories = []
        for episodes in filter(None, kept):  # dropped groups are empty
            rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)  # [group_size]
            advantages = group_advantages(rewards, self.group_size, normalize_std=self.normalize_std)
            for episode, advantage in zip(episodes, advantages.tolist(), strict=True):
                counters.add_turns(episode.turn_rewards, episode.route_bytes)
                trajectories.append(episode.trajectory(advantage))
        counters.engines_out = len(out)
        return trajectories

    def _trace(self) -> RoutedExpertTrace | None:
        return (
            RoutedExpertTrace(self.num_layers, self.top_k, self.num_experts) if self.request_routes else None
        )

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``: awaited if a coroutine function, in the ``reward_threads`` pool if plain
        and the pool exists (a reward or an environment method), else inline."""
        if not self.reward_threads or inspect.iscoroutinefunction(fn):
            return await plain_call(fn, *args)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.reward_threads, thread_name_prefix="r3-reward")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------ statistics

    # ------------------------------------------------------------------ engines and lifecycle

    async def check_engines_async(self) -> dict[str, bool]:
        """Whether each engine answers ``GET /health`` (one attempt each, concurrently)."""
        answers = await asyncio.gather(*(c.health() for c in self.clients))
        return {c.base_url: ok for c, ok in zip(self.clients, answers, strict=True)}

    def check_engines(self) -> dict[str, bool]:
        """Synchronous :meth:`check_engines_async`."""

        async def run() -> dict[str, bool]:
            try:
                return await self.check_engines_async()
            finally:
                await self._close_clients()

        return asyncio.run(run())

    async def _close_clients(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def aclose(self) -> None:
        """Close the clients' HTTP sessions and the reward thread pool."""
        await self._close_clients()
        self.close()

    def close(self) -> None:
        """Shut the reward thread pool down (the clients of :meth:`collect` close themselves)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def __aenter__(self) -> RolloutCollector:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        urls = [c.base_url for c in self.clients]
        return f"RolloutCollector({urls}, group_size={self.group_size}, seed={self.seed})"


def _single_turn(
    prompt: RolloutPrompt, result: RemoteGenerateResult, reward: float, trace: RoutedExpertTrace | None
) -> Episode:
    response = list(result.response_ids)
    episode = Episode(prompt.token_ids, response, [1.0] * len(response), turn_rewards=[reward])
    episode.logprobs = result.response_logprobs  # None: the trajectory's default zeros
    routes = result.routed_experts
    episode.route_bytes = [0 if routes is None else int(routes.nbytes)]
    if trace is not None:
        trace.record_generation(len(prompt.token_ids), len(response), routes)
        episode.routes = trace.finalize(len(prompt.token_ids) + len(response))
    return episode


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled, dynamic_ncols=True)
