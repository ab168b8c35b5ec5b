"""RolloutCollector against a real vLLM engine (fp32): multi-turn capture through an
Environment, routes sliced to a rank's layers, and failover from a dead engine; every
trajectory's routes checked against transformers' native fp32 routes of its whole sequence."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from loopback import hung_engine
from vllm_reference import native_routes

from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.app.vllm import tiny_vllm_moe_config
from r3lightning.rollout.collector import RolloutCollector
from r3lightning.rollout.config import Backoff, CollectorConfig, RetryPolicy, route_schema
from r3lightning.rollout.environment import Environments
from r3lightning.rollout.prompts import SamplingConfig

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 6, 7, 8, 9], [30, 31, 32]]
RETRY = RetryPolicy(
    max_attempts=2, timeout_s=120.0, connect_timeout_s=2.0, backoff=Backoff(base_s=0.01, cap_s=0.01)
)


class ToolEnv:
    """Three turns; observations of 2, 3 and 4 tokens (a tool's answer); reward = the turn."""

    def __init__(self):
        self.turn = 0

    def reset(self, prompt):
        return prompt.token_ids

    def step(self, response):
        self.turn += 1
        return [40 + self.turn] * (self.turn + 1), float(self.turn), self.turn == 3, {}


def single_turn_reward(prompt, response) -> float:
    return float(len(response))


def collector(engines, reward, *, protocol: str = "vllm", layers=None, retry=RETRY) -> RolloutCollector:
    return RolloutCollector(
        engines,
        reward,
        CollectorConfig(group_size=2, seed=3, protocol=protocol, progress=False),
        advantages=GRPOAdvantages(),
        schema=route_schema(tiny_vllm_moe_config(), layers=layers),
        sampling=SamplingConfig(max_new_tokens=5, ignore_eos=True),
        client_options={"retry": retry},
    )


def assert_native(trajectory, layers=(0, 1, 2, 3)) -> None:
    """Every row of the trajectory (token t's experts, t < n - 1) is transformers' fp32 choice for
    that token in the whole sequence, wherever the router's top-k is not a near tie."""
    tokens = trajectory.prompt_ids.tolist() + trajectory.response_ids.tolist()
    native, margin = native_routes(tokens)
    routes = np.sort(trajectory.routed_experts.long().numpy(), axis=-1)  # [n - 1, len(layers), K]
    assert routes.shape[0] == len(tokens) - 1
    native, clear = native[:-1, list(layers)], margin[:-1, list(layers)] > 1e-4
    assert clear.mean() > 0.9  # the premise: almost every slot is decided by a clear gap
    assert np.array_equal(routes[clear], native[clear])


@pytest.mark.parametrize("protocol", ["vllm", "openai"])
def test_multi_turn_routes_are_captured_turn_by_turn(vllm_fp32, protocol):
    trajectories = (
        collector(vllm_fp32.url, Environments(ToolEnv, max_turns=5), protocol=protocol)
        .collect(PROMPTS, step=0)
        .trajectories
    )
    assert len(trajectories) == 4
    for trajectory in trajectories:
        # 3 turns of 5 sampled tokens, observations of 2 and 3 tokens between them
        assert len(trajectory.response_ids) == 5 + 2 + 5 + 3 + 5
        assert trajectory.loss_mask.tolist() == [1.0] * 5 + [0.0] * 2 + [1.0] * 5 + [0.0] * 3 + [1.0] * 5
        assert trajectory.reward == 1.0 + 2.0 + 3.0
        assert_native(trajectory)


def test_routes_sliced_to_a_ranks_layers_are_the_full_routes_columns(vllm_fp32):
    full = collector(vllm_fp32.url, single_turn_reward).collect(PROMPTS, step=0).trajectories
    sliced = collector(vllm_fp32.url, single_turn_reward, layers=[1, 3]).collect(PROMPTS, step=0).trajectories
    for whole, part in zip(full, sliced, strict=True):
        assert part.response_ids.tolist() == whole.response_ids.tolist()  # same seeds, same samples
        assert part.route_layers == (1, 3)
        assert part.routed_experts.shape[1] == 2
        assert np.array_equal(part.routed_experts.numpy(), whole.routed_experts[:, [1, 3]].numpy())
        assert_native(part, layers=(1, 3))


def dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_dead_and_a_hung_engine_fail_over_to_the_real_one(vllm_fp32):
    async with collector(vllm_fp32.url, single_turn_reward) as alone:
        reference = (await alone.collect_async(PROMPTS * 2, step=4)).trajectories
    # a hung engine is declared out by its health probes, not by the (long) request timeout
    retry = RetryPolicy(
        max_attempts=2, timeout_s=120.0, connect_timeout_s=2.0, health_interval_s=0.5, health_timeout_s=0.5
    )
    async with hung_engine() as hung:
        engines = [f"http://127.0.0.1:{dead_port()}", vllm_fp32.url, hung]
        async with collector(engines, single_turn_reward, retry=retry) as failing_over:
            rollouts = await failing_over.collect_async(PROMPTS * 2, step=4)
    assert rollouts.stats.engines_out == 2
    # every group of the two failed engines moved to the real one, with its seeds
    assert [t.response_ids.tolist() for t in rollouts.trajectories] == [
        t.response_ids.tolist() for t in reference
    ]
    for trajectory in rollouts.trajectories:
        assert_native(trajectory)
