"""RemoteGenerateClient sessions: event loops, threads, pickling, ``async with``, concurrency."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest
from fault_server import FaultServer
from rollout_support import check_result, generate, make_client

from r3lightning import RemoteGenerateClient


async def test_hundreds_of_concurrent_requests():
    async with FaultServer() as server, make_client(server) as client:
        client.max_connections = 32
        client.decode_in_thread_bytes = 0  # every body is decoded in a worker thread
        prompts = [[i % 97, i % 89 + 1, 3] for i in range(300)]
        results = await asyncio.gather(
            *(generate(client, prompt=p, n=1 + i % 5) for i, p in enumerate(prompts))
        )
        for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
            check_result(result, prompt=prompt, n=1 + i % 5)
        assert client.stats.requests == client.stats.attempts == 300
        assert 1 < server.max_in_flight <= 32


def test_pickled_client_works_in_a_fresh_event_loop():
    async def serve_and_use(client: RemoteGenerateClient | None) -> RemoteGenerateClient:
        async with FaultServer() as server:
            client = make_client(server) if client is None else client
            client.base_url = server.url
            check_result(await generate(client))
            assert client._session is not None and not client._session.closed
            await client.close()
            return client

    first = asyncio.run(serve_and_use(None))
    clone = pickle.loads(pickle.dumps(first))
    assert clone._session is None and clone.stats.requests == 1  # counters travel with the pickle
    asyncio.run(serve_and_use(clone))
    assert clone.stats.requests == 2 and first.stats.requests == 1


@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_session_of_a_finished_loop_is_replaced():
    server_loop = asyncio.new_event_loop()
    server = server_loop.run_until_complete(FaultServer().__aenter__())
    client = make_client(server)

    async def use() -> object:
        check_result(await generate(client))
        return client._session

    try:
        # each asyncio.run ends its loop with the session still open; the next one must notice
        sessions = []
        for _ in range(2):
            worker = asyncio.new_event_loop()
            try:
                task = worker.create_task(use())
                while not task.done():  # serve and use on one thread, alternating the two loops
                    worker.run_until_complete(asyncio.sleep(0.001))
                    server_loop.run_until_complete(asyncio.sleep(0.001))
                sessions.append(task.result())
            finally:
                worker.close()
        assert sessions[0] is not sessions[1] and sessions[0].closed
    finally:
        server_loop.run_until_complete(server.__aexit__(None, None, None))
        server_loop.close()


def test_a_second_event_loop_is_told_the_client_is_in_use():
    """One client shared by two threads: the second loop gets a clear error, not a broken session."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="rollout-thread", daemon=True)
    thread.start()

    def on_loop(coro, timeout=60.0):  # generous: a loaded machine
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    server = on_loop(FaultServer().__aenter__())
    client = make_client(server)
    try:
        check_result(on_loop(generate(client)))  # the session now belongs to rollout-thread's loop
        with pytest.raises(RuntimeError, match="in use by another event loop \\(thread 'rollout-thread'\\)"):
            asyncio.run(generate(client))
        check_result(on_loop(generate(client)))  # the first loop's session is untouched
        assert client.stats.failures == 0
        clone = pickle.loads(pickle.dumps(client))  # what the message recommends

        async def use_clone():
            async with clone:
                check_result(await generate(clone))

        asyncio.run(use_clone())
        on_loop(client.close())
        asyncio.run(use_clone())  # closed on its loop: another loop may take it over
    finally:
        on_loop(server.__aexit__(None, None, None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def test_async_with_closes_the_session():
    async with FaultServer() as server:
        async with make_client(server) as client:
            await generate(client)
            session = client._session
        assert session.closed and client._session is None
        check_result(await generate(client))  # reopens lazily
        await client.close()
