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
    """The ``Authorization`` header of ``api_key`` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def post_all(urls: list[str], timeout_s: float, post: Callable[[Any, str], Awaitable[None]]) -> None:
    """``post(session, url)`` to every engine concurrently, in one ``aiohttp`` session; an engine that
    does not answer is a ``RemoteGenerateError`` (the job's exit status 3) naming it."""

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
