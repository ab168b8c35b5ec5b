"""The HTTP calls every weight sync makes: the bearer header, and one concurrent POST per engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from r3lightning.app.job.build import one_line
from r3lightning.wire.errors import RemoteGenerateError

__all__ = ["bearer_headers", "post_all"]


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """The HTTP headers that authenticate a call to an engine.

    Args:
        api_key: The engines' bearer token; None or empty: they need none.

    Returns:
        ``{"Authorization": "Bearer <api_key>"}``, or an empty dict without a key.
    """
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def post_all(urls: list[str], timeout_s: float, post: Callable[[Any, str], Awaitable[None]]) -> None:
    """Runs ``post(session, url)`` for every engine concurrently, in one ``aiohttp`` session.

    Blocks the calling thread until every engine answered (it runs its own event loop).

    Args:
        urls: The engines' base URLs.
        timeout_s: Limit of each HTTP call, from connecting to reading its answer.
        post: The calls to one engine, given the shared ``aiohttp.ClientSession`` and its URL.

    Raises:
        RemoteGenerateError: An engine did not answer (connection refused or reset, or no answer
            within ``timeout_s``); the first such engine is named, and the job exits with status 3.
        JobError: Whatever ``post`` raises for an answer it refuses, as it raised it.
    """

    async def guarded(session: aiohttp.ClientSession, url: str) -> None:
        try:
            await post(session, url)
        except (aiohttp.ClientError, TimeoutError) as exc:  # an engine gone since its health check
            reason = one_line(exc) or f"no answer within {timeout_s:g}s"
            raise RemoteGenerateError(
                f"weight update at {url} failed: {type(exc).__name__}: {reason}; is the engine still running?"
            ) from None

    async def run() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            await asyncio.gather(*(guarded(session, url) for url in urls))

    asyncio.run(run())
