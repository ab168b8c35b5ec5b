"""Where one step's requests go: the collector's clients, built once from URLs or taken as given,
and a per-step dispatch that sends group ``g`` to engine ``g % E`` and, once an engine exhausts its
retries, moves that engine's groups to the engines still up for the rest of the step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.prompts import SamplingConfig, sampling_seed
from r3lightning.rollout.stats import EnginesUnavailableError, StepCounters, outage
from r3lightning.wire.errors import RetriesExhaustedError
from r3lightning.wire.request import RemoteGenerateResult

__all__ = ["StepDispatch", "build_clients", "gather_or_cancel"]

# the collector's logger: users filter its "engine is out" warnings by that name
logger = logging.getLogger("r3lightning.rollout.collector")
T = TypeVar("T")


async def gather_or_cancel(work: Iterable[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` that cancels (and awaits) the other tasks when one fails.

    Args:
        work: The awaitables, each wrapped in a task at once.

    Returns:
        Their results, in order.

    Raises:
        BaseException: The first failure, once every other task has ended.
    """
    jobs = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*jobs)
    except BaseException:
        for job in jobs:  # gather leaves the others running
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        raise


def build_clients(
    engines: str | RemoteGenerateClient | Sequence[str | RemoteGenerateClient],
    options: Mapping[str, Any],
    max_connections: int,
) -> list[RemoteGenerateClient]:
    """One client per engine.

    Args:
        engines: Engine URLs and/or configured clients (kept as they are); each URL at most once.
        options: Keyword arguments of every client built from a URL.
        max_connections: The connection cap of every client built from a URL.

    Returns:
        The clients, in the order of ``engines``.

    Raises:
        ValueError: No engine, or an engine URL named twice.
        TypeError: An engine that is neither a URL nor a `RemoteGenerateClient`.
    """
    if isinstance(engines, str | RemoteGenerateClient):
        engines = [engines]
    if not engines:
        raise ValueError("engines must name at least one engine URL or client")
    clients: list[RemoteGenerateClient] = []
    for engine in engines:
        if isinstance(engine, str):
            engine = RemoteGenerateClient(engine, **options)
            engine.max_connections = max_connections
        elif not isinstance(engine, RemoteGenerateClient):
            raise TypeError(f"engines: expected a URL or a RemoteGenerateClient, got {type(engine).__name__}")
        clients.append(engine)
    urls = [c.base_url for c in clients]
    if len(set(urls)) != len(urls):
        raise ValueError(f"engines: each URL at most once, got {urls}")
    return clients


class StepDispatch:
    """The requests of one rank for one step, at most ``max_in_flight`` at a time.

    An engine whose retries are exhausted is out until the step ends: it is logged once, and only
    its groups move (to ``up[g % len(up)]`` of the engines still up), so the others keep theirs.
    One event loop; not thread-safe.

    Args:
        clients: The collector's clients.
        sampling: The sampling settings of every request.
        seed: The collector's seed, hashed with step, group, sample and turn per request.
        step: The RL step.
        max_in_flight: The most requests waiting at once.
        request_routes: Ask every engine for routes.
        counters: The step's counters, updated per request.
    """

    def __init__(
        self,
        clients: list[RemoteGenerateClient],
        sampling: SamplingConfig,
        *,
        seed: int,
        step: int,
        max_in_flight: int,
        request_routes: bool,
        counters: StepCounters,
    ) -> None:
        self.clients = clients
        self.sampling = sampling
        self.seed = seed
        self.step = step
        self.request_routes = request_routes
        self.counters = counters
        self.out: dict[int, BaseException] = {}  # engine index -> the error that took it out
        self._slots = asyncio.Semaphore(max_in_flight)

    async def generate(
        self, group: int, index: int, tokens: list[int], turn: int, start: int | None
    ) -> RemoteGenerateResult:
        """One turn of one sample, on its group's engine or, that one being out, another.

        Args:
            group: The group's global index.
            index: The sample's index in its group.
            tokens: The prompt's token ids.
            turn: The turn's index (0 for single-turn), part of the sampling seed.
            start: The first prompt token whose route row is wanted (None: no routes).

        Returns:
            The engine's result.

        Raises:
            EnginesUnavailableError: Every engine is out.
            RemoteGenerateError: A failure that is not retried (a rejected request, a malformed
                response).
        """
        step = self.step
        seed = sampling_seed(self.seed, step, group, index, turn)
        out = self.out
        while True:
            async with self._slots:
                engine = group % len(self.clients)
                if engine in out:  # only the groups of an engine that is out move
                    up = [e for e in range(len(self.clients)) if e not in out]
                    if not up:
                        raise EnginesUnavailableError(
                            step, {self.clients[e].base_url: out[e] for e in sorted(out)}
                        )
                    engine = up[group % len(up)]
                client = self.clients[engine]
                self.counters.requests += 1
                try:
                    result = await client.generate(
                        tokens,
                        self.sampling.wire_params(client.protocol, seed),
                        return_routed_experts=self.request_routes,
                        routed_experts_prompt_start=start,
                    )
                except RetriesExhaustedError as exc:
                    self.counters.attempts += exc.attempts
                    self.counters.engine_errors += 1
                    if engine not in out:
                        out[engine] = exc
                        logger.warning(
                            f"rollout engine {client.base_url} is out for step {step}: {outage(exc)}; "
                            "its requests go to the other engines"
                        )
                    continue
            self.counters.attempts += result.attempts
            return result
