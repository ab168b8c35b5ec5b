"""Multi-turn collection on two gloo ranks: each rank runs its own groups' episodes; the per-turn
statistics and dropped groups are reduced over both; the trajectories are those of one rank."""

from __future__ import annotations

import numpy as np
import pytest
from gloo_ranks import run_ranks
from loopback import served_in_thread
from turn_engine import TurnEngine

from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.rollout.collector import RolloutCollector
from r3lightning.rollout.config import CollectorConfig
from r3lightning.rollout.environment import Environments
from r3lightning.rollout.prompts import SamplingConfig
from r3lightning.wire.request import RouteSchema

pytestmark = pytest.mark.slow
SCHEMA = RouteSchema(3, 2, 16)
PROMPTS = [[11, 12, 13], [14, 15], [16, 17, 18, 19], [20]]


class TwoCalls:
    """Observation ``[41]``, reward 1 per turn; done after 3 turns, or after 2 for odd prompts;
    the prompt ``[20]`` (group 3) fails its second turn when ``fail`` is set."""

    fail = False

    def reset(self, prompt):
        self.prompt, self.turn = prompt.token_ids, 0
        return self.prompt

    def step(self, response):
        self.turn += 1
        if self.fail and self.prompt == [20] and self.turn == 2:
            raise RuntimeError("tool down")
        return [41], 1.0, self.turn == (2 if len(self.prompt) % 2 else 3), {}


class FailingCalls(TwoCalls):
    fail = True


def collect(url, env):
    collector = RolloutCollector(
        url,
        Environments(env, max_turns=3),
        CollectorConfig(group_size=2, seed=9, progress=False),
        advantages=GRPOAdvantages(),
        schema=SCHEMA,
        sampling=SamplingConfig(max_new_tokens=3),
    )
    return collector.collect(PROMPTS, step=4)


def summary(rollouts):
    trajectories = [
        (t.prompt_ids.tolist(), t.response_ids.tolist(), t.routed_experts.tolist())
        for t in rollouts.trajectories
    ]
    return rollouts.groups, trajectories, rollouts.stats.as_dict()


def _rank_worker(rank: int, url: str, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out[rank] = (summary(collect(url, TwoCalls)), summary(collect(url, FailingCalls)))


def test_two_ranks_collect_their_own_episodes_and_reduce_the_turn_statistics():
    import torch.multiprocessing as mp

    engine = TurnEngine(num_layers=3, top_k=2, num_experts=16)
    with served_in_thread(engine):
        alone = summary(collect(engine.url, TwoCalls))  # one rank: every group
        with mp.Manager() as manager:
            out = manager.dict()
            run_ranks(_rank_worker, engine.url, out, nprocs=2)
            result = dict(out)
    _, trajectories, stats = alone
    for rank, mine in ((0, [0, 1]), (1, [2, 3])):
        (got_groups, got, got_stats), _ = result[rank]
        assert got_groups == mine
        assert got == trajectories[2 * mine[0] : 2 * mine[-1] + 2]  # seeds do not depend on ranks
        assert got_stats == pytest.approx({**stats, "rollout_s": got_stats["rollout_s"]})
    # groups 1 and 2 take 3 turns (even prompt lengths), groups 0 and 3 take 2
    assert (stats["turns"], stats["turn_reward/turn_3"], stats["route_bytes/turn_3"]) == (
        2.5,
        1.0,
        (1 + 1 + 2) * 6,
    )
    failing = [result[rank][1] for rank in (0, 1)]
    assert failing[0][2] == pytest.approx({**failing[1][2], "rollout_s": failing[0][2]["rollout_s"]})
    assert failing[0][2]["dropped_groups"] == 1 and failing[0][2]["trajectories"] == 6
    assert [len(f[1]) for f in failing] == [4, 2]  # rank 1 lost group 3, whole
    assert np.isclose(failing[0][2]["turns"], (3 * 2 + 2 * 2 + 3 * 2) / 6)
