"""RolloutCollector against real aiohttp engines on 127.0.0.1: grouping, scoring, seeds,
failover between engines, statistics, and per-rank collection on gloo processes."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from fault_server import FaultServer, expected_generation
from gloo_ranks import run_ranks
from loopback import served_in_thread
from rollout_support import PROMPTS, SCHEMA, collect, prompt_reward
from rollout_support import make_collector as make

from r3lightning import DataOptions, ReplayBuffer, RolloutCollector, RolloutPrompt, SamplingConfig
from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.rollout.config import CollectorConfig
from r3lightning.rollout.prompts import sampling_seed, text_reward
from r3lightning.wire.request import RouteSchema


def expected(prompt: list[int]):
    return expected_generation(prompt, 3, 0, **SCHEMA)


async def test_the_buffer_may_be_any_trajectory_sink():
    """``buffer`` is anything with ``ReplayBuffer``'s ``extend`` (a ``TrajectorySink``): a list too."""
    sink: list = []
    async with FaultServer(**SCHEMA) as server, make(server.url, seed=11) as collector:
        rollouts = await collector.collect_async(PROMPTS, step=3, buffer=sink)
    assert len(sink) == len(rollouts.trajectories) == 8
    assert all(a is b for a, b in zip(sink, rollouts.trajectories, strict=True))


async def test_collects_whole_groups_with_routes_rewards_and_distinct_seeds():
    async with FaultServer(**SCHEMA) as server:
        buffer = ReplayBuffer(num_experts=300)
        prompts = [RolloutPrompt(p, data_source="toy", ground_truth=i) for i, p in enumerate(PROMPTS)]
        async with make(server.url, seed=11) as collector:
            rollouts = await collector.collect_async(prompts, step=3, buffer=buffer, weight_version=5)
            with pytest.raises(ValueError, match=r"^weight_version must be None or an integer >= 0, got -1$"):
                await collector.collect_async(prompts, step=3, weight_version=-1)
        seeds = [body["sampling_params"]["seed"] for _, body, _ in server.requests]
        again = await collect(server.url, PROMPTS, 3, seed=11)
        seeds_again = [body["sampling_params"]["seed"] for _, body, _ in server.requests[len(seeds) :]]
        await collect(server.url, PROMPTS, 4, seed=11)
        seeds_next = [body["sampling_params"]["seed"] for _, body, _ in server.requests[2 * len(seeds) :]]
    assert rollouts.groups == [0, 1, 2, 3] and len(rollouts.trajectories) == 8
    assert list(buffer) == rollouts.trajectories
    assert [t.weight_version for t in rollouts.trajectories] == [5] * 8
    assert {t.weight_version for t in again.trajectories} == {None}  # not told: unknown
    for i, t in enumerate(rollouts.trajectories):
        prompt = PROMPTS[i // 2]
        ids, logprobs, routes = expected(prompt)
        assert t.prompt_ids.tolist() == prompt and t.response_ids.tolist() == ids
        assert t.rollout_logprobs.tolist() == pytest.approx(logprobs)
        assert t.routed_experts.dtype == torch.uint8 and np.array_equal(t.routed_experts.numpy(), routes)
        assert t.reward == sum(prompt) % 3
        assert t.advantage == 0.0  # equal rewards within a group: no signal
    # one seed per (group, sample), fixed by (seed, step): a rerun sends the same ones
    assert len(set(seeds)) == 8 and sorted(seeds_again) == sorted(seeds)
    assert not set(seeds_next) & set(seeds)
    stats = rollouts.stats
    rewards = [sum(p) % 3 for p in PROMPTS for _ in range(2)]
    assert (stats.groups, stats.trajectories) == (4, 8)
    assert stats.reward_mean == pytest.approx(np.mean(rewards))
    assert stats.reward_std == pytest.approx(np.std(rewards, ddof=1))
    assert stats.response_length_mean == 3.0
    assert (stats.requests, stats.attempts, stats.engine_errors, stats.engines_out) == (8, 8, 0, 0)
    assert [t.response_ids.tolist() for t in again.trajectories] == [
        t.response_ids.tolist() for t in rollouts.trajectories
    ]


async def test_reward_forms_mapping_coroutine_thread_pool_and_bad_values():
    threads: list[str] = []

    def scored(prompt: RolloutPrompt, response: list[int]) -> dict:
        threads.append(threading.current_thread().name)
        return {"score": prompt.ground_truth + len(response), "acc": 1.0}

    async def awaited(prompt: RolloutPrompt, response: list[int]) -> float:
        await asyncio.sleep(0)
        return -1.0

    prompts = [RolloutPrompt(p, ground_truth=10 * i) for i, p in enumerate(PROMPTS[:2])]
    async with FaultServer(**SCHEMA) as server:
        async with make(server.url, reward=scored, reward_threads=2) as collector:
            pooled = await collector.collect_async(prompts, step=0)
        coro = await collect(server.url, prompts, 0, reward=awaited)
        with pytest.raises(ValueError, match=r"finite number .* for group 0 sample 1 of step 0, got nan"):
            calls = iter([1.0, float("nan")])
            await collect(server.url, prompts[:1], 0, reward=lambda p, r: next(calls), max_in_flight=1)
        with pytest.raises(ValueError, match="without a 'score' entry"):
            await collect(server.url, prompts[:1], 0, reward=lambda p, r: {"acc": 1.0})
    assert [t.reward for t in pooled.trajectories] == [3.0, 3.0, 13.0, 13.0]
    assert len(threads) == 4 and all(name.startswith("r3-reward") for name in threads)
    assert [t.reward for t in coro.trajectories] == [-1.0] * 4


def test_text_reward_calls_a_verl_style_compute_score():
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return float(solution_str == ground_truth)

    reward = text_reward(compute_score, lambda ids: "".join(chr(96 + i) for i in ids))
    prompt = RolloutPrompt([1, 2], data_source="gsm8k", ground_truth="abc", extra_info={"split": "train"})
    assert reward(prompt, [1, 2, 3]) == 1.0 and reward(prompt, [3]) == 0.0
    assert seen[0] == ("gsm8k", "abc", "abc", {"split": "train"})


async def test_each_sample_is_seeded_with_the_documented_sampling_seed():
    """Group g, sample j of step s sends sampling_seed(seed, s, g, j): a blake2b hash of the four
    numbers as little-endian int64s, modulo 2**31 - 1 (pinned for one value)."""
    import hashlib
    import struct

    def reference(seed: int, step: int, group: int, sample: int) -> int:
        digest = hashlib.blake2b(struct.pack("<4q", seed, step, group, sample), digest_size=8).digest()
        return int.from_bytes(digest, "little") % (2**31 - 1)

    assert sampling_seed(11, 3, 2, 1) == reference(11, 3, 2, 1) == 4056525
    async with FaultServer(**SCHEMA) as server:
        await collect(server.url, PROMPTS, 3, seed=11, max_in_flight=1)
    sent = [body["sampling_params"]["seed"] for _, body, _ in server.requests]
    assert sent == [reference(11, 3, g, j) for g in range(4) for j in range(2)]


def test_route_schema_comes_from_a_model_config_of_each_family():
    from transformers import DeepseekV3Config, OlmoeConfig, Qwen3Config, Qwen3MoeConfig

    from r3lightning.rollout.config import route_schema

    configs = {
        (6, 4, 32): Qwen3MoeConfig(num_hidden_layers=6, num_experts=32, num_experts_per_tok=4),
        (2, 2, 16): OlmoeConfig(num_hidden_layers=2, num_experts=16, num_experts_per_tok=2),
        (3, 2, 8): DeepseekV3Config(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2),
    }
    for expected, config in configs.items():
        name = config.model_type
        assert route_schema(config) == RouteSchema(*expected), name
        assert route_schema(config.to_dict()) == RouteSchema(*expected), name
        collector = make("http://127.0.0.1:1", schema=config)
        assert collector.schema == RouteSchema(*expected) and collector.clients[0].routes == collector.schema
    with pytest.raises(ValueError, match=r"no MoE route schema: .*\['num_experts_per_tok', 'num_experts / "):
        route_schema(Qwen3Config(num_hidden_layers=2))  # a dense model


def test_group_assignment_partitions_the_step_evenly():
    blocks = [RolloutCollector.assigned_groups(12, r, 4) for r in range(4)]
    assert [list(b) for b in blocks] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    with pytest.raises(ValueError, match=r"6 prompts .* must divide evenly among 4 ranks"):
        RolloutCollector.assigned_groups(6, 0, 4)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match=r"^group_size must be an integer >= 2, got 1$"):
        CollectorConfig(group_size=1)
    for name, value, expected in [
        ("max_in_flight", 0, "an integer >= 1"),
        ("reward_threads", -1, "an integer >= 0"),
        ("seed", 1.5, r"an integer >= 0 and <= 9223372036854775807"),
        ("progress", "yes", "true or false"),
        ("protocol", "grpc", r"one of \['skyrl', 'vllm', 'sglang', 'openai'\]"),
    ]:
        with pytest.raises(ValueError, match=f"^{name} must be {expected}, got"):
            CollectorConfig(group_size=2, **{name: value})
    with pytest.raises(ValueError, match=r"request_routes=True needs the route schema: schema=RouteSchema"):
        RolloutCollector(
            "http://127.0.0.1:1", prompt_reward, CollectorConfig(group_size=2), advantages=GRPOAdvantages()
        )
    with pytest.raises(ValueError, match="each URL at most once"):
        make(["http://a:1", "http://a:1/"])
    with pytest.raises(TypeError, match="config must be a CollectorConfig, got dict"):
        RolloutCollector("http://a:1", prompt_reward, {"group_size": 2}, advantages=GRPOAdvantages())
    with pytest.raises(ValueError, match="token_ids must be a non-empty sequence"):
        RolloutPrompt([1, -2])


# ---------------------------------------------------------------------------- several ranks


def _rank_worker(rank: int, url: str, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # run_ranks sets the launcher environment
    try:
        from r3lightning import R3DataModule

        prompts = [[i + 1] * (i % 3 + 1) for i in range(4)]
        buffer = ReplayBuffer()
        rollouts = make(url, seed=5).collect(prompts, step=2, buffer=buffer)
        mine = [(t.prompt_ids.tolist(), t.response_ids.tolist()) for t in rollouts.trajectories]
        # the data module draws this rank's whole buffer with shard=False, half of it by default
        drawn = {}
        for shard in (False, True):
            options = DataOptions(shard=shard)
            datamodule = R3DataModule(buffer, batch_size=8, shuffle=False, collate_threads=1, options=options)
            drawn[shard] = [int((b.loss_mask.sum(1) > 0).sum()) for b in datamodule.train_dataloader()]

        def failing(prompt: RolloutPrompt, response: list[int]) -> float:
            if rank == 1:
                raise KeyError("verifier crashed")
            return 0.0

        try:
            make(url, reward=failing).collect(prompts, step=3)
            failure = None
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        out[rank] = (rollouts.groups, mine, rollouts.stats.as_dict(), failure, drawn)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_collect_disjoint_groups_and_share_only_statistics():
    import torch.multiprocessing as mp

    server = FaultServer(**SCHEMA)
    with served_in_thread(server), mp.Manager() as manager:
        out = manager.dict()
        run_ranks(_rank_worker, server.url, out, nprocs=2)
        result = dict(out)
    prompts = [[i + 1] * (i % 3 + 1) for i in range(4)]
    for rank, groups in ((0, [0, 1]), (1, [2, 3])):
        got_groups, mine, stats, _, drawn = result[rank]
        assert drawn == {False: [4], True: [2]}
        assert got_groups == groups
        assert mine == [(prompts[g], expected(prompts[g])[0]) for g in groups for _ in range(2)]
        rewards = [sum(prompts[g]) % 3 for g in range(4) for _ in range(2)]
        assert stats["trajectories"] == 8 and stats["requests"] == 8 and stats["groups"] == 4
        assert stats["reward_mean"] == pytest.approx(np.mean(rewards))
    assert result[0][2] == result[1][2]  # all-reduced: the same statistics on every rank
    # a failure on one rank raises on every rank, not a hang in the all-reduce
    assert result[1][3] == "KeyError: 'verifier crashed'"
    assert result[0][3].startswith("OtherRankFailedError: rollout collection failed on 1 other rank")


@pytest.mark.slow
def test_tiny_engine_groups_get_grpo_advantages_and_replay_deterministically():
    """The embedded engine (tiny Qwen3-MoE in bf16): varied samples per group, so advantages are
    the group-normalised rewards, and the same (seed, step) samples the same rollouts again."""
    from r3lightning.app.models.tiny import build_tiny_moe
    from r3lightning.app.serve.config import EngineConfig
    from r3lightning.app.serve.server import RolloutServer

    def reward(prompt: RolloutPrompt, response: list[int]) -> float:
        return sum(1 for t in response if t % 2 == prompt.token_ids[-1] % 2) / len(response)

    prompts = [[11, 12, 13, 14, 15, 4], [21, 22, 23, 24, 25, 5]]
    schema = {"num_layers": 4, "top_k": 2, "num_experts": 8}

    def collector(request_routes: bool) -> RolloutCollector:
        config = CollectorConfig(group_size=4, request_routes=request_routes, seed=7, progress=False)
        sampling = SamplingConfig(max_new_tokens=4, ignore_eos=True)
        return RolloutCollector(
            server.url,
            reward,
            config,
            advantages=GRPOAdvantages(),
            schema=RouteSchema(**schema),
            sampling=sampling,
        )

    engine = EngineConfig(max_batch_size=1, copy_model=False)
    with RolloutServer(build_tiny_moe(seed=0), engine=engine) as server:
        first = collector(True).collect(prompts, step=3)
        again = collector(True).collect(prompts, step=3)
        no_routes = collector(False).collect(prompts, step=3)
    rewards = []
    for i, t in enumerate(first.trajectories):
        assert t.prompt_ids.tolist() == prompts[i // 4] and t.response_length == 4
        # one route row per forwarded token: prompt (6) + response (4) - the last sampled token
        assert t.routed_experts.shape == (9, 4, 2) and t.routed_experts.dtype == torch.uint8
        assert not t.routed_experts[:, 0].any()  # layer 0 is dense: no routes
        assert t.reward == reward(RolloutPrompt(prompts[i // 4]), t.response_ids.tolist())
        assert t.rollout_logprobs.shape == (4,) and bool((t.rollout_logprobs < 0).all())
        rewards.append(t.reward)
    grouped = np.array(rewards).reshape(2, 4)
    advantages = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + 1e-6)
    assert [t.advantage for t in first.trajectories] == pytest.approx(
        advantages.reshape(-1).tolist(), abs=1e-5
    )
    assert len({tuple(t.response_ids.tolist()) for t in first.trajectories}) > 2  # distinct seeds
    assert first.stats.reward_mean == pytest.approx(np.mean(rewards))
    assert [t.response_ids.tolist() for t in again.trajectories] == [
        t.response_ids.tolist() for t in first.trajectories
    ]
    for a, b in zip(first.trajectories, again.trajectories, strict=True):
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    assert all(t.routed_experts is None for t in no_routes.trajectories)


@pytest.mark.slow
def test_the_docs_loop_recipe_runs_as_written(capsys):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "recipes" / "data-and-scorer.md").read_text()
    body = page.split("\n## In your own loop: `RolloutCollector`\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    scope: dict = {}
    exec(compile(code, "data-and-scorer.md", "exec"), scope)
    buffer, rollouts = scope["buffer"], scope["rollouts"]
    assert len(buffer) == 8 and rollouts.groups == list(range(4))
    for t in buffer:
        assert t.routed_experts.shape == (t.prompt_length + t.response_length - 1, 4, 2)
        parity = (t.prompt_ids[-1].item() - 8) % 2  # the prompt's ground truth
        assert t.reward == sum(x % 2 == parity for x in t.response_ids.tolist()) / t.response_length
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["0", "1"]
