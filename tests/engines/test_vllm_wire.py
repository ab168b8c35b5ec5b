"""RemoteGenerateClient against a real vLLM engine (fp32): both endpoints, the prompt start, stop
tokens and prefix-cache hits, each checked against a raw decode of the engine's own bytes and
against transformers' native fp32 routes of the same weights."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from route_reference import RecordingProxy, random_tokens
from vllm_reference import E, K, L, native_routes, raw_choice

from r3lightning.app.vllm import tiny_vllm_moe_config
from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.config import RetryPolicy

pytestmark = pytest.mark.vllm

RETRY = RetryPolicy(max_attempts=1, timeout_s=120.0)


def client(url: str, protocol: str) -> RemoteGenerateClient:
    return RemoteGenerateClient(url, protocol=protocol, schema=tiny_vllm_moe_config(), retry=RETRY)


def params(n: int, seed: int, **extra) -> dict:
    return {"max_tokens": n, "temperature": 1.0, "seed": seed, "ignore_eos": True, **extra}


def check_against_native(tokens: list[int], start: int, routes: np.ndarray) -> None:
    """Rows ``start..`` equal transformers' fp32 routes of the same tokens, wherever the router's
    k-th and (k+1)-th logits are not a near tie (those may flip between fp32 kernels)."""
    native, margin = native_routes(tokens)
    rows = native[start : start + len(routes)]
    clear = margin[start : start + len(routes)] > 1e-4  # [rows, L]
    assert clear[:, 1:].mean() > 0.9  # the premise: almost every slot is decided by a clear gap
    assert np.array_equal(np.sort(routes, axis=-1)[clear], rows[clear])


@pytest.mark.parametrize("protocol", ["vllm", "openai"])
@pytest.mark.parametrize("start", [None, 0, 5])
async def test_routes_of_each_endpoint_equal_the_raw_bytes_and_native_fp32(vllm_fp32, protocol, start):
    prompt = random_tokens(7, 9)
    proxy = RecordingProxy(vllm_fp32.url)
    results = []

    async def run() -> None:
        async with client(proxy.url, protocol) as engine:
            results.append(
                await engine.generate(
                    prompt,
                    params(6, seed=11),
                    return_routed_experts=True,
                    routed_experts_prompt_start=start,
                    session_id="one",
                )
            )

    await proxy.serve(run)
    (result,) = results
    raw_request, raw_response = proxy.exchanges["one"]
    sampled, raw_routes, wire_dtype = raw_choice(raw_response)
    first = start or 0
    request = json.loads(raw_request)
    asked = request["sampling_params"] if protocol == "vllm" else request  # where each endpoint reads it
    assert asked["routed_experts_prompt_start"] == first
    assert result.response_ids == sampled and len(sampled) == 6
    assert wire_dtype == np.uint8  # 8 experts fit a byte
    assert raw_routes.shape == (len(prompt) - first + len(sampled) - 1, L, K)
    assert np.array_equal(result.routed_experts.astype(np.int64), raw_routes)
    assert not raw_routes[:, 0].any()  # the dense layer 0: all-zero rows
    moe = raw_routes[:, 1:]
    assert moe.min() >= 0 and moe.max() < E and (moe[..., 0] != moe[..., 1]).all()
    check_against_native(prompt + sampled[:-1], first, raw_routes)


async def test_a_stop_token_ends_the_response_where_it_is_first_sampled(vllm_fp32):
    prompt = random_tokens(21, 6)
    async with client(vllm_fp32.url, "vllm") as engine:
        free = await engine.generate(prompt, params(8, seed=5), return_routed_experts=True)
        stop = free.response_ids[3]
        cut = free.response_ids.index(stop) + 1  # the stop token is returned, nothing after it
        stopped = await engine.generate(
            prompt, params(8, seed=5, stop_token_ids=[stop]), return_routed_experts=True
        )
    assert stopped.response_ids == free.response_ids[:cut]
    assert stopped.stop_reason == "stop" and free.stop_reason == "length"
    # the same seed samples the same tokens: the rows up to the stop are the free run's
    assert stopped.routed_experts.shape[0] == len(prompt) + cut - 1
    assert np.array_equal(stopped.routed_experts, free.routed_experts[: len(prompt) + cut - 1])


def prefix_cache_hits(url: str) -> float:
    """vLLM's ``prefix_cache_hits`` counter (tokens served from cached blocks) from ``/metrics``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


@pytest.mark.parametrize("protocol", ["vllm", "openai"])
async def test_a_prefix_cache_hit_returns_the_same_routes(vllm_fp32, protocol):
    prompt = random_tokens(40 + len(protocol), 150)  # longer than a KV block (16 to 128 tokens)
    async with client(vllm_fp32.url, protocol) as engine:
        first = await engine.generate(prompt, params(4, seed=9), return_routed_experts=True)
        hits = prefix_cache_hits(vllm_fp32.url)
        again = await engine.generate(prompt, params(4, seed=9), return_routed_experts=True)
    assert prefix_cache_hits(vllm_fp32.url) > hits  # the premise: the prompt's blocks were cached
    assert again.response_ids == first.response_ids
    assert np.array_equal(again.routed_experts, first.routed_experts)
    check_against_native(prompt + first.response_ids[:-1], 0, first.routed_experts.astype(np.int64))
