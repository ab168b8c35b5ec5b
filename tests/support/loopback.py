"""Scripted engines on 127.0.0.1: the aiohttp app each serves within ``async with``, an engine
that never answers, and an engine served from a background thread for tests that block."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, Self

from aiohttp import web


class LoopbackServer:
    """Serves the app ``add_routes`` fills on a free 127.0.0.1 port within ``async with``; ``url``
    is its address from entry on."""

    url = ""
    _runner: web.AppRunner | None = None

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        app = web.Application()
        self.add_routes(app)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@contextlib.asynccontextmanager
async def hung_engine() -> AsyncIterator[str]:
    """A loopback engine that accepts connections and never answers (requests or /health)."""
    connections = []

    async def never_answer(reader, writer):
        connections.append(writer)
        await reader.read()  # until the client gives up and closes

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()


@contextlib.contextmanager
def served_in_thread(server: Any) -> Iterator[None]:
    """Serve the async-context ``server`` from its own event loop in a daemon thread within ``with``
    (for ranks in other processes while the test blocks on them); ``server.url`` is set on entry."""
    loop, started, stop = asyncio.new_event_loop(), threading.Event(), threading.Event()

    async def serve():
        async with server:
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.01)

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    started.wait(10)
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
