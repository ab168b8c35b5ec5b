"""One trajectory: engine turns and environment observations, routes captured turn by turn (the
multi-turn page has the row arithmetic). Observation tokens get loss mask 0 and logprob 0."""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor

from r3lightning.rollout.client import RemoteGenerateResult
from r3lightning.rollout.environment import Environment
from r3lightning.rollout.prompts import (
    RolloutPrompt,
    as_messages,
    chat_prompt_ids,
    in_daemon_thread,
    score_value,
    token_id_list,
)
from r3lightning.rollout.trace import RoutedExpertTrace
from r3lightning.rollout.trajectory import Trajectory

__all__ = ["Episode", "plain_call", "run_episode", "single_turn"]

# (token ids of the whole prefix, turn index, first route row wanted or None) -> the engine's answer
Generate = Callable[[list[int], int, "int | None"], Awaitable[RemoteGenerateResult]]
Call = Callable[..., Awaitable[Any]]


@dataclass
class Episode:
    """A finished trajectory before its group's advantages."""

    prompt_ids: list[int]  # the first observation
    response_ids: list[int] = field(default_factory=list)  # [R] responses and later observations
    loss_mask: list[float] = field(default_factory=list)  # [R] 1 sampled, 0 observed
    logprobs: list[float] = field(default_factory=list)  # [R] the engine's (NaN if none); 0 observed
    turn_rewards: list[float] = field(default_factory=list)  # [turns]
    route_bytes: list[int] = field(default_factory=list)  # [turns] route payload bytes received
    routes: Tensor | None = None  # [n - 1, L, K] (L: the layers kept)
    weight_version: int | None = None  # the oldest engine weight version of its turns

    @property
    def reward(self) -> float:
        return sum(self.turn_rewards)

    def trajectory(
        self, advantage: float, route_layers: tuple[int, ...] | None = None, *, drop_missing: bool = False
    ) -> Trajectory:
        """The episode as a `Trajectory`.

        Args:
            advantage: Its group's advantage for this sample.
            route_layers: The decoder layers the routes hold (None: all).
            drop_missing: Take it out of the loss (loss mask 0) when a route row is missing (-1).

        Returns:
            The trajectory (its validation runs, with the route check).
        """
        dropped = drop_missing and self.routes is not None and bool((self.routes < 0).any())  # -1: missing
        return Trajectory(
            self.prompt_ids,
            self.response_ids,
            loss_mask=[0.0] * len(self.loss_mask) if dropped else self.loss_mask,
            rollout_logprobs=self.logprobs,
            reward=self.reward,
            advantage=advantage,
            routed_experts=self.routes,
            route_layers=None if self.routes is None else route_layers,
            weight_version=self.weight_version,
        )

    def extend(self, ids: list[int], mask: float, logprobs: Sequence[float] | None) -> None:
        """Append tokens with one loss-mask value and their logprobs.

        Args:
            ids: The tokens.
            mask: 1.0 for sampled tokens, 0.0 for observed ones.
            logprobs: One per token, or None: sampled tokens then get NaN (a 0.0 would read as
                probability 1 in a PPO ratio or an IS weight), observed tokens 0.
        """
        self.response_ids += ids
        self.loss_mask += [mask] * len(ids)
        missing = math.nan if mask else 0.0
        self.logprobs += [missing] * len(ids) if logprobs is None else list(logprobs)

    def record(self, trace: RoutedExpertTrace | None, prefix: int, result: RemoteGenerateResult) -> list[int]:
        """Append one generation: its tokens, logprobs, routes and route bytes.

        Args:
            trace: Where the routes go (None: none requested).
            prefix: The tokens the generation continued.
            result: The engine's answer; its weight version lowers the episode's (the oldest counts).

        Returns:
            The response ids as Python ints.

        Raises:
            ValueError: Routes of the wrong row count or schema (from the trace).
        """
        response = [int(t) for t in result.response_ids]
        routes = result.routed_experts
        if trace is not None:
            trace.record_generation(prefix, len(response), routes)
        self.route_bytes.append(0 if routes is None else int(routes.nbytes))
        version = result.weight_version
        if version is not None:  # the oldest: the staleness bound holds for every turn
            self.weight_version = (
                version if self.weight_version is None else min(self.weight_version, version)
            )
        self.extend(response, 1.0, result.response_logprobs)
        return response

    def finish(self, trace: RoutedExpertTrace | None) -> Episode:
        """Finalize the routes over the whole trajectory.

        Args:
            trace: The trace of its turns (None: no routes).

        Returns:
            ``self``, with ``routes`` ``[captured, L, K]`` set.
        """
        if trace is not None:
            self.routes = trace.finalize(len(self.prompt_ids) + len(self.response_ids))
        return self


async def plain_call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a reward function or environment method, awaiting the result when it is awaitable.

    Args:
        fn: The callable, sync or async.
        *args: Its arguments.

    Returns:
        Its result.
    """
    value = fn(*args)
    return await value if inspect.isawaitable(value) else value


async def bounded_call(timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
    """An environment's ``reset`` or ``step`` (sync or async) within a deadline. A sync call runs in
    a daemon thread so a hang cannot hold the event loop (a thread that never returns is left
    behind); an async one is cancelled.

    Args:
        timeout_s: The deadline, in seconds.
        fn: The method.
        *args: Its arguments.

    Returns:
        Its result.

    Raises:
        TimeoutError: Past the deadline, naming the method.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        if inspect.iscoroutinefunction(fn):
            value = fn(*args)
        else:
            thread = in_daemon_thread(fn, *args, name="r3-environment")
            value = await asyncio.wait_for(asyncio.wrap_future(thread), timeout_s)
        if inspect.isawaitable(value):
            value = await asyncio.wait_for(value, max(deadline - loop.time(), 0.0))
    except TimeoutError:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise TimeoutError(f"{name}() did not return within {timeout_s:g} s (env_timeout_s)") from None
    return value


async def run_episode(
    env: Environment,
    prompt: RolloutPrompt,
    generate: Generate,
    *,
    max_turns: int,
    trace: RoutedExpertTrace | None,
    call: Call = plain_call,
    where: str = "trajectory",
    timeout_s: float | None = None,
) -> Episode:
    """Run one trajectory of ``env`` from ``prompt``, one request per turn; host-side only.

    Args:
        env: A fresh environment.
        prompt: The collector's prompt.
        generate: ``(prefix ids, turn, first route row or None) -> result``.
        max_turns: The most generations.
        trace: Captures the routes turn by turn (None: none requested).
        call: Runs an environment method (`plain_call`, or the collector's thread pool).
        where: Names the trajectory in errors.
        timeout_s: Bound each environment call with `bounded_call` instead of ``call``.

    Returns:
        The finished episode.

    Raises:
        ValueError: An empty first observation, a malformed ``step`` result, a non-bool ``done``,
            a bad reward, or routes that break the trace's rules.
        TimeoutError: An environment call past ``timeout_s``.
        RemoteGenerateError: From ``generate``; the trace is left unfinished.
    """
    if timeout_s is not None:
        call = functools.partial(bounded_call, timeout_s)
    episode = Episode(_token_ids(env, await call(env.reset, prompt), f"{where}: reset()"))
    if not episode.prompt_ids:
        raise ValueError(f"{where}: reset() must return a first observation of at least one token")
    tokens = list(episode.prompt_ids)
    for turn in range(max_turns):
        result = await generate(tokens, turn, None if trace is None else trace.prompt_start)
        response = episode.record(trace, len(tokens), result)
        answer = response
        if getattr(env, "response_format", "ids") == "text":
            answer = _tokenizer(env, where).decode(response, skip_special_tokens=True)
        step = await call(env.step, answer)
        if not isinstance(step, Sequence) or len(step) != 4:
            raise ValueError(
                f"{where}: step() must return (observation, reward, done, info), got {step!r:.120}"
            )
        observation, reward, done, _ = step
        episode.turn_rewards.append(score_value(reward, f"{where} turn {turn}"))
        if not isinstance(done, bool | np.bool_):  # a string such as "false" would count as true
            raise ValueError(f"{where} turn {turn}: step()'s done must be a bool, got {done!r:.60}")
        if done or turn == max_turns - 1:
            break
        observed = _token_ids(env, observation, f"{where}: step() observation of turn {turn}")
        episode.extend(observed, 0.0, None)
        tokens += response + observed
    return episode.finish(trace)


def single_turn(
    prompt: RolloutPrompt, result: RemoteGenerateResult, reward: float, trace: RoutedExpertTrace | None
) -> Episode:
    """The episode of a single-turn rollout: one generation, already scored.

    Args:
        prompt: The prompt.
        result: The engine's answer.
        reward: The score of the response.
        trace: Captures the routes (None: none requested).

    Returns:
        The finished episode.
    """
    episode = Episode(prompt.token_ids, turn_rewards=[reward])
    episode.record(trace, len(prompt.token_ids), result)
    return episode.finish(trace)


def _tokenizer(env: Any, where: str) -> Any:
    tokenizer = getattr(env, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            f"{where}: chat messages and response_format='text' need the environment's tokenizer "
            f"attribute, but {type(env).__name__} has none"
        )
    return tokenizer


def _token_ids(env: Any, observation: Any, where: str) -> list[int]:
    """Token ids of an observation: ids as they are, chat messages through the chat template."""
    if isinstance(observation, Sequence) and observation and isinstance(observation[0], Mapping):
        return chat_prompt_ids(_tokenizer(env, where), as_messages(observation, where=where))
    return token_id_list(observation, where, allow_empty=True)
