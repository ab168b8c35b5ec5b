"""Multi-turn trajectories from the embedded engine (RolloutServer on 127.0.0.1), replayed.

Replaying a finished trajectory's captured routes over its whole token sequence in one forward
must use exactly the engine's experts on every row (observations and turn boundaries
included) and give the engine's logprobs on every sampled token.
"""

from __future__ import annotations

import pytest
import torch

from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig
from r3lightning.app.serve.server import RolloutServer
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.rollout.collector import RolloutCollector
from r3lightning.rollout.config import CollectorConfig
from r3lightning.rollout.environment import Environments
from r3lightning.rollout.prompts import SamplingConfig

MOE_LAYERS = [1, 2, 3]  # layer 0 of the tiny model is dense
PROMPTS = [[5, 6, 7, 8, 9], [30, 31, 32]]


class ToolEnv:
    """Three turns; observations of 2 and 3 tokens (the tool's answer), reward = turn index."""

    def __init__(self):
        self.turn = 0

    def reset(self, prompt):
        return prompt.token_ids

    def step(self, response):
        self.turn += 1
        return [40 + self.turn] * (self.turn + 1), float(self.turn), self.turn == 3, {}


def collect(server_model, **engine):
    with RolloutServer(server_model, engine=EngineConfig(**engine)) as server:
        collector = RolloutCollector(
            server.url,
            Environments(ToolEnv, max_turns=5),
            CollectorConfig(group_size=2, progress=False),
            advantages=GRPOAdvantages(),
            schema=server_model.config,
            sampling=SamplingConfig(max_new_tokens=6, ignore_eos=True),
        )
        return collector.collect(PROMPTS, step=0).trajectories


def replay(model, trajectory):
    """(native rows, used rows, replayed logprobs) of one forward over the whole trajectory."""
    ids = torch.cat([trajectory.prompt_ids, trajectory.response_ids])[None]  # [1, n]
    n = ids.shape[1]
    rows = trajectory.routed_experts.long()  # [n - 1, L, K]
    routes = torch.cat([rows, rows[-1:]])[None]  # the last token has no row: a masked placeholder
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, -1] = False
    with torch.no_grad():
        with record_routes(model) as native:
            model(input_ids=ids)
        with replay_routes(model, routes, mask), record_routes(model) as used:
            logits = model(input_ids=ids).logits[0].double()  # [n, V]
    logprobs = logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]  # token t from row t - 1
    return native.routes[0, : n - 1], used.routes[0, : n - 1], logprobs[trajectory.prompt_length - 1 :]


def test_fp32_engine_rows_are_a_full_forwards_and_replay_gives_its_logprobs():
    """In fp32 a prefill and token-by-token decoding route alike, so every stitched row (turn
    boundaries included) must equal the row of one forward over the final sequence."""
    model = build_tiny_moe(seed=0)
    trajectories = collect(build_tiny_moe(seed=0), dtype=torch.float32)
    assert len(trajectories) == 4
    for t in trajectories:
        assert t.response_length == 6 + 2 + 6 + 3 + 6 and t.route_rows == t.num_tokens - 1
        native, used, logprobs = replay(model, t)
        rows = t.routed_experts.long()
        assert torch.equal(native[:, MOE_LAYERS], rows[:, MOE_LAYERS])
        assert torch.equal(used[:, MOE_LAYERS], rows[:, MOE_LAYERS])
        sampled = t.loss_mask.bool()
        assert sampled.tolist() == [True] * 6 + [False] * 2 + [True] * 6 + [False] * 3 + [True] * 6
        assert logprobs[sampled].tolist() == pytest.approx(t.rollout_logprobs[sampled].tolist(), abs=2e-5)
        assert (t.rollout_logprobs[~sampled] == 0).all()


def test_replay_uses_every_engine_expert_where_the_trainer_would_route_differently():
    """A bf16 engine with simulated disagreement routes ~15% of slots unlike the fp32 trainer;
    replaying its rows makes the trainer use exactly its experts on every row (100% agreement)."""
    model = build_tiny_moe(seed=0)
    trajectories = collect(build_tiny_moe(seed=0), simulated_disagreement=0.15)
    differ = total = 0
    for t in trajectories:
        native, used, _ = replay(model, t)
        rows = t.routed_experts.long()[:, MOE_LAYERS]
        assert torch.equal(used[:, MOE_LAYERS].sort(-1).values, rows.sort(-1).values)
        differ += int((native[:, MOE_LAYERS].sort(-1).values != rows.sort(-1).values).any(-1).sum())
        total += rows.shape[0] * len(MOE_LAYERS)
    assert 0.05 < differ / total < 0.5  # the replay had something to fix
