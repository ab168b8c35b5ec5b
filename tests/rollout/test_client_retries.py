"""RemoteGenerateClient retries, timeouts and health probing against real loopback servers: a
socket that accepts and never answers is a hung engine; a slow aiohttp server a healthy one."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import random
import socket
import time

import aiohttp
import pytest
from fault_server import CLOSE, DROP_MID_BODY, FaultServer, Slow, Status
from gloo_ranks import free_port
from loopback import hung_engine
from rollout_support import FAST, PROMPT, check_result, generate, make_client

from r3lightning import RemoteGenerateClient
from r3lightning.rollout.client import _retry_after
from r3lightning.rollout.config import Backoff, RetryPolicy
from r3lightning.wire.errors import RetriesExhaustedError, RetryableGenerateError

# ------------------------------------------------------------------ retries


@pytest.mark.parametrize(
    "fault",
    [Status(502, "bad gateway"), Status(500), Status(503), Status(408), DROP_MID_BODY, CLOSE],
    ids=["502", "500", "503", "408", "drop-mid-body", "close"],
)
@pytest.mark.parametrize("protocol", ["skyrl", "sglang"])
async def test_transient_fault_then_success(fault, protocol):
    async with FaultServer() as server, make_client(server, protocol) as client:
        server.script.extend([fault, fault])
        result = await generate(client)
        check_result(result)
        assert result.attempts == 3 and server.hits == 3
        assert (client.stats.attempts, client.stats.retries, client.stats.failures) == (3, 2, 0)


@pytest.mark.parametrize(
    "fault, cause",
    [
        (DROP_MID_BODY, aiohttp.ClientPayloadError),
        (CLOSE, aiohttp.ServerDisconnectedError),
        (Slow(0.5), TimeoutError),
    ],
    ids=["drop-mid-body", "close", "slow"],
)
async def test_what_each_transport_fault_looks_like(fault, cause):
    async with FaultServer() as server, make_client(server, max_attempts=1, timeout_s=0.2) as client:
        server.script.append(fault)
        with pytest.raises(RetriesExhaustedError) as info:
            await generate(client)
        assert info.value.attempts == 1 and client.stats.retries == 0
        assert isinstance(info.value.last_error, RetryableGenerateError)
        assert info.value.last_error.status is None
        assert isinstance(info.value.last_error.__cause__, cause)


async def test_retries_are_bounded():
    async with FaultServer() as server, make_client(server, max_attempts=4) as client:
        server.script.extend([Status(503, '{"error": {"message": "overloaded"}}')] * 10)
        with pytest.raises(RetriesExhaustedError, match="after 4 attempt") as info:
            await generate(client)
        assert info.value.attempts == 4 and server.hits == 4
        assert isinstance(info.value.last_error, RetryableGenerateError)
        assert info.value.last_error.status == 503
        assert "overloaded" in str(info.value.last_error)
        assert (client.stats.attempts, client.stats.retries, client.stats.failures) == (4, 3, 1)


async def test_retry_after_is_honoured():
    async with FaultServer() as server, make_client(server) as client:
        server.script.append(Status(429, "slow down", headers={"Retry-After": "0.3"}))
        began = time.perf_counter()
        result = await generate(client)
        elapsed = time.perf_counter() - began
        check_result(result)
        assert result.attempts == 2
        assert elapsed >= 0.3  # the backoff alone would wait at most 1 ms


async def test_retry_after_is_clipped():
    backoff = Backoff(base_s=0.001, cap_s=0.004, max_retry_after_s=0.01)
    async with FaultServer() as server, make_client(server, backoff=backoff) as client:
        server.script.append(Status(503, headers={"Retry-After": "3600"}))
        # bounded here: were the clip lost, this fails in 60 s instead of sleeping for an hour
        # (generous: a loaded machine must not fail it; the clip itself is 0.01 s)
        check_result(await asyncio.wait_for(generate(client), timeout=60.0))


async def test_slow_response_times_out_and_is_retried():
    async with FaultServer() as server, make_client(server, timeout_s=0.2, max_attempts=2) as client:
        server.script.append(Slow(0.5))
        result = await generate(client)
        assert result.attempts == 2
        check_result(result)
        server.script.extend([Slow(0.5), Slow(0.5)])
        with pytest.raises(RetriesExhaustedError) as info:
            await generate(client)
        assert "timed out" in str(info.value.last_error)


async def test_connection_refused_is_retried_then_exhausted():
    retry = RetryPolicy(backoff=FAST, max_attempts=3, timeout_s=2.0)
    client = RemoteGenerateClient(f"http://127.0.0.1:{free_port()}", retry=retry)
    with pytest.raises(RetriesExhaustedError) as info:
        await client.generate(PROMPT, {"max_tokens": 1})
    assert info.value.attempts == 3 and client.stats.attempts == 3
    assert isinstance(info.value.last_error.__cause__, OSError | ConnectionError) or "Connect" in str(
        info.value.last_error
    )
    await client.close()


def test_backoff_is_capped_exponential_with_full_jitter():
    backoff = Backoff(base_s=0.5, cap_s=3.0, jitter=1.0)
    rng = random.Random(0)
    for retry, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (10, 3.0)]:
        delays = [backoff.delay(retry, rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > 0.8 * ceiling and min(delays) < 0.2 * ceiling
    assert Backoff(base_s=0.5, cap_s=3.0, jitter=0.0).delay(3, rng) == 2.0
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter=1.5)


def test_retry_after_header_forms():
    assert _retry_after("2.5") == 2.5 and _retry_after("-3") == 0.0
    assert _retry_after(None) is None and _retry_after("soon") is None
    in_a_minute = email.utils.formatdate(time.time() + 60, usegmt=True)
    assert 55 < _retry_after(in_a_minute) <= 60
    assert _retry_after(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0


# ------------------------------------------------------------------ health


async def test_health():
    async with FaultServer() as server, make_client(server) as client:
        assert await client.health()
    dead = RemoteGenerateClient(f"http://127.0.0.1:{free_port()}", retry=RetryPolicy(timeout_s=1.0))
    assert not await dead.health()
    await dead.close()


async def test_health_of_a_hung_engine_fails_fast_despite_a_long_generate_timeout():
    async with (
        hung_engine() as url,
        RemoteGenerateClient(url, retry=RetryPolicy(health_timeout_s=0.2)) as client,
    ):
        assert (client.retry.timeout_s, client.retry.connect_timeout_s) == (600.0, 10.0)
        # the probe's 0.2 s, not the 600 s generate timeout; 60 s is generous for a loaded machine
        assert not await asyncio.wait_for(client.health(), timeout=60.0)


async def test_a_connection_that_never_completes_fails_after_the_connect_timeout():
    """A full accept queue on 127.0.0.1: the handshake never completes, so only the short
    connect timeout (not the long generate timeout) ends the attempt."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # accepts nothing: one queued connection fills it
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    retry = RetryPolicy(timeout_s=600.0, connect_timeout_s=0.3, max_attempts=1)
    client = RemoteGenerateClient(f"http://127.0.0.1:{port}", retry=retry)
    try:
        # the 0.3 s connect timeout, not the 600 s one; 60 s is generous for a loaded machine
        with pytest.raises(RetriesExhaustedError) as info:
            await asyncio.wait_for(client.generate(PROMPT, {"max_tokens": 1}), timeout=60.0)
        assert isinstance(info.value.last_error.__cause__, aiohttp.ConnectionTimeoutError)
    finally:
        await client.close()
        for sock in (*fillers, listener):
            sock.close()


async def _give_up_after(url: str, retry: RetryPolicy, requests: int = 3) -> tuple[float, list]:
    async with RemoteGenerateClient(url, retry=retry) as client:
        began = time.perf_counter()
        calls = (client.generate(PROMPT, {"max_tokens": 1}) for _ in range(requests))
        errors = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=300)
        return time.perf_counter() - began, errors


async def test_a_hung_engine_is_given_up_on_by_its_health_probes_not_the_long_timeout():
    retry = RetryPolicy(timeout_s=600, health_interval_s=0.2, health_timeout_s=0.2, health_failures=2)
    async with hung_engine() as url:
        elapsed, errors = await _give_up_after(url, retry)
    # two probes in a row, each 0.2 s apart and 0.2 s without an answer: ~0.8 s, never 600 s (the
    # upper bound is generous, for a loaded machine: it only tells the probes from the timeout)
    assert 0.75 <= elapsed < 120.0
    for error in errors:
        assert isinstance(error, RetriesExhaustedError) and error.attempts == 1  # not retried there
        assert str(error.last_error) == (
            "stopped answering GET /health (2 probes in a row got no answer within 0.2 s)"
        )


async def test_health_failures_and_interval_set_how_soon_a_hung_engine_is_declared():
    fast = RetryPolicy(health_interval_s=0.1, health_timeout_s=0.1, health_failures=1)
    patient = RetryPolicy(health_interval_s=0.1, health_timeout_s=0.1, health_failures=5)
    async with hung_engine() as url:
        quick, _ = await _give_up_after(url, fast, requests=1)
        slow, _ = await _give_up_after(url, patient, requests=1)
    assert quick < 0.8 and slow >= 1.0  # 1 x 0.2 s vs 5 x 0.2 s
    assert (fast.hung_after_s, patient.hung_after_s) == (0.2, 1.0)


async def test_without_health_probing_a_hung_engine_waits_for_the_attempt_timeout():
    retry = RetryPolicy(timeout_s=1.0, max_attempts=1, health_interval_s=None)
    async with hung_engine() as url:
        elapsed, (error,) = await _give_up_after(url, retry, requests=1)
    assert elapsed >= 1.0 and "timed out" in str(error.last_error)


@pytest.mark.parametrize("health_status", [200, 404])
async def test_a_slow_but_healthy_engine_keeps_its_long_generation(health_status):
    """Any answer to /health (even a 404 from an engine without the route) means alive."""

    class Engine(FaultServer):
        probes = 0

        async def _health(self, request):
            Engine.probes += 1
            return aiohttp.web.Response(status=health_status)

    async with (
        Engine() as server,
        make_client(
            server,
            max_attempts=1,
            timeout_s=30,
            health_interval_s=0.1,
            health_timeout_s=0.2,
            health_failures=1,
        ) as client,
    ):
        server.script.append(Slow(1.5))
        began = time.perf_counter()
        check_result(await generate(client))
    assert time.perf_counter() - began >= 1.5 and Engine.probes >= 5


@pytest.mark.slow
async def test_with_the_default_policy_a_hung_engine_is_declared_by_its_probes_not_the_timeout():
    retry = RetryPolicy()
    assert retry.hung_after_s == 20.0 and retry.timeout_s == 600.0
    async with hung_engine() as url:
        elapsed, errors = await _give_up_after(url, retry)
    # ~20 s of probes; the bound only tells them from the 600 s timeout (generous: a loaded machine)
    assert elapsed < 300.0 and all(isinstance(e, RetriesExhaustedError) for e in errors)
