"""RolloutCollector with an environment: multi-turn groups against scripted engines on 127.0.0.1.

Pins turn counts, masks, rows, seeds per turn, metrics, whole-group drops on a failing turn, and
a failover to another engine in the middle of a trajectory.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from typing import ClassVar

import numpy as np
import pytest
from fault_server import FaultServer, Status
from turn_engine import TurnEngine, route_row

from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.rollout.collector import EnginesUnavailableError, RolloutCollector
from r3lightning.rollout.config import Backoff, CollectorConfig, RetryPolicy
from r3lightning.rollout.environment import Environments, TextEnvironment, text_environment
from r3lightning.rollout.prompts import RolloutPrompt, SamplingConfig, TextReward
from r3lightning.rollout.stats import GroupsDroppedError
from r3lightning.wire.request import RouteSchema

L, K, E, G = 3, 2, 16, 3
SCHEMA = {"num_layers": L, "top_k": K, "num_experts": E}
ONE_TRY = RetryPolicy(max_attempts=1, backoff=Backoff(base_s=0.001, cap_s=0.001))
PROMPTS = [[11, 12, 13], [14, 15], [16, 17, 18, 19]]


class CountingEnv:
    """Observation ``[40 + turn] * (turn + 1)``, reward ``turn + 1``, done after ``turns`` turns;
    raises on the turn in ``fail`` for the prompt starting with ``fail_prompt``."""

    fail_prompt: int | None = None
    fail: int | None = None
    threads: ClassVar[list[str]] = []

    def __init__(self, turns: int = 3):
        self.turns, self.turn, self.prompt = turns, 0, None

    def reset(self, prompt):
        self.prompt = prompt
        return prompt.token_ids

    def step(self, response):
        CountingEnv.threads.append(threading.current_thread().name)
        turn, self.turn = self.turn, self.turn + 1
        if self.prompt.token_ids[0] == self.fail_prompt and turn == self.fail:
            raise ValueError("the tool timed out")
        return [40 + turn] * (turn + 1), float(turn + 1), turn + 1 == self.turns, {}


def make(engines, env=CountingEnv, max_turns=3, reward=None, **settings) -> RolloutCollector:
    config = CollectorConfig(**{"group_size": 2, "progress": False, **settings})
    return RolloutCollector(
        engines,
        Environments(env, max_turns) if reward is None else reward,
        config,
        advantages=GRPOAdvantages(),
        schema=RouteSchema(**SCHEMA),
        sampling=SamplingConfig(max_new_tokens=G),
        client_options={"retry": ONE_TRY},
    )


def seed_of(seed, step, group, sample, turn):
    fields = (seed, step, group, sample) + ((turn,) if turn else ())
    digest = hashlib.blake2b(struct.pack(f"<{len(fields)}q", *fields), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def check_rows(trajectory, requests, salts):
    """Each row is the one computed by the first request that had its token as an input."""
    tokens = trajectory.prompt_ids.tolist() + trajectory.response_ids.tolist()
    first = []  # (prompt length, engine salt) of the request that first forwarded each position
    for (prompt, response), salt in zip(requests, salts, strict=True):
        assert tokens[: len(prompt) + len(response)] == prompt + response
        first += [(len(prompt), salt)] * (len(prompt) + len(response) - 1 - len(first))
    rows = [route_row(tokens[p], p, n, L, K, E, salt) for p, (n, salt) in enumerate(first)]
    assert len(rows) == len(tokens) - 1
    assert np.array_equal(trajectory.routed_experts.numpy(), np.stack(rows))


async def test_groups_of_multi_turn_trajectories_with_per_turn_seeds_and_metrics():
    buffer = ReplayBuffer(num_experts=E)
    async with TurnEngine(**SCHEMA) as engine, make(engine.url, seed=5, max_turns=3) as collector:
        rollouts = await collector.collect_async(PROMPTS, step=2, buffer=buffer)
    assert list(buffer) == rollouts.trajectories and len(rollouts.trajectories) == 6
    bodies = {}
    for body in engine.requests:
        bodies.setdefault(tuple(body["token_ids"][:2]), []).append(body)
    for i, trajectory in enumerate(rollouts.trajectories):
        group, sample = divmod(i, 2)
        prompt = PROMPTS[group]
        assert trajectory.prompt_ids.tolist() == prompt
        # responses, then the observations of turns 0 and 1 ([40], [41, 41]); the third turn is done
        assert trajectory.loss_mask.tolist() == [1.0] * G + [0.0] + [1.0] * G + [0.0] * 2 + [1.0] * G
        assert trajectory.reward == 1 + 2 + 3 and trajectory.advantage == 0.0
        seeds = [seed_of(5, 2, group, sample, turn) for turn in range(3)]
        mine = [b for b in engine.requests if b["token_ids"][: len(prompt)] == prompt]
        mine = [b for b in mine if b["sampling_params"]["seed"] in seeds]
        assert [b["sampling_params"]["seed"] for b in mine] == seeds  # turn by turn, in order
        tokens = trajectory.prompt_ids.tolist() + trajectory.response_ids.tolist()
        assert mine[1]["token_ids"] == [*tokens[: len(prompt) + G], 40]
        assert mine[2]["token_ids"] == [*tokens[: len(prompt) + 2 * G + 1], 41, 41]
        served = [(p, r) for p, _, r, _ in engine.served if tokens[: len(p) + len(r)] == p + r]
        assert [p for p, _ in served] == [b["token_ids"] for b in mine]
        check_rows(trajectory, served, [0, 0, 0])
    stats = rollouts.stats
    assert (stats.turns, stats.dropped_groups, stats.requests) == (3.0, 0, 18)
    assert stats.turn_rewards == (1.0, 2.0, 3.0)
    lengths = [len(p) for p in PROMPTS]
    first_bytes = sum(n + G - 1 for n in lengths) / 3 * L * K  # prompt and response rows
    assert stats.turn_route_bytes == pytest.approx(
        (first_bytes, (1 + 1 + G - 1) * L * K, (1 + 2 + G - 1) * L * K)
    )
    flat = stats.as_dict()
    assert (
        flat["turn_reward/turn_3"] == 3.0 and flat["route_bytes/turn_2"] == 4 * L * K and flat["turns"] == 3.0
    )


async def test_a_failing_turn_drops_its_whole_group_and_nothing_half_built_reaches_the_buffer(caplog):
    class Failing(CountingEnv):
        fail_prompt, fail = 14, 1  # group 1, second turn, both samples' first turn already done

    buffer = ReplayBuffer(num_experts=E)
    async with TurnEngine(**SCHEMA) as engine, make(engine.url, env=Failing, max_turns=3) as collector:
        rollouts = await collector.collect_async(PROMPTS, step=0, buffer=buffer)
    assert "group 1 of step 0 dropped: the tool timed out" in caplog.messages
    assert [t.prompt_ids.tolist() for t in buffer] == [PROMPTS[0]] * 2 + [PROMPTS[2]] * 2
    assert rollouts.stats.dropped_groups == 1 and rollouts.stats.trajectories == 4
    assert all(t.route_rows == t.num_tokens - 1 for t in buffer)


@pytest.mark.parametrize("fault", ["extra_row", Status(400, "prompt too long")])
async def test_a_malformed_or_refused_turn_drops_the_group(fault, caplog):
    async with TurnEngine(**SCHEMA) as engine, make(engine.url, max_turns=2) as collector:
        engine.script.extend(["ok", "ok", "ok", fault])  # the fourth request, whichever turn it is
        rollouts = await collector.collect_async(PROMPTS, step=0)
    assert sum("dropped" in m for m in caplog.messages) == 1
    assert rollouts.stats.dropped_groups == 1 and len(rollouts.trajectories) == 4


async def test_every_group_dropped_fails_the_step_and_engines_out_fail_it_at_once():
    class Broken(CountingEnv):
        def step(self, response):
            raise KeyError("no tool")

    buffer = ReplayBuffer(num_experts=E)
    async with TurnEngine(**SCHEMA) as engine, make(engine.url, env=Broken) as collector:
        with pytest.raises(
            GroupsDroppedError, match=r"every group of step 0 was dropped; group 0: KeyError: 'no tool'"
        ) as info:
            await collector.collect_async(PROMPTS, step=0, buffer=buffer)
    assert sorted(info.value.errors) == [0, 1, 2]  # each group's own error
    assert len(buffer) == 0
    async with FaultServer(**SCHEMA) as down, make(down.url) as collector:
        down.script.extend([Status(503)] * 6)
        with pytest.raises(EnginesUnavailableError):
            await collector.collect_async(PROMPTS, step=0)


async def test_failover_mid_trajectory_continues_from_its_prefix_with_each_engines_rows(caplog):
    """Group 0 lives on engine A; A dies after the first turn, so the second and third turns
    go to B with the whole prefix and A's rows kept: every row is the engine's that computed it."""
    async with (
        TurnEngine(**SCHEMA, salt=0) as a,
        TurnEngine(**SCHEMA, salt=1) as b,
        make([a.url, b.url], max_turns=3) as collector,
    ):
        a.script.extend(["ok", "ok", Status(503), Status(503)])  # group 0: 2 first turns, then down
        rollouts = await collector.collect_async([PROMPTS[0], PROMPTS[1]], step=0)
    assert any(m.startswith(f"rollout engine {a.url} is out for step 0") for m in caplog.messages)
    stats = rollouts.stats
    # one or both of group 0's second turns met the dead engine before it was marked out
    assert (stats.engines_out, stats.dropped_groups) == (1, 0) and stats.engine_errors in (1, 2)
    assert len(b.requests) == 2 * 3 + 2 * 2  # group 1's turns, then group 0's last two
    for trajectory in rollouts.trajectories[:2]:  # group 0
        tokens = trajectory.prompt_ids.tolist() + trajectory.response_ids.tolist()
        on_a = [(p, r) for p, _, r, _ in a.served if tokens[: len(p) + len(r)] == p + r]
        on_b = [(p, r) for p, _, r, _ in b.served if tokens[: len(p) + len(r)] == p + r]
        assert len(on_a) == 1 and len(on_b) == 2
        retried = next(body for body in b.requests if body["token_ids"] == on_b[0][0])
        assert retried["sampling_params"]["routed_experts_prompt_start"] == len(PROMPTS[0]) + G - 1
        check_rows(trajectory, on_a + on_b, [0, 1, 1])


async def test_environment_methods_run_in_the_reward_threads():
    CountingEnv.threads = []
    async with TurnEngine(**SCHEMA) as engine, make(engine.url, max_turns=3, reward_threads=2) as collector:
        await collector.collect_async(PROMPTS[:1], step=0)
    assert len(CountingEnv.threads) == 6 and all(t.startswith("r3-reward") for t in CountingEnv.threads)


async def test_the_one_turn_text_environment_equals_the_single_turn_path():
    def score(prompt, response):
        return float(sum(response) % 5) + 0.5 * len(prompt.token_ids)

    prompts = [RolloutPrompt(p, data_source="toy") for p in PROMPTS]
    async with FaultServer(**SCHEMA) as engine:
        async with make(engine.url, env=lambda: TextEnvironment(score), max_turns=1, seed=3) as collector:
            env_path = await collector.collect_async(prompts, step=1)
        async with make(engine.url, reward=score, seed=3) as collector:
            single = await collector.collect_async(prompts, step=1)
    assert len(env_path.trajectories) == 6 and env_path.trajectories == single.trajectories
    assert {t.reward for t in single.trajectories} != {0.0}
    assert env_path.stats.as_dict() == pytest.approx(
        {**single.stats.as_dict(), "rollout_s": env_path.stats.rollout_s}
    )


async def test_a_verl_dataset_and_its_compute_score_as_a_one_turn_environment(tmp_path):
    """PromptsFileTask records scored by text_environment equal the single-turn text reward's
    trajectories; a compute_score that raises scores 0 and is counted."""
    from r3lightning.app.models.tiny_tokenizer import build_tiny_tokenizer
    from r3lightning.app.tasks.prompts_file import PromptsFileTask

    tokenizer = build_tiny_tokenizer()
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{i}+1?"}],
            "data_source": "toy",
            "reward_model": {"ground_truth": i + 1},
        }
        for i in range(3)
    ]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    task = PromptsFileTask(tmp_path / "train.jsonl", tokenizer, shuffle=False)
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth))
        if ground_truth == 3:
            raise ValueError("verifier crashed")
        return {"score": float(len(set(solution_str)) % 3), "chars": float(len(solution_str))}

    factory = text_environment(compute_score, tokenizer)
    async with TurnEngine(**SCHEMA, vocab=len(tokenizer)) as engine:
        async with make(engine.url, env=factory, max_turns=1) as collector:
            env_path = await collector.collect_async(task.prompts_for_step(0, 3), step=0)
        async with make(engine.url, reward=TextReward(compute_score, task.decode)) as collector:
            single = await collector.collect_async(task.prompts_for_step(0, 3), step=0)
    assert env_path.trajectories == single.trajectories
    responses = [
        tokenizer.decode(t.response_ids.tolist(), skip_special_tokens=True) for t in single.trajectories
    ]
    assert sorted(seen[:6]) == sorted(("toy", text, i // 2 + 1) for i, text in enumerate(responses))
    expected = [float(len(set(text)) % 3) for text in responses[:4]] + [0.0, 0.0]
    assert [t.reward for t in env_path.trajectories] == expected
    metrics = factory.args[0].pop_metrics()
    assert metrics["reward/failures"] == 2.0
    assert metrics["reward/chars"] == pytest.approx(sum(len(t) for t in responses[:4]) / 6)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match=r"Environments\.max_turns must be an integer >= 1, got 0"):
        Environments(CountingEnv, max_turns=0)
    with pytest.raises(TypeError, match=r"Environments\.make must build an environment, got 3"):
        Environments(3)
    with pytest.raises(TypeError, match="reward_fn must be callable or Environments, got NoneType"):
        RolloutCollector(
            "http://127.0.0.1:1",
            None,
            CollectorConfig(group_size=2),
            advantages=GRPOAdvantages(),
            schema=RouteSchema(**SCHEMA),
        )
