"""Shared pieces of the client and collector tests: a client or collector for FaultServers and
the checks of what a server generated (the independent reference: expected_generation)."""

from __future__ import annotations

import dataclasses

import numpy as np
from fault_server import FaultServer, expected_generation

from r3lightning import RemoteGenerateClient, RolloutCollector, RolloutPrompt, SamplingConfig
from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.rollout.config import Backoff, CollectorConfig, RetryPolicy
from r3lightning.wire.request import RouteSchema

SCHEMA = {"num_layers": 3, "top_k": 2, "num_experts": 300}
FAST = Backoff(base_s=0.001, cap_s=0.004)
PROMPT = [5, 6, 7, 8]
_RETRY_FIELDS = {f.name for f in dataclasses.fields(RetryPolicy)}


def make_client(server: FaultServer, protocol: str = "skyrl", **options) -> RemoteGenerateClient:
    """A client of ``server``; ``options`` are RetryPolicy fields (defaults: 3 fast attempts,
    5 s each) or client keywords."""
    retry = {"backoff": FAST, "max_attempts": 3, "timeout_s": 5.0}
    retry.update({k: options.pop(k) for k in list(options) if k in _RETRY_FIELDS})
    options.setdefault("schema", RouteSchema(**SCHEMA))
    return RemoteGenerateClient(server.url, protocol=protocol, retry=RetryPolicy(**retry), **options)


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


# ---------------------------------------------------------------------------- collector

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
FAST_RETRY = RetryPolicy(max_attempts=2, backoff=Backoff(base_s=0.001, cap_s=0.001))


def prompt_reward(prompt: RolloutPrompt, response: list[int]) -> float:
    return float(sum(prompt.token_ids) % 3)


def make_collector(
    engines, reward=prompt_reward, retry=FAST_RETRY, schema=None, advantages=None, **settings
) -> RolloutCollector:
    """A collector of groups of 2, 3 new tokens each (GRPO advantages unless ``advantages``);
    ``settings`` are CollectorConfig fields."""
    config = CollectorConfig(**{"group_size": 2, "progress": False, **settings})
    schema = RouteSchema(**SCHEMA) if schema is None else schema
    sampling = SamplingConfig(max_new_tokens=3)
    return RolloutCollector(
        engines,
        reward,
        config,
        advantages=advantages or GRPOAdvantages(),
        schema=schema,
        sampling=sampling,
        client_options={"retry": retry},
    )


async def collect(engines, prompts, step: int, **kwargs):
    """One step with a fresh collector, closed afterwards."""
    async with make_collector(engines, **kwargs) as collector:
        return await collector.collect_async(prompts, step=step)
