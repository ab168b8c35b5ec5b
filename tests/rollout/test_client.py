"""RemoteGenerateClient against real aiohttp servers on 127.0.0.1: protocols, retries, errors."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import json
import pickle
import random
import socket
import threading
import time

import aiohttp
import numpy as np
import pytest
from fault_server import CLOSE, DROP_MID_BODY, OK, FaultServer, Raw, Slow, Status, expected_generation
from gloo_ranks import free_port

from r3lightning import (
    GenerateRequestError,
    MalformedResponseError,
    RemoteGenerateClient,
    RemoteGenerateError,
    RetriesExhaustedError,
    RetryableGenerateError,
)
from r3lightning.rollout.client import Backoff, _retry_after

SCHEMA = {"num_layers": 3, "top_k": 2, "num_experts": 300}
FAST = Backoff(base_s=0.001, cap_s=0.004)
PROMPT = [5, 6, 7, 8]


def make_client(server: FaultServer, protocol: str = "skyrl", **kwargs) -> RemoteGenerateClient:
    options = {"backoff": FAST, "max_attempts": 3, "timeout_s": 5.0, **SCHEMA, **kwargs}
    return RemoteGenerateClient(server.url, protocol=protocol, **options)


def params(protocol: str, n: int = 4) -> dict:
    return {"max_tokens": n} if protocol == "skyrl" else {"max_new_tokens": n}


async def generate(client: RemoteGenerateClient, prompt=PROMPT, start=None, n: int = 4):
    return await client.generate(
        prompt, params(client.protocol, n), return_routed_experts=True, routed_experts_prompt_start=start
    )


def check_result(result, prompt=PROMPT, n: int = 4, start: int = 0) -> None:
    ids, logprobs, routes = expected_generation(prompt, n, start, **SCHEMA)
    assert result.response_ids == ids
    assert result.response_logprobs == logprobs
    assert result.stop_reason == "length"
    assert result.routed_experts.dtype == (np.uint8 if routes.max(initial=0) < 256 else np.int16)  # compact
    np.testing.assert_array_equal(result.routed_experts, routes)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("protocol", ["skyrl", "sglang"])
async def test_round_trip_and_request_format(protocol):
    async with FaultServer(extra={"usage": {"completion_tokens": 4}}) as server:
        async with make_client(server, protocol, api_key="sekret", model="tiny") as client:
            result = await client.generate(
                PROMPT,
                params(protocol),
                return_routed_experts=True,
                routed_experts_prompt_start=2,
                session_id="traj-7",
                cache_salt="salt",
            )
        check_result(result, start=2)
        assert result.attempts == 1
        assert result.raw_response["usage"] == {"completion_tokens": 4}
        path, body, headers = server.requests[0]
        assert headers["Authorization"] == "Bearer sekret"
        assert headers["X-Session-ID"] == "traj-7"
        if protocol == "skyrl":
            assert path == "/skyrl/v1/generate"
            assert body == {
                "token_ids": PROMPT,
                "sampling_params": {"max_tokens": 4, "routed_experts_prompt_start": 2},
                "model": "tiny",
                "cache_salt": "salt",
            }
            assert result.raw_response["choices"][0]["routed_experts"]["data"] is None  # never materialised
            assert result.raw_response["choices"][0]["routed_experts"]["shape"] == [5, 3, 2]
        else:
            assert path == "/generate"
            assert body == {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 4},
                "return_logprob": True,
                "return_routed_experts": True,
                "routed_experts_start_len": 2,
            }
            assert result.raw_response["meta_info"]["routed_experts"] is None


@pytest.mark.parametrize("protocol", ["skyrl", "sglang"])
async def test_routes_not_requested(protocol):
    async with FaultServer() as server, make_client(server, protocol) as client:
        result = await client.generate(np.array(PROMPT), params(protocol))
        assert result.routed_experts is None
        assert result.response_ids == expected_generation(PROMPT, 4, 0, **SCHEMA)[0]
        body = server.requests[0][1]
        assert "routed_experts_prompt_start" not in body["sampling_params"]
        assert body.get("return_routed_experts", False) is False


async def test_full_capture_equals_suffix_captures():
    """prompt start 0 (the default when asked for routes) returns every row."""
    async with FaultServer() as server, make_client(server) as client:
        full = await generate(client)
        check_result(full, start=0)
        assert server.requests[0][1]["sampling_params"]["routed_experts_prompt_start"] == 0
        suffix = await generate(client, start=3)
        np.testing.assert_array_equal(suffix.routed_experts, full.routed_experts[3:])


async def test_non_route_data_key_is_kept_in_raw_response():
    extra = {"meta": {"data": "a\\/b", "other": [{"data": "QUJD"}]}}
    async with FaultServer(extra=extra) as server, make_client(server) as client:
        result = await generate(client)
    check_result(result)
    assert result.raw_response["meta"] == {"data": "a\\/b", "other": [{"data": "QUJD"}]}


async def test_hundreds_of_concurrent_requests():
    # decode_in_thread_bytes=0: every body is decoded in a worker thread
    async with (
        FaultServer() as server,
        make_client(server, max_connections=32, decode_in_thread_bytes=0) as client,
    ):
        prompts = [[i % 97, i % 89 + 1, 3] for i in range(300)]
        results = await asyncio.gather(
            *(generate(client, prompt=p, n=1 + i % 5) for i, p in enumerate(prompts))
        )
        for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
            check_result(result, prompt=prompt, n=1 + i % 5)
        assert client.stats.requests == client.stats.attempts == 300
        assert 1 < server.max_in_flight <= 32


async def test_health():
    async with FaultServer() as server, make_client(server) as client:
        assert await client.health()
    dead = RemoteGenerateClient(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)
    assert not await dead.health()
    await dead.close()


# ------------------------------------------------------------------ lifecycle


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

    def on_loop(coro, timeout=10.0):
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


async def test_health_of_a_hung_engine_fails_fast_despite_a_long_generate_timeout():
    async def never_answer(reader, writer):
        await asyncio.sleep(60)

    hung = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = hung.sockets[0].getsockname()[1]
    client = RemoteGenerateClient(f"http://127.0.0.1:{port}", timeout_s=600.0, health_timeout_s=0.2)
    assert (client.timeout_s, client.connect_timeout_s) == (600.0, 10.0)
    try:
        began = time.perf_counter()
        assert not await asyncio.wait_for(client.health(), timeout=5.0)
        assert time.perf_counter() - began < 2.0
    finally:
        await client.close()
        hung.close()


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
    client = RemoteGenerateClient(
        f"http://127.0.0.1:{port}", timeout_s=600.0, connect_timeout_s=0.3, max_attempts=1
    )
    try:
        began = time.perf_counter()
        with pytest.raises(RetriesExhaustedError) as info:
            await asyncio.wait_for(client.generate(PROMPT, {"max_tokens": 1}), timeout=10.0)
        assert time.perf_counter() - began < 5.0
        assert isinstance(info.value.last_error.__cause__, aiohttp.ConnectionTimeoutError)
    finally:
        await client.close()
        for sock in (*fillers, listener):
            sock.close()


async def test_async_with_closes_the_session():
    async with FaultServer() as server:
        async with make_client(server) as client:
            await generate(client)
            session = client._session
        assert session.closed and client._session is None
        check_result(await generate(client))  # reopens lazily
        await client.close()


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
        began = time.perf_counter()
        # bounded here: were the clip lost, this fails in 5 s instead of sleeping for an hour
        check_result(await asyncio.wait_for(generate(client), timeout=5.0))
        assert time.perf_counter() - began < 1.0


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
    client = RemoteGenerateClient(
        f"http://127.0.0.1:{free_port()}", backoff=FAST, max_attempts=3, timeout_s=2.0
    )
    with pytest.raises(RetriesExhaustedError) as info:
        await client.generate(PROMPT, {"max_tokens": 1})
    assert info.value.attempts == 3 and client.stats.attempts == 3
    assert isinstance(info.value.last_error.__cause__, OSError | ConnectionError) or "Connect" in str(
        info.value.last_error
    )
    await client.close()


# ------------------------------------------------------------------ errors that are not retried


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_client_errors_are_not_retried(status):
    async with FaultServer() as server, make_client(server) as client:
        server.script.append(Status(status, json.dumps({"error": {"message": "token_ids must be a list"}})))
        with pytest.raises(GenerateRequestError, match=f"HTTP {status}.*token_ids must be a list") as info:
            await generate(client)
        assert info.value.status == status
        assert info.value.server_message == "token_ids must be a list"
        assert server.hits == 1 and client.stats.failures == 1


async def test_an_answer_that_is_not_http_is_a_typed_error_not_retried():
    hits = []

    async def answer(reader, writer):
        hits.append(await reader.read(1 << 16))
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with RemoteGenerateClient(f"http://127.0.0.1:{port}", backoff=FAST, max_attempts=3) as client:
            with pytest.raises(MalformedResponseError, match=r"not a valid HTTP response.*Bad status line"):
                await client.generate(PROMPT, {"max_tokens": 1})
            assert len(hits) == 1 and client.stats.retries == 0 and client.stats.failures == 1
    finally:
        server.close()
        await server.wait_closed()


def _skyrl_body(envelope) -> bytes:
    choice = {"token_ids": [1, 2], "finish_reason": "stop", "logprobs": None, "routed_experts": envelope}
    return json.dumps({"choices": [choice]}).encode()


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode()


GOOD = np.array([[[1, 2], [3, 4], [5, 6]]], dtype=np.uint8)  # [1 row, 3 layers, 2]
MALFORMED = {
    "dtype": (
        _skyrl_body({"data": _b64(GOOD), "shape": [1, 3, 2], "dtype": "float32"}),
        r"\.dtype: unknown dtype",
    ),
    "shape-type": (
        _skyrl_body({"data": _b64(GOOD), "shape": "1,3,2", "dtype": "uint8"}),
        r"\.shape: expected a list",
    ),
    "shape-bool": (_skyrl_body({"data": _b64(GOOD), "shape": [True, 3, 2], "dtype": "uint8"}), r"\.shape"),
    "shape-neg": (_skyrl_body({"data": _b64(GOOD), "shape": [-1, 3, 2], "dtype": "uint8"}), r"\.shape"),
    "byte-count": (
        _skyrl_body({"data": _b64(GOOD), "shape": [2, 3, 2], "dtype": "uint8"}),
        r"holds 6 bytes.*need 12",
    ),
    "truncated": (
        _skyrl_body({"data": _b64(GOOD)[:-1], "shape": [1, 3, 2], "dtype": "uint8"}),
        r"multiple of 4",
    ),
    "invalid-b64": (
        _skyrl_body({"data": "AQ!DBAUG", "shape": [1, 3, 2], "dtype": "uint8"}),
        r"invalid base64",
    ),
    "too-big": (_skyrl_body({"data": "AAAA", "shape": [10**9, 48, 8], "dtype": "int32"}), r"exceeds the cap"),
    "out-of-range": (
        _skyrl_body(
            {"data": _b64(np.full((1, 3, 2), [0, 300], np.int16)), "shape": [1, 3, 2], "dtype": "int16"}
        ),
        r"expert id 300 is out of range for num_experts=300",
    ),
    "repeated": (
        _skyrl_body({"data": _b64(np.full((1, 3, 2), 4, np.uint8)), "shape": [1, 3, 2], "dtype": "uint8"}),
        r"row 0 layer 0 repeats an expert",
    ),
    "wrong-layers": (
        _skyrl_body({"data": _b64(GOOD), "shape": [1, 2, 3], "dtype": "uint8"}),
        r"num_layers=3",
    ),
    "data-type": (
        _skyrl_body({"data": 12, "shape": [1, 3, 2], "dtype": "uint8"}),
        r"data: expected a base64",
    ),
    "not-envelope": (_skyrl_body([1, 2, 3]), r"routed_experts: expected an ndarray envelope"),
    "not-json": (b'{"choices": [', r"not valid JSON"),
    "no-choices": (b'{"id": "x"}', r"choices: expected a non-empty list"),
    "token-ids": (b'{"choices": [{"token_ids": [1, "2"]}]}', r"choices\[0\]\.token_ids"),
    "token-ids-negative": (
        b'{"choices": [{"token_ids": [1, -2]}]}',
        r"choices\[0\]\.token_ids: expected a list of non-negative integer token ids",
    ),
    "envelope-no-data": (
        _skyrl_body({"shape": [1, 3, 2], "dtype": "uint8"}),
        r"choices\[0\]\.routed_experts: envelope is missing \['data'\]",
    ),
    "logprobs-len": (
        b'{"choices": [{"token_ids": [1, 2], "logprobs": {"content": [{"logprob": -1.0}]}}]}',
        r"1 logprobs for 2 tokens",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_responses_raise_at_once(case):
    body, message = MALFORMED[case]
    async with FaultServer() as server, make_client(server) as client:
        server.script.append(Raw(body))
        with pytest.raises(MalformedResponseError, match=message) as info:
            await generate(client)
        assert isinstance(info.value, ValueError) and isinstance(info.value, RemoteGenerateError)
        assert server.hits == 1 and client.stats.retries == 0


SGLANG_MALFORMED = {
    "rows": (_b64(np.arange(5, dtype="<i4")), r"not a whole number of int32 rows"),
    "invalid-b64": ("!" + _b64(np.arange(6, dtype="<i4"))[1:], r"invalid base64"),
    "truncated": ("AAAAAAA", r"multiple of 4"),
    "negative": (_b64(np.array([[0, 1], [2, -3], [4, 5]], dtype="<i4")), r"expert id -3 is negative"),
}


@pytest.mark.parametrize("case", sorted(SGLANG_MALFORMED))
async def test_malformed_sglang_routes(case):
    data, message = SGLANG_MALFORMED[case]
    body = {"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}, "routed_experts": data}}
    async with FaultServer() as server, make_client(server, "sglang") as client:
        server.script.append(Raw(json.dumps(body).encode()))
        with pytest.raises(MalformedResponseError, match=r"meta_info\.routed_experts.*" + message):
            await generate(client)
        assert server.hits == 1


async def test_negative_sglang_output_ids_are_refused():
    routes = _b64(np.array([[0, 1], [2, 3], [4, 5]], dtype="<i4"))
    body = {"output_ids": [1, -1], "meta_info": {"finish_reason": "stop", "routed_experts": routes}}
    async with FaultServer() as server, make_client(server, "sglang") as client:
        server.script.append(Raw(json.dumps(body).encode()))
        with pytest.raises(MalformedResponseError, match=r"^output_ids: expected a list of non-negative"):
            await generate(client)
        assert server.hits == 1 and client.stats.retries == 0


async def test_oversized_body_is_refused():
    async with FaultServer() as server, make_client(server, max_response_bytes=64) as client:
        with pytest.raises(MalformedResponseError, match="max_response_bytes=64"):
            await generate(client)
        assert server.hits == 1


# ------------------------------------------------------------------ pieces


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


async def test_only_the_first_choice_is_decoded():
    second = {"token_ids": [9], "routed_experts": {"data": "AAAA", "shape": [1, 3, 1], "dtype": "uint8"}}
    async with FaultServer() as server, make_client(server) as client:
        server.script.append(OK)
        first = (await generate(client)).raw_response["choices"][0]
        body = {"choices": [first, second]}
        first["routed_experts"] = {
            "data": base64.b64encode(bytes(range(42))).decode(),
            "shape": [7, 3, 2],  # P + G - 1 rows
            "dtype": "uint8",
        }
        server.script.append(Raw(json.dumps(body).encode()))
        result = await generate(client)
        np.testing.assert_array_equal(result.routed_experts, np.arange(42).reshape(7, 3, 2))
        assert result.raw_response["choices"][1]["routed_experts"]["data"] is None


async def test_prompt_validation_and_numpy_ids():
    async with FaultServer() as server, make_client(server) as client:
        check_result(await generate(client, prompt=[np.int64(t) for t in PROMPT]))
        for bad in ([], [1, -2], [1.0, 2], [True, 2]):
            with pytest.raises(ValueError, match="prompt_token_ids: expected a non-empty sequence"):
                await client.generate(bad, {"max_tokens": 1})
        with pytest.raises(
            ValueError, match=r"routed_experts_prompt_start must be <= the prompt length 4, got 5"
        ):
            await generate(client, start=5)
        assert server.hits == 1


def test_retry_after_header_forms():
    assert _retry_after("2.5") == 2.5 and _retry_after("-3") == 0.0
    assert _retry_after(None) is None and _retry_after("soon") is None
    in_a_minute = email.utils.formatdate(time.time() + 60, usegmt=True)
    assert 55 < _retry_after(in_a_minute) <= 60
    assert _retry_after(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0


async def test_plain_text_error_bodies_are_reported():
    async with FaultServer() as server, make_client(server) as client:
        server.script.append(Status(403, "  forbidden: bad token\n"))
        with pytest.raises(
            GenerateRequestError,
            match=r"HTTP 403 from http://127\.0\.0\.1:[0-9]+/skyrl/v1/generate: forbidden: bad token$",
        ):
            await generate(client)


def test_constructor_validation():
    with pytest.raises(ValueError, match="protocol"):
        RemoteGenerateClient("http://x", protocol="tgi")
    with pytest.raises(ValueError, match="engine must be None or one of"):
        RemoteGenerateClient("http://x", protocol="vllm", engine="sglang")
    for name in ("timeout_s", "connect_timeout_s", "health_timeout_s"):
        with pytest.raises(ValueError, match=f"^{name} must be > 0"):
            RemoteGenerateClient("http://x", **{name: 0})
    with pytest.raises(ValueError, match="max_attempts"):
        RemoteGenerateClient("http://x", max_attempts=0)
    with pytest.raises(ValueError, match="base_url"):
        RemoteGenerateClient("127.0.0.1:80")


async def test_sglang_routes_need_the_schema():
    client = RemoteGenerateClient("http://127.0.0.1:1", protocol="sglang")
    with pytest.raises(ValueError, match="num_layers and top_k"):
        await client.generate(PROMPT, {}, return_routed_experts=True)
