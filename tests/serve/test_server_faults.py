"""Fault injection against the embedded rollout server on 127.0.0.1.

Each test sends one kind of bad, stalled or hostile traffic, checks the answer (status, error
type, the field named), then checks the server still answers ``/health`` and a good generate
request, and that nothing was lost (the serving weights and their version).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import threading
import time

import aiohttp
import numpy as np
import pytest
from server_support import GOOD, post, raw_request, status_line, still_serving

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.serve.server import RolloutServer

# --------------------------------------------------------------------------- sampling


async def test_poison_sampling_request_fails_alone_and_its_batch_mates_finish(srv):
    """temperature 1e-300 overflows float32 logits: refused with 400 naming the field, while the
    seven good requests sent with it generate."""
    poison = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "temperature": 1e-300}}
    good = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    results = await asyncio.gather(
        post(f"{srv.url}/generate", json_body=poison),
        *(post(f"{srv.url}/generate", json_body=good) for _ in range(7)),
    )
    status, payload, _ = results[0]
    assert status == 400 and payload["error"]["type"] == "BadRequest"
    assert "sampling_params.temperature must be 0 (greedy) or in [0.001, 1000]" in payload["error"]["message"]
    assert [r[0] for r in results[1:]] == [200] * 7
    assert all(len(r[1]["output_ids"]) == 4 for r in results[1:])
    await still_serving(srv)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": 1e-4}, r"sampling_params.temperature must be 0 \(greedy\) or in \[0.001, 1000\]"),
        ({"temperature": 1e6}, r"sampling_params.temperature must be 0 \(greedy\) or in \[0.001, 1000\]"),
        ({"top_k": 2**40}, r"sampling_params.top_k must be an integer >= -1 and <= 2147483647"),
        ({"top_k": -3}, r"sampling_params.top_k must be an integer >= -1 and <= 2147483647, got -3"),
        ({"seed": 2**63}, r"sampling_params.seed must be an integer >= 0 and <= 9223372036854775807"),
        ({"max_token": 4}, r"sampling_params has unknown keys \['max_token'\]"),
        ({"max_tokens": 4, "best_of": 2, "beam": 1}, r"unknown keys \['beam', 'best_of'\]"),
        ({"repetition_penalty": 1.3}, r"sampling_params.repetition_penalty = 1.3 is not supported"),
        ({"stop": ["</s>"]}, r"sampling_params.stop = \['</s>'\] is not supported"),
        ({"logprobs": 5}, r"sampling_params.logprobs = 5 is not supported"),
        ({"skip_special_tokens": "no"}, r"sampling_params.skip_special_tokens must be true or false"),
    ],
)
async def test_out_of_range_and_unknown_sampling_keys_get_400_naming_them(srv, params, message):
    status, payload, _ = await post(
        f"{srv.url}/skyrl/v1/generate", json_body={"token_ids": [5, 6], "sampling_params": params}
    )
    assert status == 400, payload
    assert re.search(message, payload["error"]["message"]), payload
    await still_serving(srv)


async def test_neutral_and_text_only_sampling_keys_are_accepted(srv):
    params = {
        "max_tokens": 2,
        "repetition_penalty": 1.0,
        "min_p": 0,
        "presence_penalty": 0.0,
        "logprobs": 0,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "stop": [],
    }
    status, payload, _ = await post(
        f"{srv.url}/skyrl/v1/generate", json_body={"token_ids": [5, 6], "sampling_params": params}
    )
    assert status == 200 and len(payload["choices"][0]["token_ids"]) <= 2


@pytest.mark.parametrize(
    ("path", "prompt_key", "name"),
    [
        ("/skyrl/v1/generate", "token_ids", "max_tokens"),
        ("/skyrl/v1/generate", "token_ids", "max_new_tokens"),
        ("/generate", "input_ids", "max_new_tokens"),
        ("/generate", "input_ids", "max_tokens"),
    ],
)
async def test_the_max_tokens_cap_holds_under_every_name_of_every_protocol(path, prompt_key, name):
    async with RolloutServer(build_tiny_moe(seed=0), limits=ServerLimits(max_new_tokens_cap=8)) as srv:
        for value in (9, 1_000_000_000):
            body = {prompt_key: [5, 6], "sampling_params": {name: value}}
            status, payload, _ = await post(f"{srv.url}{path}", json_body=body)
            assert status == 400
            assert payload["error"]["message"] == (
                f"sampling_params.{name} must be <= 8 (this server's cap), got {value}"
            )
        # both names at once, equal: still capped; at the cap: served
        body = {prompt_key: [5, 6], "sampling_params": {"max_tokens": 9, "max_new_tokens": 9}}
        status, payload, _ = await post(f"{srv.url}{path}", json_body=body)
        assert status == 400 and "must be <= 8 (this server's cap), got 9" in payload["error"]["message"]
        body = {prompt_key: [5, 6], "sampling_params": {name: 8, "ignore_eos": True}}
        status, payload, _ = await post(f"{srv.url}{path}", json_body=body)
        ids = payload["choices"][0]["token_ids"] if prompt_key == "token_ids" else payload["output_ids"]
        assert status == 200 and len(ids) == 8


async def test_every_documented_top_level_key_is_accepted(srv):
    skyrl = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}, "model": "m", "cache_salt": "s"}
    skyrl |= {"return_routed_experts": False, "stream": False}
    status, payload, _ = await post(f"{srv.url}/skyrl/v1/generate", json_body=skyrl)
    assert status == 200 and payload["choices"][0]["routed_experts"] is None
    sglang = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    sglang |= {"return_routed_experts": True, "routed_experts_start_len": 1, "stream": False}
    status, payload, _ = await post(f"{srv.url}/generate", json_body=sglang)
    assert status == 200 and len(payload["meta_info"]["output_token_logprobs"]) == len(payload["output_ids"])


# --------------------------------------------------------------------------- skyrl routes


async def test_skyrl_returns_routes_whenever_recorded_and_the_start_only_narrows(srv):
    prompt = [5, 6, 7, 8, 9]
    params = {"max_tokens": 4, "seed": 3, "ignore_eos": True}
    url = f"{srv.url}/skyrl/v1/generate"
    _, full, _ = await post(url, json_body={"token_ids": prompt, "sampling_params": params})
    routes = full["choices"][0]["routed_experts"]
    assert routes is not None and routes["shape"] == [5 + 4 - 1, 4, 2]  # SkyRL's batched path sends no start
    _, part, _ = await post(
        url, json_body={"token_ids": prompt, "sampling_params": {**params, "routed_experts_prompt_start": 3}}
    )
    narrowed = part["choices"][0]["routed_experts"]
    assert narrowed["shape"] == [5 - 3 + 4 - 1, 4, 2]

    def decode(envelope):
        return np.frombuffer(base64.b64decode(envelope["data"]), dtype=envelope["dtype"]).reshape(
            envelope["shape"]
        )

    assert (decode(narrowed) == decode(routes)[3:]).all()
    body = {"token_ids": prompt, "sampling_params": params, "return_routed_experts": False}
    _, off, _ = await post(url, json_body=body)
    assert off["choices"][0]["routed_experts"] is None


# --------------------------------------------------------------------------- timeouts and queue


async def test_a_connection_that_never_finishes_its_headers_is_closed():
    async with RolloutServer(build_tiny_moe(seed=0), limits=ServerLimits(header_timeout_s=0.5)) as srv:
        start = time.monotonic()
        reader, writer = await raw_request(srv, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le")
        async with asyncio.timeout(60):  # generous: a loaded machine; never closed would hang
            assert await reader.read() == b""  # closed by the server, no answer
        assert time.monotonic() - start > 0.4  # not before the header timeout
        writer.close()
        await still_serving(srv)


async def test_a_stalled_body_gets_408():
    async with RolloutServer(build_tiny_moe(seed=0), limits=ServerLimits(body_timeout_s=0.5)) as srv:
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        reader, writer = await raw_request(srv, head, b'{"input_ids": [')
        status, answer = await status_line(reader)
        assert status == 408 and b"request body stalled" in answer and b"RequestTimeout" in answer
        writer.close()
        await still_serving(srv)


async def test_past_max_queue_the_answer_is_429_with_retry_after():
    """Two requests that never send their bodies hold the whole budget (batch 1 + queue 1)."""
    async with RolloutServer(
        build_tiny_moe(seed=0),
        engine=EngineConfig(max_batch_size=1),
        limits=ServerLimits(max_queue=1, retry_after_s=3),
    ) as srv:
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n"
        stalled = [await raw_request(srv, head, b"{") for _ in range(2)]
        deadline = time.monotonic() + 10
        while True:
            status, payload, headers = await post(f"{srv.url}/generate", json_body=GOOD)
            if status == 429 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert status == 429 and headers["Retry-After"] == "3"
        assert payload["error"]["type"] == "TooManyRequests"
        assert "max_batch_size 1 + max_queue 1" in payload["error"]["message"]
        for _, writer in stalled:
            writer.close()
        deadline = time.monotonic() + 10
        while srv._generating and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await still_serving(srv)


async def test_generate_bodies_beyond_a_full_context_prompt_are_refused_unread():
    async with RolloutServer(build_tiny_moe(seed=0)) as srv:
        assert srv.limits.max_request_bytes == (64 << 10) + 24 * 256  # full context of the tiny model
        body = b'{"token_ids": [' + b", ".join([b"12345"] * ((16 << 20) // 7)) + b"]}"
        results = await asyncio.gather(*(post(f"{srv.url}/skyrl/v1/generate", body) for _ in range(4)))
        for status, payload, _ in results:
            assert status == 413
            assert payload["error"]["message"] == (
                f"request body of {len(body)} bytes exceeds the cap of {srv.limits.max_request_bytes} bytes"
            )
        prompt = [95] * 255  # a full-context prompt fits, pretty-printed
        body = json.dumps({"token_ids": prompt, "sampling_params": {"max_tokens": 1}}, indent=8).encode()
        status, payload, _ = await post(f"{srv.url}/skyrl/v1/generate", body)
        assert status == 200 and len(payload["choices"][0]["token_ids"]) == 1
        await still_serving(srv)


async def test_large_generate_bodies_are_decoded_off_the_event_loop():
    """Four 16 MB prompts (far past the context) are decoded off the event loop and refused from
    their length. The decoder is held until /health has answered: decoded on the loop, the loop
    itself would be held and /health never answered (no wall-clock bound: a structural check)."""
    async with RolloutServer(build_tiny_moe(seed=0), limits=ServerLimits(max_request_bytes=17 << 20)) as srv:
        tokens = b", ".join([b"12345"] * ((16 << 20) // 7))
        body = b'{"token_ids": [' + tokens + b"]}"
        assert len(body) > 15 << 20
        entered, release = threading.Event(), threading.Event()
        admit = srv._admit

        def held_admit(raw, protocol):
            entered.set()
            if not release.wait(120):  # on the loop, this would hold /health as well
                raise RuntimeError("the decoder was never released")
            return admit(raw, protocol)

        srv._admit = held_admit
        posts = asyncio.gather(*(post(f"{srv.url}/skyrl/v1/generate", body) for _ in range(4)))
        try:
            async with asyncio.timeout(120):  # generous: four 16 MB uploads on a loaded machine
                await asyncio.to_thread(entered.wait)
                async with aiohttp.ClientSession() as session, session.get(f"{srv.url}/health") as r:
                    assert r.status == 200 and not release.is_set()  # answered while a decode is held
        finally:
            release.set()
        for status, payload, _ in await posts:
            assert status == 400
            assert "token_ids has 2396745 tokens, more than the 255" in payload["error"]["message"]
        await still_serving(srv)


# --------------------------------------------------------------------------- auth and exposure


async def test_non_utf8_authorization_is_401():
    async with RolloutServer(build_tiny_moe(seed=0), api_key="s3cret") as srv:
        body = json.dumps(GOOD).encode()
        head = (
            b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x80\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        reader, writer = await raw_request(srv, head, body)
        status, answer = await status_line(reader)
        assert status == 401 and b"bearer token" in answer
        writer.close()
        await still_serving(srv, headers={"Authorization": "Bearer s3cret"})


@pytest.mark.parametrize("key", ["", " ", "\t\n"])
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_an_empty_or_blank_api_key_is_refused_on_any_host(key, host):
    """``Authorization: Bearer `` carries an empty token: an empty key would authenticate anyone."""
    with pytest.raises(ValueError, match=r"api_key must be a non-empty token, got .*let anyone in"):
        RolloutServer(build_tiny_moe(seed=0), host=host, api_key=key, allow_unauthenticated=True)


@pytest.mark.parametrize("header", [b"Bearer ", b"Bearer", b"Bearer  ", b""])
async def test_an_empty_bearer_token_never_authenticates(header):
    async with RolloutServer(build_tiny_moe(seed=0), api_key="s3cret") as srv:
        body = json.dumps(GOOD).encode()
        auth = b"Authorization: " + header + b"\r\n" if header else b""
        head = (
            b"POST /generate HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        reader, writer = await raw_request(srv, head, body)
        status, answer = await status_line(reader)
        assert status == 401 and b"bearer token" in answer
        writer.close()
        assert srv.weight_version == 0


def test_a_non_loopback_host_needs_an_api_key_or_an_explicit_opt_out():
    model = build_tiny_moe(seed=0)
    with pytest.raises(ValueError, match=r"host '0.0.0.0' is reachable from other machines but no api_key"):
        RolloutServer(model, host="0.0.0.0")
    # constructed, never started: the tests bind loopback only
    RolloutServer(model, host="0.0.0.0", api_key="k")
    RolloutServer(model, host="0.0.0.0", allow_unauthenticated=True)
    RolloutServer(model, host="::1")
    RolloutServer(model, host="localhost")
