"""What every part of the job shares: its user-facing error, the launcher's rank, and the HTTP
calls of weight syncs to every engine."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp


class JobError(Exception):
    """A problem the user can fix (configuration, engine address); reported as one line."""


def is_global_zero() -> bool:
    """Rank 0 of a (possibly not yet launched) multi-process run, from the launcher's env vars."""
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    return rank == 0 and int(os.environ.get("NODE_RANK", "0")) == 0


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header of ``api_key`` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def post_all(urls: list[str], timeout_s: float, post: Callable[[Any, str], Awaitable[None]]) -> None:
    """``post(session, url)`` to every engine concurrently, in one ``aiohttp`` session."""

    async def post_all() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            await asyncio.gather(*(post(session, url) for url in urls))

    asyncio.run(post_all())
