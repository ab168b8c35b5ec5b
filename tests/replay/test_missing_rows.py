"""Missing route rows (a -1 id, or routes an engine lost): accepted only where allowed, routed
natively, never installed, counted; end to end from a real aiohttp engine on loopback."""

import asyncio
import copy

import numpy as np
import pytest
import torch
from engine_server import EngineServer
from replay_policy import TinyPolicy, fit, make_batch, real_rows
from test_hf_replay import capture_router_outputs

from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.datamodule import R3DataModule
from r3lightning.packed import PackedTensor
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.replay.modes import align_routes
from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.episode import single_turn
from r3lightning.rollout.prompts import RolloutPrompt
from r3lightning.rollout.trace import RoutedExpertTrace
from r3lightning.rollout.trajectory import Trajectory
from r3lightning.routes import compact_routes
from r3lightning.wire.codec import RouteSchema
from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.request import RemoteGenerateResult
from r3lightning.wire.route_check import check_routes

VOCAB = 96  # the tiny model's


def _with_missing(batch, every=3):
    """``batch`` with every ``every``-th route row (of the packed rows) marked missing in one slot."""
    values = batch.routed_experts.values.to(torch.int16)
    lost = torch.arange(values.shape[0]) % every == 1
    values[lost, 2, 1] = -1  # one id is enough to mark the row
    batch.routed_experts = PackedTensor(values, batch.routed_experts.cu_seqlens)
    return batch, lost


def test_the_route_check_takes_the_sentinel_only_where_allowed():
    routes = np.array([[[1, 2], [3, 4]], [[-1, 2], [5, 5]], [[0, 0], [6, 7]]], dtype=np.int16)
    assert check_routes(routes, num_experts=8, missing=True) == 7  # the repeat is in a missing row
    with pytest.raises(ValueError, match=r"expert id -1 is negative \(-1 marks a missing row"):
        check_routes(routes, num_experts=8)
    with pytest.raises(ValueError, match=r"expert id -2 is negative$"):
        check_routes(np.where(routes < 0, -2, routes), missing=True)
    with pytest.raises(ValueError, match="repeats an expert"):
        check_routes(np.where(routes < 0, 1, routes), missing=True)
    kept = Trajectory([1, 2], [3, 4], routed_experts=routes)
    assert kept.routed_experts.dtype == torch.int8 and kept.routed_experts[1].tolist() == [[-1, -1], [-1, -1]]
    assert compact_routes(torch.tensor([[-1, 3]])).dtype == torch.int8
    assert compact_routes(torch.tensor([[200, 3]])).dtype == torch.uint8


def test_missing_rows_route_natively_and_every_other_row_is_replayed():
    batch, lost = _with_missing(make_batch(0, [7, 9, 5]))
    model = build_tiny_moe(seed=0)
    backend = HFRouterReplay.for_model(model)
    layout = TokenMetadataLayout.padded(batch.attention_mask)
    dense, mask = align_routes(batch.routed_experts, layout, backend)
    assert dense.min() >= 0  # the sentinel is never installed
    seen, handles = capture_router_outputs(backend, before_replay=True)
    try:
        with replay_routes(backend, dense, mask), record_routes(backend) as used:
            model(batch.input_ids, attention_mask=batch.attention_mask.long())
    finally:
        for h in handles:
            h.remove()
    index = tuple(torch.tensor(real_rows(batch)).T)
    used_rows = used.routes[index]  # [rows, L, K] in packed row order
    engine = batch.routed_experts.values.long()
    for layer in backend.moe_layers:
        native = seen[layer][2].reshape(*batch.input_ids.shape, -1)[index]
        assert torch.equal(used_rows[~lost, layer].long(), engine[~lost, layer])
        assert torch.equal(used_rows[lost, layer].long(), native[lost].long())
        assert not torch.equal(used_rows[lost, layer].long(), engine[lost, layer].clamp(min=0))
    backend.remove()


def test_the_callback_counts_missing_rows_per_step():
    batches = [_with_missing(make_batch(0, [7, 9, 5]))[0], make_batch(1, [6, 9, 8], dropped_rows=3)]
    lost = int((batches[0].routed_experts.values < 0).flatten(1).any(1).sum())
    rows = batches[0].routed_experts.num_rows
    module = TinyPolicy()
    _, logger = fit(module, copy.deepcopy(batches), RouterReplayCallback(mode="r3"))
    assert logger.series("router_replay/missing_rows") == [float(lost), 0.0]
    # a missing row has no route row: every slot with one is replayed
    assert logger.series("router_replay/replayed_fraction") == [1.0, 1.0]
    assert 0 < lost < rows
    assert logger.series("router_replay/used_agreement") == [1.0, 1.0]


class LossyEngine(EngineServer):
    """The vLLM layout on loopback, with the tiny model's schema; request ``i`` in ``lost`` comes
    back as vLLM answers when it dropped a request's routes (``routed_experts: null``), and with
    ``sentinel`` the SGLang flat int32 answer marks row 1 of every request -1 (NeMo-RL's way)."""

    def __init__(self, engine, *, lost=(), sentinel=False):
        super().__init__(engine, num_layers=4, top_k=2, num_experts=8, dense_layers=(0,))
        self.lost, self.sentinel, self.calls = set(lost), sentinel, 0

    def generate(self, prompt, params, start):
        ids, logprobs, routes, finish = super().generate(prompt, params, start)
        if self.sentinel and len(routes) > 1:
            routes[1, 2, 0] = -1
        return [t % VOCAB for t in ids], logprobs, routes, finish

    def npy_b64(self, routes):
        self.calls += 1
        return None if self.calls - 1 in self.lost else super().npy_b64(routes)


async def _generate(server, policy, prompts):
    schema = RouteSchema(num_layers=4, top_k=2, num_experts=8, missing_rows=policy)
    protocol = "vllm" if server.engine == "vllm" else "sglang"
    async with RemoteGenerateClient(server.url, protocol=protocol, schema=schema) as client:
        params = {"max_tokens": 4, "ignore_eos": True, "logprobs": 1}
        return [
            await client.generate(p, params, return_routed_experts=True, routed_experts_prompt_start=0)
            for p in prompts
        ]


PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_batch_with_missing_rows_from_an_engine_replays_every_other_row_and_reports_the_count(engine):
    async def run():
        async with LossyEngine(engine, lost={1}, sentinel=engine == "sglang") as server:
            with pytest.raises(MalformedResponseError) as info:
                await _generate(server, "error", PROMPTS)  # the default refuses missing rows
            server.calls = 0
            return str(info.value), await _generate(server, "native", PROMPTS)

    refused, results = asyncio.run(run())
    assert "\n" not in refused and ("is null" in refused or "-1 marks a missing row" in refused)
    counts = [r.missing_route_rows for r in results]
    rows = [len(p) + len(r.response_ids) - 1 for p, r in zip(PROMPTS, results, strict=True)]
    assert counts == ([0, rows[1], 0] if engine == "vllm" else [1, 1, 1])
    buffer = ReplayBuffer()
    for prompt, result in zip(PROMPTS, results, strict=True):
        buffer.add(
            Trajectory(prompt, result.response_ids, advantage=1.0, routed_experts=result.routed_experts)
        )
    datamodule = R3DataModule(buffer, len(PROMPTS), shuffle=False, collate_threads=1)
    batch = next(iter(datamodule.train_dataloader()))
    module = TinyPolicy()
    _, logger = fit(module, [copy.deepcopy(batch)], RouterReplayCallback(mode="r3"))
    assert logger.series("router_replay/missing_rows") == [float(sum(counts))]
    used = module.train_routes[0][tuple(torch.tensor(real_rows(batch)).T)]  # [rows, L, K]
    engine_rows = batch.routed_experts.values.long()
    present = (engine_rows >= 0).flatten(1).all(1)
    assert int((~present).sum()) == sum(counts)
    assert torch.equal(used[present][:, 1:].long(), engine_rows[present][:, 1:])  # every other row replayed
    assert logger.series("router_replay/replayed_fraction") == [1.0]


def test_drop_trajectory_keeps_the_reward_and_leaves_the_loss():
    routes = np.array([[[0, 0], [1, 2]], [[-1, -1], [-1, -1]], [[0, 0], [3, 4]]], dtype=np.int8)
    result = RemoteGenerateResult([7, 8], [-0.5, -0.25], "length", routes, {}, missing_route_rows=1)
    episode = single_turn(RolloutPrompt([5, 6]), result, 1.0, RoutedExpertTrace())
    assert int((episode.routes < 0).flatten(1).any(1).sum()) == 1 and episode.reward == 1.0
    assert episode.trajectory(0.5, drop_missing=True).loss_mask.tolist() == [0.0, 0.0]
    assert episode.trajectory(0.5).loss_mask.tolist() == [1.0, 1.0]  # native: trained on
    assert RouteSchema().missing_rows == "error"
    with pytest.raises(
        ValueError, match=r"missing_rows must be one of \['error', 'native', 'drop_trajectory'\]"
    ):
        RouteSchema(missing_rows="skip")


def test_the_job_takes_rollout_missing_rows():
    from r3lightning.app.job.common import JobError
    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.validate import check_config

    assert compose_config().rollout.missing_rows == "error"
    assert compose_config(["rollout=vllm", "rollout.missing_rows=native"]).rollout.missing_rows == "native"
    with pytest.raises(
        JobError, match=r"rollout\.missing_rows must be one of \['error', 'native', 'drop_trajectory'\]"
    ):
        check_config(compose_config(["rollout.missing_rows=skip"]))


@pytest.mark.parametrize("policy", ["native", "drop_trajectory"])
def test_the_collector_keeps_or_drops_a_trajectory_whose_engine_lost_its_routes(policy):
    from r3lightning.app.job.grpo import GRPOAdvantages
    from r3lightning.rollout.collector import RolloutCollector
    from r3lightning.rollout.config import CollectorConfig
    from r3lightning.rollout.prompts import SamplingConfig

    schema = RouteSchema(num_layers=4, top_k=2, num_experts=8, missing_rows=policy)
    config = CollectorConfig(group_size=2, protocol="vllm", progress=False)

    async def run():
        async with LossyEngine("vllm", lost={1}) as server:  # the second request's routes are lost
            collector = RolloutCollector(
                server.url,
                lambda prompt, response: float(len(response)),
                config,
                advantages=GRPOAdvantages(),
                schema=schema,
                sampling=SamplingConfig(max_new_tokens=3),
            )
            async with collector:
                return (await collector.collect_async([RolloutPrompt(PROMPTS[0])], step=0)).trajectories

    trajectories = asyncio.run(run())
    assert len(trajectories) == 2  # the group stays whole: its rewards are each other's baseline
    lost = [bool((t.routed_experts < 0).any()) for t in trajectories]
    assert sorted(lost) == [False, True]
    for t, missing in zip(trajectories, lost, strict=True):
        if missing:
            assert (t.routed_experts < 0).all()  # every row of the lost request
        dropped = missing and policy == "drop_trajectory"
        assert t.loss_mask.tolist() == [0.0 if dropped else 1.0] * len(t.response_ids)
