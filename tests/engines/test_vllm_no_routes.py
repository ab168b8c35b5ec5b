"""A real vLLM engine started without ``--enable-return-routed-experts`` (routes are a
server-wide switch, so this is its own short-lived engine): asking it for routes is one line that
names the flag, and a collect that fails on it leaves the replay buffer exactly as it was."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm_engines import start_engine

from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.app.vllm import VllmServer, tiny_vllm_moe_config
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.collector import RolloutCollector
from r3lightning.rollout.config import CollectorConfig, RetryPolicy
from r3lightning.rollout.environment import Environments
from r3lightning.rollout.prompts import SamplingConfig
from r3lightning.rollout.stats import GroupsDroppedError
from r3lightning.wire.errors import MalformedResponseError

pytestmark = pytest.mark.vllm

FLAG = "--enable-return-routed-experts"
PROMPTS = [[5, 6, 7, 8, 9], [30, 31, 32]]
RETRY = RetryPolicy(max_attempts=1, timeout_s=120.0)


@pytest.fixture(scope="module")
def vllm_no_routes(vllm_engine_python, vllm_model_dir, tmp_path_factory) -> Iterator[VllmServer]:
    logs = tmp_path_factory.mktemp("logs")
    yield from start_engine(vllm_model_dir, vllm_engine_python, logs, dtype="float32", routed_experts=False)


class TwoTurns:
    """Two turns with a 2-token observation between them."""

    def __init__(self):
        self.turn = 0

    def reset(self, prompt):
        return prompt.token_ids

    def step(self, response):
        self.turn += 1
        return [40, 41], 1.0, self.turn == 2, {}


def collector(url: str | list[str], *, request_routes: bool = True, reward=None) -> RolloutCollector:
    config = CollectorConfig(
        group_size=2, seed=1, protocol="vllm", request_routes=request_routes, progress=False
    )
    sampling = SamplingConfig(max_new_tokens=4, ignore_eos=True)
    schema = tiny_vllm_moe_config()
    return RolloutCollector(
        url,
        reward or (lambda prompt, response: 1.0),
        config,
        advantages=GRPOAdvantages(),
        schema=schema,
        sampling=sampling,
        client_options={"retry": RETRY},
    )


@pytest.mark.parametrize("protocol", ["vllm", "openai"])
async def test_asking_for_routes_is_one_line_naming_the_flag(vllm_no_routes, protocol):
    async with RemoteGenerateClient(vllm_no_routes.url, protocol=protocol, retry=RETRY) as client:
        plain = await client.generate([5, 6, 7], {"max_tokens": 3, "ignore_eos": True})
        assert len(plain.response_ids) == 3  # the engine serves; only the routes are missing
        with pytest.raises(MalformedResponseError) as caught:
            await client.generate(
                [5, 6, 7], {"max_tokens": 3, "ignore_eos": True}, return_routed_experts=True
            )
    message = str(caught.value)
    assert FLAG in message and "\n" not in message


def snapshot(buffer: ReplayBuffer) -> list[tuple]:
    return [
        (t.prompt_ids.tolist(), t.response_ids.tolist(), t.routed_experts.tolist(), t.reward) for t in buffer
    ]


def test_a_collect_without_routes_leaves_the_buffer_as_it_was(vllm_fp32, vllm_no_routes):
    buffer = ReplayBuffer(num_experts=8)
    collector(vllm_fp32.url).collect(PROMPTS, step=0, buffer=buffer)
    before, stop = snapshot(buffer), buffer.stop
    assert len(before) == 4
    # groups 0 and 2 go to the engine with routes and succeed, groups 1 and 3 to the one without
    with pytest.raises(MalformedResponseError, match=FLAG):
        collector([vllm_fp32.url, vllm_no_routes.url]).collect(PROMPTS * 2, step=1, buffer=buffer)
    # nothing half-added, nothing lost: the same trajectories, the same sequence numbers
    assert (buffer.start, buffer.stop) == (0, stop) and snapshot(buffer) == before
    # the same engine without routes asked for: trajectories without routes, added whole
    collected = collector(vllm_no_routes.url, request_routes=False).collect(PROMPTS, step=2)
    assert all(t.routed_experts is None for t in collected.trajectories)
    assert torch.equal(collected.trajectories[0].prompt_ids, torch.tensor(PROMPTS[0]))


def test_a_multi_turn_collect_without_routes_is_one_line_and_adds_nothing(vllm_no_routes):
    buffer = ReplayBuffer(num_experts=8)
    with pytest.raises(GroupsDroppedError) as caught:
        collector(vllm_no_routes.url, reward=Environments(TwoTurns, max_turns=3)).collect(
            PROMPTS, step=0, buffer=buffer
        )
    message = str(caught.value)
    assert FLAG in message and "\n" not in message  # the first group's error, in the one line
    assert len(buffer) == 0 and buffer.stop == 0
