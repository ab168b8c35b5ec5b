"""Boundaries of the rollout layer, each tried on both sides: the client's URL and route start,
an environment's ``done``, and per-turn statistics that grow only with the turns reached."""

from __future__ import annotations

import numpy as np
import pytest
from fault_server import FaultServer
from rollout_support import PROMPT, check_result, generate, make_client
from turn_engine import TurnEngine

from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.app.tasks.token_class import ScoredTask
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.collector import RolloutCollector
from r3lightning.rollout.config import Backoff, CollectorConfig, RetryPolicy
from r3lightning.rollout.environment import Environments
from r3lightning.rollout.episode import run_episode
from r3lightning.rollout.prompts import RolloutPrompt, SamplingConfig
from r3lightning.wire.request import RouteSchema

L, K, G = 3, 2, 3
ONE_TRY = RetryPolicy(max_attempts=1, backoff=Backoff(base_s=0.001, cap_s=0.001))


@pytest.mark.parametrize("url", [None, 8000, b"http://127.0.0.1:8000", "127.0.0.1:8000", "ftp://host"])
def test_a_base_url_that_is_not_an_http_url_is_one_value_error(url):
    with pytest.raises(ValueError, match=r"base_url must be a URL starting with http:// or https://, got "):
        RemoteGenerateClient(url)
    assert RemoteGenerateClient("https://engine:8000/").base_url == "https://engine:8000"


async def test_a_route_start_at_the_prompt_length_asks_for_the_response_rows_only():
    async with FaultServer() as server, make_client(server) as client:
        result = await generate(client, start=len(PROMPT))  # the boundary itself is valid
        with pytest.raises(ValueError, match=r"must be <= the prompt length 4, got 5"):
            await generate(client, start=len(PROMPT) + 1)
    check_result(result, start=len(PROMPT))
    assert result.routed_experts.shape == (4 - 1, 3, 2)  # rows [P, P + G - 1) of a 4-token response
    assert server.requests[0][1]["sampling_params"]["routed_experts_prompt_start"] == len(PROMPT)
    assert server.hits == 1  # the refused start never reached the engine


class DoneAt:
    """Ends with ``done`` (as given) at turn ``at``; ``done=False`` before."""

    def __init__(self, at: int, done):
        self.at, self.done, self.turn = at, done, 0

    def reset(self, prompt):
        return prompt.token_ids

    def step(self, response):
        turn, self.turn = self.turn, self.turn + 1
        return [40 + turn], 1.0, self.done if turn == self.at else False, {}


@pytest.mark.parametrize(
    ("done", "turns"), [(True, 2), (np.bool_(True), 2), (False, 4), ("false", None), (1, None), (None, None)]
)
async def test_done_must_be_a_bool(done, turns):
    engine = TurnEngine(num_layers=L, top_k=K)
    async with engine, RemoteGenerateClient(engine.url, retry=ONE_TRY) as client:

        def run(tokens, turn, start):
            return client.generate(tokens, {"max_tokens": G, "seed": turn})

        episode = run_episode(DoneAt(1, done), RolloutPrompt([11, 12]), run, max_turns=4, trace=None)
        if turns is None:
            with pytest.raises(ValueError, match=rf"turn 1: step\(\)'s done must be a bool, got {done!r}"):
                await episode
        else:
            assert len((await episode).turn_rewards) == turns
            assert len(engine.requests) == turns


class TwoTurns(DoneAt):
    def __init__(self):
        super().__init__(1, True)


async def test_per_turn_statistics_cover_the_turns_reached_not_max_turns():
    """max_turns=10**6 with episodes of two turns: two turns of counters and metrics (once 2M
    keys and seconds of work per collect). Routes of 300 experts travel as int16, so bytes are
    twice the ids (16 experts would make the two equal)."""
    schema = {"num_layers": L, "top_k": K, "num_experts": 300}
    prompts = [[11, 12, 13], [14, 15]]
    config = CollectorConfig(group_size=2, progress=False)
    buffer = ReplayBuffer(num_experts=300)
    async with TurnEngine(**schema) as engine:
        environments = Environments(TwoTurns, max_turns=10**6)
        async with RolloutCollector(
            engine.url,
            environments,
            config,
            advantages=GRPOAdvantages(),
            schema=RouteSchema(**schema),
            sampling=SamplingConfig(max_new_tokens=G),
            client_options={"retry": ONE_TRY},
        ) as collector:
            stats = (await collector.collect_async(prompts, step=0, buffer=buffer)).stats
    assert max(int(t.routed_experts.max()) for t in buffer) >= 256  # the premise: int16 ids
    assert stats.turns == 2.0 and stats.turn_rewards == (1.0, 1.0)
    first_rows = sum(len(p) + G - 1 for p in prompts) / len(prompts)
    second_rows = 1 + 1 + G - 1  # the last response token, the observation, the new response
    assert stats.turn_route_bytes == (first_rows * L * K * 2, second_rows * L * K * 2)
    metrics = stats.turn_metrics()
    assert sorted(metrics) == [
        "dropped_groups",
        "route_bytes/turn_1",
        "route_bytes/turn_2",
        "turn_reward/turn_1",
        "turn_reward/turn_2",
        "turns",
    ]


class GroundTruthPrompts:
    """``sample_prompts`` giving ``RolloutPrompt`` records with their ground truth."""

    def sample_prompts(self, num_prompts, generator):
        return [RolloutPrompt([11, 12 + i], ground_truth=str(i)) for i in range(num_prompts)]


def test_sample_prompts_may_return_rollout_prompts_with_ground_truth():
    def reward(prompt_ids, response_ids):
        return 0.0

    task = ScoredTask(GroundTruthPrompts(), reward)
    prompts = task.prompts_for_step(0, 2, seed=0)
    assert [(p.token_ids, p.ground_truth) for p in prompts] == [([11, 12], "0"), ([11, 13], "1")]
