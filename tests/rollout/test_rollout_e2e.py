"""RemoteGenerateClient <-> embedded RolloutServer on loopback, both protocols, multi-turn traces.

The server answers; the engine behind it is queried directly for the reference of the same
request (same seed, run alone), so a round trip must reproduce it token for token and row for row.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.serve.engine import GenerationRequest
from r3lightning.app.serve.sampling import SamplingParams
from r3lightning.app.serve.server import RolloutServer
from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.config import RetryPolicy
from r3lightning.rollout.trace import RoutedExpertTrace
from r3lightning.wire.errors import GenerateRequestError
from r3lightning.wire.request import RouteSchema

SCHEMA = {"num_layers": 4, "top_k": 2, "num_experts": 8}


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def server():
    with RolloutServer(
        engine=EngineConfig(seed=0), api_key="key"
    ) as srv:  # bf16 tiny MoE, as the main job serves it
        yield srv


@pytest.fixture(scope="module")
def fp32_server():
    with RolloutServer(build_tiny_moe(seed=0), engine=EngineConfig(dtype=torch.float32)) as srv:
        yield srv


def _client(url: str, protocol: str, **kwargs) -> RemoteGenerateClient:
    return RemoteGenerateClient(
        url, protocol=protocol, schema=RouteSchema(**SCHEMA), retry=RetryPolicy(max_attempts=1), **kwargs
    )


@pytest.mark.parametrize("protocol", ["skyrl", "sglang"])
async def test_round_trip_reproduces_the_engine(server, protocol):
    prompt = _prompt(1, 7)
    seed_key = "seed" if protocol == "skyrl" else "sampling_seed"
    length_key = "max_tokens" if protocol == "skyrl" else "max_new_tokens"
    params = {length_key: 9, seed_key: 5, "temperature": 0.9, "top_p": 0.95, "ignore_eos": True}
    async with _client(server.url, protocol, api_key="key") as client:
        result = await client.generate(
            prompt, params, return_routed_experts=True, routed_experts_prompt_start=3, session_id="s1"
        )
    expected = server.engine.generate(
        [
            GenerationRequest(
                prompt,
                SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True),
                return_routed_experts=True,
                routed_experts_prompt_start=3,
            )
        ]
    )[0]
    assert result.response_ids == expected.token_ids
    assert result.response_logprobs == pytest.approx(expected.logprobs, abs=0, rel=1e-7)
    assert result.stop_reason == "length"
    assert result.routed_experts.dtype.itemsize == 1  # compact on the wire and on the host
    assert result.routed_experts.shape == (7 - 3 + 9 - 1, 4, 2)
    assert (result.routed_experts == expected.routed_experts).all()


@pytest.mark.parametrize("protocol", ["skyrl", "sglang"])
async def test_multi_turn_prompt_starts_equal_one_full_conversation_capture(fp32_server, protocol):
    """Two turns, each asking only for rows past the trace's prompt_start, give exactly the rows
    of one capture over the whole conversation.

    The full capture sends the finished conversation as a prompt (``max_new_tokens=1``) and keeps
    its first ``n - 1`` rows. Served in fp32: a prefill and a token-by-token decode of the same
    tokens then route identically, so equality is exact; in bf16 their numerics differ and a few
    near-tied experts may flip (the bf16 token alignment is proven exactly in test_server.py).
    """
    length_key = "max_tokens" if protocol == "skyrl" else "max_new_tokens"
    trace = RoutedExpertTrace(**SCHEMA)
    conversation = _prompt(2, 6)
    async with _client(fp32_server.url, protocol) as client:
        for turn, user in enumerate((None, _prompt(3, 4))):
            if user is not None:
                conversation = conversation + user
            result = await client.generate(
                conversation,
                {length_key: 7, "temperature": 1.0, "ignore_eos": True, "seed": turn, "sampling_seed": turn},
                return_routed_experts=True,
                routed_experts_prompt_start=trace.prompt_start,
            )
            trace.record_generation(len(conversation), len(result.response_ids), result.routed_experts)
            conversation = conversation + result.response_ids
        full = await client.generate(
            conversation, {length_key: 1}, return_routed_experts=True, routed_experts_prompt_start=0
        )
    rows = trace.finalize(len(conversation))
    assert rows.shape == (len(conversation) - 1, 4, 2) == (6 + 7 + 4 + 7 - 1, 4, 2)
    assert torch.equal(rows, torch.from_numpy(full.routed_experts[: len(conversation) - 1]))


async def test_errors_surface_as_typed_client_errors(server):
    async with _client(server.url, "skyrl", api_key="key") as client:
        with pytest.raises(
            GenerateRequestError, match=r"sampling_params\.top_p must be a number > 0 and <= 1"
        ) as info:
            await client.generate([5, 6], {"top_p": 7})
        assert info.value.status == 400
        with pytest.raises(GenerateRequestError, match=r"token_ids holds token id 400 at index 0") as info:
            await client.generate([400])
        assert info.value.status == 400
        assert client.stats.attempts == 2  # never retried
    async with _client(server.url, "sglang", api_key="wrong") as client:
        with pytest.raises(GenerateRequestError, match="bearer token") as info:
            await client.generate([5, 6])
        assert info.value.status == 401
    async with (
        RolloutServer(build_tiny_moe(seed=0), limits=ServerLimits(max_request_bytes=512)) as small,
        _client(small.url, "sglang") as client,
    ):
        with pytest.raises(GenerateRequestError, match="exceeds the cap of 512 bytes") as info:
            await client.generate(_prompt(4, 200))
        assert info.value.status == 413
        assert (await client.generate([5, 6], {"max_new_tokens": 2})).response_ids  # still serving


async def test_many_concurrent_requests(fp32_server):
    """96 requests in flight at once: batched by the server, each equals its own run alone."""
    prompts = [_prompt(100 + i, 3 + i % 9) for i in range(96)]
    async with _client(fp32_server.url, "skyrl") as client:
        results = await asyncio.gather(
            *(
                client.generate(
                    p, {"max_tokens": 4, "seed": i, "ignore_eos": True}, return_routed_experts=True
                )
                for i, p in enumerate(prompts)
            )
        )
    for i in (0, 17, 95):
        alone = fp32_server.engine.generate(
            [
                GenerationRequest(
                    prompts[i],
                    SamplingParams(max_new_tokens=4, seed=i, ignore_eos=True),
                    return_routed_experts=True,
                )
            ]
        )[0]
        assert results[i].response_ids == alone.token_ids
        assert (results[i].routed_experts == alone.routed_experts).all()
    assert all(len(r.response_ids) == 4 for r in results)
    assert [r.routed_experts.shape[0] for r in results] == [len(p) + 3 for p in prompts]


@pytest.mark.slow
def test_command_line_server_serves_and_stops_on_sigterm():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "r3lightning.app.serve.cli",
            "--port",
            "0",
            "--api-key",
            "cli",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")

        async def ask():
            async with _client(match.group(1), "sglang", api_key="cli") as client:
                assert await client.health()
                return await client.generate(
                    [5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True}, return_routed_experts=True
                )

        result = asyncio.run(ask())
        assert len(result.response_ids) == 3 and result.routed_experts.shape == (3 + 3 - 1, 4, 2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
