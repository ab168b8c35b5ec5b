"""The collector applies the advantage function it is given, and the job gives it GRPO's with
``algorithm.normalize_std`` and ``algorithm.std_eps``."""

from __future__ import annotations

import math

import pytest
import torch
from fault_server import FaultServer
from rollout_support import PROMPTS, SCHEMA, make_collector, prompt_reward

from r3lightning import RolloutCollector, RolloutPrompt
from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.rollout.config import CollectorConfig


async def test_every_trajectory_carries_what_the_advantage_function_returns():
    seen = []

    def affine(rewards):  # not GRPO's: a collector that ignored it would give zeros here
        seen.append(rewards.tolist())
        return rewards * 10 + 1

    async with FaultServer(**SCHEMA) as server, make_collector(server.url, advantages=affine) as collector:
        rollouts = await collector.collect_async(PROMPTS, step=0)
    rewards = [prompt_reward(RolloutPrompt(p), []) for p in PROMPTS]
    assert seen == [[r, r] for r in rewards]  # one call per group, its rewards in sample order
    assert [t.advantage for t in rollouts.trajectories] == [10 * r + 1 for r in rewards for _ in range(2)]


async def test_an_advantage_function_that_returns_the_wrong_shape_or_nan_is_refused():
    async with FaultServer(**SCHEMA) as server:
        for advantages, message in [
            (lambda rewards: rewards[:1], r"^advantages must return a tensor of shape \(2,\), got \(1,\)$"),
            (
                lambda rewards: rewards.tolist(),
                r"^advantages must return a tensor of shape \(2,\), got list$",
            ),
            (lambda rewards: rewards * math.nan, r"^advantages must be finite, got \[nan, nan\]"),
        ]:
            with pytest.raises(ValueError, match=message):
                async with make_collector(server.url, advantages=advantages) as collector:
                    await collector.collect_async(PROMPTS[:1], step=0)
    with pytest.raises(TypeError, match=r"^advantages must be callable, got float$"):
        RolloutCollector("http://a:1", prompt_reward, CollectorConfig(group_size=2), advantages=1.0)


def test_grpo_advantages_normalise_by_the_std_plus_std_eps_or_only_centre():
    rewards = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    std = 1.0  # unbiased std of 0, 1, 2
    got = GRPOAdvantages(normalize_std=True, std_eps=0.25)(rewards)
    assert got.tolist() == pytest.approx([-1 / (std + 0.25), 0.0, 1 / (std + 0.25)])
    assert GRPOAdvantages(normalize_std=False, std_eps=0.25)(rewards).tolist() == [-1.0, 0.0, 1.0]


@pytest.mark.parametrize("normalize_std", [True, False])
def test_the_job_gives_its_collector_algorithm_std_eps_and_normalize_std(normalize_std):
    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.rollout_loop import Engine, RolloutLoop
    from r3lightning.wire.request import RouteSchema

    overrides = ["algorithm.std_eps=0.5", f"algorithm.normalize_std={str(normalize_std).lower()}"]
    cfg = compose_config(overrides)
    task = type("Task", (), {"prompts": None, "score_prompt": staticmethod(prompt_reward)})()
    loop = RolloutLoop(cfg, Engine(["http://127.0.0.1:1"]), task, RouteSchema(3, 2, 8), None, None)
    collector = loop.new_collector(["http://127.0.0.1:1"])
    got = collector.advantages(torch.tensor([0.0, 1.0], dtype=torch.float64)).tolist()
    if normalize_std:  # centred [-0.5, 0.5] over the unbiased std sqrt(0.5) plus std_eps 0.5
        expected = [-0.5 / (math.sqrt(0.5) + 0.5), 0.5 / (math.sqrt(0.5) + 0.5)]
    else:
        expected = [-0.5, 0.5]
    assert got == pytest.approx(expected)
