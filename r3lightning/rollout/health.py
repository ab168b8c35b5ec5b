"""Noticing an engine that accepts connections but never answers, sooner than ``timeout_s`` would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from r3lightning.rollout.config import RetryPolicy
from r3lightning.wire.errors import RetryableGenerateError

__all__ = ["EngineHungError", "HealthWatch"]

T = TypeVar("T")


class EngineHungError(RetryableGenerateError):
    """The engine stopped answering ``GET /health`` while a request waited: not retried there."""


class HealthWatch:
    """Runs attempts while ``probe()`` is polled per ``policy``, and ends them when the engine stops
    answering. Bound to the event loop it first runs on until `reset`; not thread-safe. Cost: one
    small request per interval per engine, only while attempts wait.

    Args:
        probe: Returns the ``/health`` status, or None without an answer (any status, even 404,
            means alive).
        policy: ``health_interval_s`` (None: no probing), ``health_timeout_s`` and
            ``health_failures``.
    """

    def __init__(self, probe: Callable[[], Awaitable[int | None]], policy: RetryPolicy) -> None:
        self.probe = probe
        self.policy = policy
        self.reset()

    def reset(self) -> None:
        """Forget the event loop (a new loop, a pickled copy, a closed client)."""
        self._waiting = 0  # attempts in flight: the monitor runs while > 0
        self._monitor: asyncio.Task | None = None
        self._hung: asyncio.Future | None = None  # resolved by the monitor when the engine hangs

    def cancel(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        self.reset()

    async def run(self, attempt: Awaitable[T]) -> T:
        """Await one attempt under the watch.

        Args:
            attempt: The attempt's awaitable (cancelled when the engine is declared hung).

        Returns:
            ``attempt``'s result.

        Raises:
            EngineHungError: ``policy.health_failures`` probes in a row got no answer.
        """
        if self.policy.health_interval_s is None:
            return await attempt
        if self._hung is None or self._hung.done():
            self._hung = asyncio.get_running_loop().create_future()
        hung = self._hung
        self._waiting += 1
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.ensure_future(self._watch(hung))
        send = asyncio.ensure_future(attempt)
        try:
            await asyncio.wait((send, hung), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiting -= 1
            if not send.done():
                send.cancel()
                await asyncio.wait((send,))
        if not send.cancelled():
            return send.result()
        policy = self.policy
        raise EngineHungError(
            f"stopped answering GET /health ({policy.health_failures} probes in a row got no answer "
            f"within {policy.health_timeout_s:g} s)"
        )

    async def _watch(self, hung: asyncio.Future) -> None:
        failures = 0
        while self._waiting:
            await asyncio.sleep(self.policy.health_interval_s)
            if not self._waiting:
                return
            failures = 0 if await self.probe() is not None else failures + 1
            if failures >= self.policy.health_failures:
                hung.set_result(None)
                return
