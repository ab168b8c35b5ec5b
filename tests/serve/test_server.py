"""The embedded rollout server over HTTP on loopback: both protocols, errors, auth, threads,
batching, weight uploads. Faults and limits: test_server_faults.py; the engine: test_engine.py."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import urllib.error
import urllib.request
from dataclasses import replace

import aiohttp
import numpy as np
import pytest
import torch
from safetensors.torch import save

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.serve.engine import GenerationRequest
from r3lightning.app.serve.sampling import SamplingParams
from r3lightning.app.serve.server import RolloutServer


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def server():
    with RolloutServer(engine=EngineConfig(seed=0)) as srv:
        yield srv


# --------------------------------------------------------------------------- HTTP


async def _post(url: str, data: bytes | None = None, *, json_body=None, headers=None) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, json=json_body, headers=headers) as r,
    ):
        return r.status, json.loads(await r.read())


async def test_both_protocol_response_formats(server):
    prompt = _prompt(12, 5)
    status, skyrl = await _post(
        f"{server.url}/skyrl/v1/generate",
        json_body={
            "token_ids": prompt,
            "sampling_params": {
                "max_tokens": 6,
                "seed": 4,
                "ignore_eos": True,
                "routed_experts_prompt_start": 2,
            },
        },
    )
    assert status == 200
    choice = skyrl["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == choice["token_ids"]
    assert choice["routed_experts"]["shape"] == [5 - 2 + 6 - 1, 4, 2]
    assert choice["routed_experts"]["dtype"] == "uint8"

    status, sglang = await _post(
        f"{server.url}/generate",
        json_body={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "sampling_seed": 4, "ignore_eos": True},
            "return_logprob": True,
            "return_routed_experts": True,
            "routed_experts_start_len": 2,
        },
    )
    assert status == 200
    assert sglang["output_ids"] == choice["token_ids"]  # same seed, same procedure
    meta = sglang["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == [
        e["logprob"] for e in choice["logprobs"]["content"]
    ]
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, 4, 2)
    envelope = choice["routed_experts"]
    packed = np.frombuffer(base64.b64decode(envelope["data"]), dtype=np.uint8).reshape(envelope["shape"])
    assert (flat == packed).all()
    # no routes unless asked for
    status, plain = await _post(f"{server.url}/generate", json_body={"input_ids": prompt})
    assert status == 200 and "routed_experts" not in plain["meta_info"]
    assert "output_token_logprobs" not in plain["meta_info"]


BAD_REQUESTS = [
    ("/skyrl/v1/generate", b"{not json", "request body is not valid JSON"),
    ("/skyrl/v1/generate", b"[1, 2]", "request body must be a JSON object, got list"),
    ("/skyrl/v1/generate", b'{"sampling_params": {}}', "token_ids is required"),
    ("/skyrl/v1/generate", b'{"token_ids": "abc"}', "token_ids must be a list of token ids"),
    ("/skyrl/v1/generate", b'{"token_ids": [1, -2]}', r"token_ids\[1\] must be a non-negative integer"),
    ("/skyrl/v1/generate", b'{"token_ids": [1, 500]}', "token_ids holds token id 500 at index 1"),
    ("/skyrl/v1/generate", b'{"token_ids": []}', "token_ids must not be empty"),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": [1]}',
        "sampling_params must be a JSON object",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"max_tokens": 0}}',
        r"^sampling_params.max_tokens must be an integer >= 1, got 0$",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"temperature": "hot"}}',
        r"^sampling_params.temperature must be a number >= 0, got 'hot'$",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"top_p": 1.5}}',
        r"^sampling_params.top_p must be a number > 0 and <= 1, got 1.5$",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"n": 2}}',
        r"^sampling_params.n = 2 is not supported by this engine \(accepted: 1\)$",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"seed": 1.5}}',
        "sampling_params.seed must be an integer",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"stop_token_ids": [99]}}',
        r"sampling_params.stop_token_ids must be in \[0, 96\)",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 3}}',
        "sampling_params.routed_experts_prompt_start must be <= the prompt length 2",
    ),
    ("/generate", b'{"text": "hello"}', r"input_ids is required .* \(text prompts are not supported\)"),
    ("/generate", b'{"input_ids": [[1, 2]]}', "input_ids must be one prompt"),
    (
        "/generate",
        b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}',
        "sampling_params.max_new_tokens must be an integer >= 1, got -1",
    ),
    (
        "/generate",
        b'{"input_ids": [1], "sampling_params": {"ignore_eos": 1}}',
        "sampling_params.ignore_eos must be true or false",
    ),
    (
        "/generate",
        b'{"input_ids": [1], "return_routed_experts": "yes"}',
        "return_routed_experts must be true or false",
    ),
    # lists and objects where a scalar belongs: 400 naming the key, never a 500
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"max_tokens": [1]}}',
        r"^sampling_params.max_tokens must be an integer >= 1, got \[1\]$",
    ),
    (
        "/generate",
        b'{"input_ids": [1], "sampling_params": {"max_tokens": [1], "max_new_tokens": 1}}',
        "sets both max_new_tokens and max_tokens differently",
    ),
    (
        "/generate",
        b'{"input_ids": [1], "sampling_params": {"sampling_seed": {"a": 1}}}',
        r"^sampling_params.sampling_seed must be an integer >= 0",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"top_k": [2]}}',
        r"^sampling_params.top_k must be an integer >= -1",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"temperature": [1]}}',
        r"^sampling_params.temperature must be a number",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"min_p": [0]}}',
        r"^sampling_params.min_p = \[0\] is not supported",
    ),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "sampling_params": {"stop_token_ids": 5}}',
        r"^sampling_params.stop_token_ids must be a list of token ids, got int$",
    ),
    (
        "/generate",
        b'{"input_ids": [1], "return_logprob": [true]}',
        r"^return_logprob must be true or false, got \[True\]$",
    ),
    # unknown top-level keys are refused like unknown sampling keys; stream only as false
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "stream": true}',
        r"^stream = True is not supported by this server \(accepted: false\)$",
    ),
    ("/generate", b'{"input_ids": [1], "stream": true}', r"^stream = True is not supported"),
    (
        "/skyrl/v1/generate",
        b'{"token_ids": [1], "echo": true, "best_of": 2}',
        r"^the request body has unknown keys \['best_of', 'echo'\]; supported: \[",
    ),
    ("/generate", b'{"input_ids": [1], "text": "hi"}', r"^the request body has unknown keys \['text'\]"),
    (
        "/generate",
        b'{"input_ids": [1], "cache_salt": "x"}',
        r"^the request body has unknown keys \['cache_salt'\]",
    ),
    (
        "/generate",
        b'{"input_ids": [1], "routed_experts_start_len": -1}',
        "routed_experts_start_len must be None or an integer >= 0, got -1",
    ),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD_REQUESTS, ids=[m[:40] for _, _, m in BAD_REQUESTS])
async def test_bad_requests_get_400_naming_the_field(server, path, body, message):
    status, payload = await _post(f"{server.url}{path}", body)
    assert status == 400
    assert payload["error"]["code"] == 400
    assert re.search(message, payload["error"]["message"]), payload


async def test_oversized_body_gets_413_and_the_server_keeps_serving():
    async with RolloutServer(build_tiny_moe(seed=0), limits=ServerLimits(max_request_bytes=1000)) as srv:
        body = json.dumps({"input_ids": list(range(1, 90)) * 4}).encode()
        assert len(body) > 1000
        status, payload = await _post(f"{srv.url}/generate", body)
        assert status == 413 and "exceeds the cap of 1000 bytes" in payload["error"]["message"]

        async def chunks():  # no Content-Length: the cap is enforced while reading
            for _ in range(20):
                yield b" " * 100

        status, payload = await _post(f"{srv.url}/generate", chunks())
        assert status == 413 and "exceeds the cap of 1000 bytes" in payload["error"]["message"]
        status, payload = await _post(f"{srv.url}/generate", json_body={"input_ids": [5, 6]})
        assert status == 200 and payload["output_ids"]


async def test_bearer_token():
    async with RolloutServer(build_tiny_moe(seed=0), api_key="s3cret") as srv:
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, payload = await _post(f"{srv.url}/generate", json_body=body, headers=headers)
            assert status == 401 and "bearer token" in payload["error"]["message"]
        status, payload = await _post(
            f"{srv.url}/generate", json_body=body, headers={"Authorization": "Bearer s3cret"}
        )
        assert status == 200 and len(payload["output_ids"]) == 2
        async with aiohttp.ClientSession() as session, session.get(f"{srv.url}/health") as r:
            assert r.status == 200  # health needs no token


async def test_unknown_route_and_method_get_json_errors(server):
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == 404
        async with session.get(f"{server.url}/generate") as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == 405


def test_sync_context_manager_serves_from_its_own_thread():
    with RolloutServer(build_tiny_moe(seed=0)) as srv:
        url = srv.url
        with urllib.request.urlopen(f"{url}/health") as r:
            health = json.load(r)
        assert health == {
            "status": "ok",
            "model": "Qwen3MoeForCausalLM",
            "num_layers": 4,
            "top_k": 2,
            "num_experts": 8,
            "vocab_size": 96,
            "max_context": 256,
            "weight_version": 0,
        }
        request = urllib.request.Request(
            f"{url}/generate",
            data=json.dumps(
                {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request) as r:
            assert len(json.load(r)["output_ids"]) == 3
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/health", timeout=5)
    with pytest.raises(RuntimeError, match="runs once"):
        asyncio.run(srv.start())


async def test_concurrent_requests_are_batched_and_each_gets_its_own_answer():
    """12 concurrent requests share batches (fp32, so padding cannot flip a near tie)."""
    prompts = [_prompt(30 + i, 2 + i % 5) for i in range(12)]
    params = SamplingParams(max_new_tokens=5, seed=0, ignore_eos=True)
    async with RolloutServer(
        build_tiny_moe(seed=0), engine=EngineConfig(dtype=torch.float32, max_batch_size=4)
    ) as srv:

        async def one(i, prompt):
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 5, "sampling_seed": i, "ignore_eos": True},
                "return_routed_experts": True,
            }
            return await _post(f"{srv.url}/generate", json_body=body)

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        for i, (prompt, (status, payload)) in enumerate(zip(prompts, results, strict=True)):
            assert status == 200
            request = GenerationRequest(prompt, replace(params, seed=i), return_routed_experts=True)
            alone = srv.engine.generate([request])[0]
            assert payload["output_ids"] == alone.token_ids
            flat = np.frombuffer(base64.b64decode(payload["meta_info"]["routed_experts"]), dtype="<i4")
            assert (flat.reshape(-1, 4, 2) == alone.routed_experts).all()


async def test_update_weights_over_http():
    new_model = build_tiny_moe(seed=2)
    async with RolloutServer(build_tiny_moe(seed=0), api_key="k") as srv, aiohttp.ClientSession() as session:
        headers = {"Authorization": "Bearer k"}
        body = save({k: v.contiguous() for k, v in new_model.state_dict().items()})
        async with session.post(f"{srv.url}/update_weights", data=body, headers=headers) as r:
            assert r.status == 200
            assert await r.json() == {"updated": len(new_model.state_dict()), "weight_version": 1}
        for name, value in new_model.state_dict().items():
            assert torch.equal(srv.engine.model.state_dict()[name], value.to(torch.bfloat16))
        async with session.post(f"{srv.url}/update_weights", data=b"not safetensors", headers=headers) as r:
            assert r.status == 400 and "not a safetensors file" in (await r.json())["error"]["message"]
        partial = save({"lm_head.weight": new_model.lm_head.weight.detach().contiguous()})
        async with session.post(f"{srv.url}/update_weights?strict=true", data=partial, headers=headers) as r:
            assert r.status == 400 and "upload lacks 46 model names" in (await r.json())["error"]["message"]
        async with session.post(f"{srv.url}/update_weights", data=body) as r:
            assert r.status == 401
        async with session.get(f"{srv.url}/health") as r:
            assert (await r.json())["weight_version"] == 1
