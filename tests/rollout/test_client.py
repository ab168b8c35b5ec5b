"""RemoteGenerateClient against real aiohttp servers on 127.0.0.1: request formats, responses,
errors that are not retried, and settings. Retries and health: test_client_retries.py;
sessions, event loops and pickling: test_client_lifecycle.py."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from fault_server import OK, FaultServer, Raw, Status, expected_generation
from rollout_support import FAST, PROMPT, SCHEMA, check_result, generate, make_client, params

from r3lightning import MalformedResponseError, RemoteGenerateClient, RemoteGenerateError, Trajectory
from r3lightning.rollout.config import Backoff, RetryPolicy, route_schema
from r3lightning.wire.errors import GenerateRequestError
from r3lightning.wire.request import RouteSchema

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
        retry = RetryPolicy(backoff=FAST, max_attempts=3)
        async with RemoteGenerateClient(f"http://127.0.0.1:{port}", retry=retry) as client:
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


async def test_repeated_experts_are_refused_by_the_opt_in_parse_check_and_by_trajectory():
    """The parse checks shapes, ids and row counts; the distinct-experts check (several times the
    decode's cost) runs where routes become a ``Trajectory``, or in the parse with
    ``RouteSchema(check_unique=True)``."""
    routes = np.tile(GOOD, (5, 1, 1))  # P - start + G - 1 = 4 + 2 - 1 rows
    routes[3, 1] = [7, 7]
    body = _skyrl_body({"data": _b64(routes), "shape": [5, 3, 2], "dtype": "uint8"})
    async with FaultServer() as server, make_client(server) as client:
        server.script.append(Raw(body))
        result = await generate(client)
        np.testing.assert_array_equal(result.routed_experts, routes)
        with pytest.raises(ValueError, match=r"row 3 layer 1 repeats an expert: \[7, 7\]"):
            Trajectory(PROMPT, result.response_ids, routed_experts=result.routed_experts)
    checking = RouteSchema(**SCHEMA, check_unique=True)
    async with FaultServer() as server, make_client(server, schema=checking) as client:
        server.script.append(Raw(body))
        with pytest.raises(MalformedResponseError, match=r"row 3 layer 1 repeats an expert"):
            await generate(client)
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
            with pytest.raises(
                ValueError, match="prompt_token_ids must be a non-empty sequence of token ids >= 0"
            ):
                await client.generate(bad, {"max_tokens": 1})
        with pytest.raises(
            ValueError, match=r"routed_experts_prompt_start must be <= the prompt length 4, got 5"
        ):
            await generate(client, start=5)
        assert server.hits == 1


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
    for name in ("timeout_s", "connect_timeout_s", "health_timeout_s", "health_interval_s"):
        with pytest.raises(ValueError, match=f"^{name} must be (None or )?a number > 0, got 0$"):
            RetryPolicy(**{name: 0})
    for name in ("max_attempts", "health_failures"):
        with pytest.raises(ValueError, match=f"^{name} must be an integer >= 1, got 0$"):
            RetryPolicy(**{name: 0})
    with pytest.raises(ValueError, match=r"^base_s must be a number >= 0, got -1$"):
        Backoff(base_s=-1)
    with pytest.raises(ValueError, match=r"^max_response_bytes must be an integer >= 1, got 0$"):
        RemoteGenerateClient("http://x", max_response_bytes=0)
    with pytest.raises(TypeError, match="retry must be a RetryPolicy, got dict"):
        RemoteGenerateClient("http://x", retry={"max_attempts": 1})
    with pytest.raises(ValueError, match="base_url"):
        RemoteGenerateClient("127.0.0.1:80")
    for key in ("", "   "):  # an unset variable: the client would send "Bearer " or no header at all
        with pytest.raises(ValueError, match=r"^api_key must be a non-empty token"):
            RemoteGenerateClient("http://x", api_key=key)
    with pytest.raises(ValueError, match=r"^api_key must hold no whitespace"):
        RemoteGenerateClient("http://x", api_key="two words")
    with pytest.raises(TypeError, match=r"^api_key must be None or a string, got int"):
        RemoteGenerateClient("http://x", api_key=123)


def test_client_takes_its_route_schema_from_a_model_config():
    from transformers import MixtralConfig, Qwen3MoeConfig

    qwen = Qwen3MoeConfig(num_hidden_layers=5, num_experts=12, num_experts_per_tok=3)
    client = RemoteGenerateClient("http://x", schema=qwen)
    assert client.routes == RouteSchema(5, 3, 12)
    mixtral = MixtralConfig(num_hidden_layers=4, num_local_experts=6, num_experts_per_tok=2)
    assert RemoteGenerateClient("http://x", schema=mixtral.to_dict()).routes == RouteSchema(4, 2, 6)
    assert route_schema(RouteSchema(1, 2, 3)) == RouteSchema(1, 2, 3)


async def test_sglang_routes_need_the_schema():
    client = RemoteGenerateClient("http://127.0.0.1:1", protocol="sglang")
    with pytest.raises(ValueError, match="num_layers and top_k"):
        await client.generate(PROMPT, {}, return_routed_experts=True)
