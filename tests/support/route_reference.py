"""Multi-turn rollouts from the embedded server and their reference, decoded from the raw HTTP.

A loopback proxy in front of the server keeps every raw exchange; the reference decodes them with
the standard library: token ``t`` of a trajectory has the route row ``t - start`` of the turn whose
request asked for rows from ``start``. Used by the route pipeline tests (tests/replay/conftest.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass

import numpy as np
import torch
from aiohttp import ClientSession, web

from r3lightning.app.serve.config import EngineConfig
from r3lightning.app.serve.server import RolloutServer
from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.config import RetryPolicy
from r3lightning.rollout.trace import RoutedExpertTrace
from r3lightning.rollout.trajectory import Trajectory
from r3lightning.wire.request import RouteSchema

L, K, E = 4, 2, 8  # tiny Qwen3-MoE: 4 decoder layers (layer 0 dense), top-2 of 8 experts
MOE_LAYERS = [1, 2, 3]
VOCAB, PAD, EOS = 96, 0, 2
SEED = 0  # the server serves build_tiny_moe(seed=SEED) in bf16; the trainer holds it in fp32


@dataclass(frozen=True)
class Spec:
    """One rollout: a prompt, then turns of (environment tokens appended first, tokens to sample)."""

    protocol: str
    prompt_length: int
    turns: tuple[tuple[int, int], ...]
    synthetic_eos: bool = False  # an EOS appended after the last turn (never forwarded)
    routes: bool = True  # False: an engine that returns no routes (every token routes natively)


SPECS = (
    Spec("skyrl", 5, ((0, 6), (3, 5))),
    Spec("sglang", 3, ((0, 4), (2, 3), (4, 6))),
    Spec("skyrl", 24, ((0, 14),)),
    Spec("sglang", 2, ((0, 1),)),
    Spec("sglang", 6, ((0, 3), (5, 4)), synthetic_eos=True),
    Spec("skyrl", 9, ((0, 2), (1, 1))),
    Spec("skyrl", 4, ((0, 5),), routes=False),
)


@dataclass
class Reference:
    """A trajectory as the server's raw responses describe it."""

    tokens: list[int]
    rows: dict[int, np.ndarray] | None  # token index -> experts [L, K] used with it as input;
    # None: a placeholder row added by padding (one dummy route row, any valid one)
    # tokens where two turns meet: a later turn's first returned row (the previous turn's last
    # sampled token, first forwarded in this turn's prefill)
    joins: frozenset[int] = frozenset()
    # tokens where prefill meets decode: each turn's last prompt token and first sampled token
    edges: frozenset[int] = frozenset()


class RecordingProxy:
    """Loopback HTTP proxy in front of the rollout server keeping each raw exchange by session id."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: dict[str, tuple[bytes, bytes]] = {}  # session id -> (request, response)
        self.url = ""

    async def serve(self, body) -> None:
        async with ClientSession() as session:

            async def forward(request: web.Request) -> web.Response:
                raw_request = await request.read()
                headers = {"Content-Type": "application/json"}
                async with session.post(
                    self.upstream + request.path, data=raw_request, headers=headers
                ) as up:
                    raw_response = await up.read()
                    status = up.status
                self.exchanges[request.headers["X-Session-ID"]] = (raw_request, raw_response)
                return web.Response(body=raw_response, status=status, content_type="application/json")

            app = web.Application()
            app.router.add_post("/{tail:.*}", forward)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            try:
                await body()
            finally:
                await runner.cleanup()


def random_tokens(seed: int, count: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (count,), generator=generator).tolist()


async def roll_out(
    index: int, spec: Spec, client: RemoteGenerateClient
) -> tuple[Trajectory, RoutedExpertTrace | None]:
    """A multi-turn rollout as a training loop would run it: one trace, prompt starts per turn."""
    prompt = random_tokens(100 + index, spec.prompt_length)
    tokens, loss_mask, logprobs = list(prompt), [], []
    trace = RoutedExpertTrace(L, K, E) if spec.routes else None
    length_key, seed_key = (
        ("max_tokens", "seed") if spec.protocol == "skyrl" else ("max_new_tokens", "sampling_seed")
    )
    for turn, (environment, new_tokens) in enumerate(spec.turns):
        extra = random_tokens(1000 * index + turn, environment) if environment else []
        tokens += extra
        loss_mask += [0.0] * len(extra)
        logprobs += [0.0] * len(extra)
        params = {length_key: new_tokens, seed_key: 10 * index + turn, "temperature": 1.0, "ignore_eos": True}
        result = await client.generate(
            tokens,
            params,
            return_routed_experts=spec.routes,
            routed_experts_prompt_start=None if trace is None else trace.prompt_start,
            session_id=f"{index}/{turn}",
        )
        if trace is None:
            assert result.routed_experts is None
        else:
            trace.record_generation(len(tokens), len(result.response_ids), result.routed_experts)
        tokens += result.response_ids
        loss_mask += [1.0] * len(result.response_ids)
        logprobs += list(result.response_logprobs)
    if spec.synthetic_eos:
        # a loss target whose predicting row (the last sampled token's) was never captured
        tokens.append(EOS)
        loss_mask.append(1.0)
        logprobs.append(0.0)
    routes = None if trace is None else trace.finalize(len(tokens), loss_mask=[0.0] * len(prompt) + loss_mask)
    trajectory = Trajectory(
        prompt,
        tokens[len(prompt) :],
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        reward=float(index),
        routed_experts=routes,
    )
    return trajectory, trace


def decode_exchange(
    protocol: str, raw_request: bytes, raw_response: bytes
) -> tuple[list[int], int, list[int], np.ndarray | None]:
    """(prompt, first route row's token, sampled tokens, routes [rows, L, K] or None) of one exchange."""
    request, response = json.loads(raw_request), json.loads(raw_response)
    if protocol == "skyrl":
        prompt = request["token_ids"]
        start = request["sampling_params"].get("routed_experts_prompt_start", 0)
        choice = response["choices"][0]
        output = choice["token_ids"]
        envelope = choice["routed_experts"]
        if envelope is None:
            return prompt, start, output, None
        dtype = np.dtype(envelope["dtype"]).newbyteorder("<")
        routes = np.frombuffer(base64.b64decode(envelope["data"]), dtype=dtype).reshape(envelope["shape"])
    else:
        prompt = request["input_ids"]
        start = request.get("routed_experts_start_len", 0)
        output = response["output_ids"]
        if "routed_experts" not in response["meta_info"]:
            return prompt, start, output, None
        routes = np.frombuffer(base64.b64decode(response["meta_info"]["routed_experts"]), dtype="<i4")
        routes = routes.reshape(-1, L, K)
    return prompt, start, output, routes.astype(np.int64)


def reference_of(index: int, spec: Spec, exchanges: dict[str, tuple[bytes, bytes]]) -> Reference:
    rows: dict[int, np.ndarray] = {}
    tokens: list[int] = []
    joins: set[int] = set()
    edges: set[int] = set()
    for turn in range(len(spec.turns)):
        prompt, start, output, routes = decode_exchange(spec.protocol, *exchanges[f"{index}/{turn}"])
        assert prompt[: len(tokens)] == tokens, "each turn's prompt extends the conversation"
        tokens = prompt + output
        if not spec.routes:
            # a skyrl server returns routes whenever it records them (unasked); the client drops them
            assert routes is None or spec.protocol == "skyrl"
            continue
        # the engine forwards tokens start .. P + G - 2; the last sampled token is never an input
        assert routes.shape == (len(prompt) - start + len(output) - 1, L, K)
        for j, row in enumerate(routes):
            assert start + j not in rows, f"trajectory {index}: token {start + j} routed twice"
            rows[start + j] = row
        edges.update((len(prompt) - 1, len(prompt)))
        if turn:
            joins.add(start)
    if spec.synthetic_eos:
        tokens = [*tokens, EOS]
    assert sorted(rows) == list(range(len(rows))), "the turns' rows tile the trajectory without gaps"
    assert len(rows) == (len(tokens) - 1 - int(spec.synthetic_eos) if spec.routes else 0)
    return Reference(tokens, rows, frozenset(joins), frozenset(edges))


@dataclass
class Rollouts:
    trajectories: list[Trajectory]
    traces: list[RoutedExpertTrace | None]
    references: list[Reference]
    server_state: dict[str, torch.Tensor]


def collect_rollouts() -> Rollouts:
    """Run SPECS against the embedded server behind a recording proxy; the references decode the
    raw exchanges."""
    with RolloutServer(
        engine=EngineConfig(seed=SEED)
    ) as server:  # bf16 tiny Qwen3-MoE, the main job's default engine
        proxy = RecordingProxy(server.url)
        results: list[tuple[Trajectory, RoutedExpertTrace | None]] = []

        async def run_all() -> None:
            clients = {
                protocol: RemoteGenerateClient(
                    proxy.url,
                    protocol=protocol,
                    schema=RouteSchema(L, K, E),
                    retry=RetryPolicy(max_attempts=1),
                )
                for protocol in ("skyrl", "sglang")
            }
            try:  # concurrent: the engine batches requests of different lengths together
                results.extend(
                    await asyncio.gather(*(roll_out(i, s, clients[s.protocol]) for i, s in enumerate(SPECS)))
                )
            finally:
                for client in clients.values():
                    await client.close()

        asyncio.run(proxy.serve(run_all))
        server_state = {k: v.clone() for k, v in server.engine.model.state_dict().items()}
    references = [reference_of(i, spec, proxy.exchanges) for i, spec in enumerate(SPECS)]
    return Rollouts([t for t, _ in results], [tr for _, tr in results], references, server_state)
