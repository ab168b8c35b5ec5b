"""A collector whose rank holds some decoder layers keeps only their route columns from the parse on:
every wire form (SkyRL envelopes of uint8 / int16 / int32, vLLM's .npy, SGLang's flat int32) against
real engines on 127.0.0.1, multi-turn traces, and the schema's layer checks."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from aiohttp import web
from engine_server import EngineServer
from fault_server import expected_generation
from loopback import LoopbackServer
from turn_engine import TurnEngine, route_row

from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.rollout.collector import RolloutCollector
from r3lightning.rollout.config import Backoff, CollectorConfig, RetryPolicy, route_schema
from r3lightning.rollout.environment import Environments
from r3lightning.rollout.prompts import SamplingConfig
from r3lightning.wire.request import RouteSchema

L, K, KEPT, G = 4, 2, (1, 3), 3
PROMPTS = [[5, 6, 7], [8, 9]]
ONE_TRY = RetryPolicy(max_attempts=1, backoff=Backoff(base_s=0.001, cap_s=0.001))


def shifted(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """Routes moved to the top of the id range (distinct ids stay distinct), so each dtype is needed."""
    return (routes + num_experts - 32) % num_experts


class EnvelopeEngine(LoopbackServer):
    """A SkyRL engine on 127.0.0.1 sending ``expected_generation``'s routes, :func:`shifted`, in one
    envelope dtype."""

    def __init__(self, dtype: str, num_experts: int) -> None:
        self.dtype, self.num_experts = dtype, num_experts

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/skyrl/v1/generate", self._generate)

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        params = body["sampling_params"]
        start = params["routed_experts_prompt_start"]
        schema = {"num_layers": L, "top_k": K, "num_experts": self.num_experts}
        ids, _, routes = expected_generation(body["token_ids"], params["max_tokens"], start, **schema)
        data = base64.b64encode(shifted(routes, self.num_experts).astype(self.dtype).tobytes()).decode()
        envelope = {"data": data, "shape": list(routes.shape), "dtype": self.dtype}
        choice = {"token_ids": ids, "finish_reason": "length", "logprobs": None, "routed_experts": envelope}
        return web.Response(body=json.dumps({"choices": [choice]}).encode(), content_type="application/json")


# (protocol, wire dtype, num_experts, the client's dtype): every route dtype the wire carries
WIRE_FORMS = [
    ("skyrl", "uint8", 16, np.uint8),
    ("skyrl", "int16", 300, np.int16),
    ("skyrl", "int32", 40_000, np.int32),
    ("vllm", ".npy uint8", 16, np.uint8),
    ("vllm", ".npy uint16", 300, np.int16),  # uint16 is read as int16 below 32768
    ("sglang", "flat int32", 300, np.uint8),  # flat int32 is compacted to its largest id's dtype
]


def engine_for(protocol: str, dtype: str, num_experts: int):
    if protocol == "skyrl":
        return EnvelopeEngine(dtype, num_experts)
    return EngineServer(protocol, num_layers=L, top_k=K, num_experts=num_experts)


@pytest.mark.parametrize(("protocol", "dtype", "num_experts", "parsed"), WIRE_FORMS)
async def test_every_wire_form_is_cut_to_the_held_layers_right_after_the_parse(
    protocol, dtype, num_experts, parsed
):
    schema = RouteSchema(L, K, num_experts, layers=KEPT)
    config = CollectorConfig(group_size=2, protocol=protocol, progress=False)
    buffer = ReplayBuffer(num_experts=num_experts)
    async with engine_for(protocol, dtype, num_experts) as engine:
        collector = RolloutCollector(
            engine.url,
            lambda p, r: 1.0,
            config,
            advantages=GRPOAdvantages(),
            schema=schema,
            sampling=SamplingConfig(max_new_tokens=G),
        )
        async with collector:
            result = await collector.clients[0].generate(
                PROMPTS[0],
                SamplingConfig(max_new_tokens=G).wire_params(protocol, 0),
                return_routed_experts=True,
            )
            rollouts = await collector.collect_async(PROMPTS, step=0, buffer=buffer)
    assert result.routed_experts.shape == (len(PROMPTS[0]) + G - 1, len(KEPT), K)  # the client's answer
    assert result.routed_experts.dtype == parsed
    assert len(rollouts.trajectories) == 4 and list(buffer) == rollouts.trajectories
    full_bytes = 0
    for i, trajectory in enumerate(rollouts.trajectories):
        prompt = PROMPTS[i // 2]
        full = expected_generation(prompt, G, 0, num_layers=L, top_k=K, num_experts=num_experts)[2]
        if protocol == "skyrl":
            full = shifted(full, num_experts)
        else:
            full[:, 0] = 0  # the reference engines send layer 0 as a dense layer
        assert trajectory.route_layers == KEPT
        # the SkyRL stand-in answers logprobs: null: never stored as 0.0 (probability 1)
        assert (
            trajectory.rollout_logprobs.isnan() if protocol == "skyrl" else trajectory.rollout_logprobs < 0
        ).all()
        assert trajectory.routed_experts.shape == (len(prompt) + G - 1, len(KEPT), K)
        np.testing.assert_array_equal(trajectory.routed_experts.numpy(), full[:, list(KEPT)])
        high = int(full[:, list(KEPT)].max())
        assert trajectory.routed_experts.dtype == (
            torch.uint8 if high < 256 else torch.int16 if high < 1 << 15 else torch.int32
        )
        full_bytes += full.shape[0] * L * K * trajectory.routed_experts.element_size()
    # host bytes: layers held / num_layers of the full routes'
    assert sum(t.routed_experts.nbytes for t in buffer) * L == full_bytes * len(KEPT)


class Chat:
    """Observation ``[40 + turn]``; done after three turns."""

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, prompt):
        return prompt.token_ids

    def step(self, response):
        self.turn += 1
        return [40 + self.turn], 1.0, self.turn == 3, {}


async def test_multi_turn_traces_hold_the_kept_layers_of_only_the_new_rows_of_each_turn():
    E = 16
    config = CollectorConfig(group_size=2, progress=False)
    schema = route_schema({"num_hidden_layers": L, "num_experts_per_tok": K, "num_experts": E}, layers=KEPT)
    async with TurnEngine(num_layers=L, top_k=K, num_experts=E) as engine:
        collector = RolloutCollector(
            engine.url,
            Environments(Chat, 3),
            config,
            advantages=GRPOAdvantages(),
            schema=schema,
            sampling=SamplingConfig(max_new_tokens=G),
            client_options={"retry": ONE_TRY},
        )
        async with collector:
            rollouts = await collector.collect_async(PROMPTS, step=1)
    assert len(rollouts.trajectories) == 4 and len(engine.served) == 12
    for trajectory in rollouts.trajectories:
        tokens = trajectory.prompt_ids.tolist() + trajectory.response_ids.tolist()
        # this trajectory's turns (two samples may send identical turns: kept once, rows are equal)
        turns = {
            (tuple(p), start, tuple(r)): None
            for p, start, r, _ in engine.served
            if tokens[: len(p) + len(r)] == p + r
        }
        served = sorted(turns, key=lambda turn: len(turn[0]))
        assert len(served) == 3
        expected, captured = [], 0
        for prompt, start, response in served:  # each turn sent only the rows after the last turn's
            assert start == captured
            stop = len(prompt) + len(response) - 1
            expected += [
                route_row(tokens[p], p, len(prompt), L, K, E)[list(KEPT)] for p in range(start, stop)
            ]
            captured = stop
        assert trajectory.route_layers == KEPT and captured == len(tokens) - 1
        np.testing.assert_array_equal(trajectory.routed_experts.numpy(), np.stack(expected))


def test_the_schema_names_layers_outside_the_model_or_unsorted():
    with pytest.raises(ValueError, match=r"layers \(1, 4\) must be ids below num_layers=4"):
        RouteSchema(L, K, 8, layers=(1, 4))
    with pytest.raises(ValueError, match=r"layers \(1,\) must be ids below num_layers=None"):
        RouteSchema(layers=[1])
    with pytest.raises(
        ValueError, match=r"layers must be None or sorted, unique decoder-layer ids >= 0, got \[3, 1\]"
    ):
        RouteSchema(L, K, 8, layers=[3, 1])
    assert route_schema(RouteSchema(L, K, 8), layers=range(2, 4)) == RouteSchema(L, K, 8, layers=(2, 3))
