"""Multi-turn route capture on the wire: only new rows per turn vs re-sending every row.

One agentic trajectory with Qwen3-30B-A3B's route schema (``[rows, 48, 8]`` uint8 ids of 128
experts): a ``P``-token prompt, then ``T`` turns of ``G`` sampled tokens, each but the last
followed by an ``O``-token tool observation. Every turn sends the whole token prefix to a
loopback skyrl engine (an aiohttp server on this event loop, answering from a precomputed route
pool) through :func:`~r3lightning.rollout.episode.run_episode` and a real
:class:`~r3lightning.rollout.client.RemoteGenerateClient`. Arms, timed side by side (interleaved):

- incremental: ``routed_experts_prompt_start`` = the rows the trace holds (what
  ``RolloutCollector`` sends): a turn returns the previous turn's last token, the observation
  and its own response;
- resend all: start 0 every turn (a client without the trace); the engine encodes and the
  client decodes the whole prefix again, and the trajectory keeps only the new rows.

Both arms must end with the same routes before anything is timed. Wall time includes the
engine's encoding (same process). Usage: ``python benchmarks/bench_multiturn.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json

import _common
import numpy as np
from aiohttp import web

from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.config import RetryPolicy
from r3lightning.rollout.episode import run_episode
from r3lightning.rollout.prompts import RolloutPrompt
from r3lightning.rollout.trace import RoutedExpertTrace
from r3lightning.wire.request import RouteSchema

NUM_LAYERS, TOP_K, NUM_EXPERTS = 48, 8, 128


class Engine:
    """Answers every turn from one route pool; ``bodies`` logs each response's byte count."""

    def __init__(self, max_rows: int) -> None:
        rows = np.arange(max_rows)[:, None, None] * 3 + np.arange(NUM_LAYERS)[None, :, None] * 5
        self.pool = ((rows + np.arange(TOP_K)) % NUM_EXPERTS).astype(np.uint8)  # [rows, L, K]
        self.bodies: list[tuple[int, int]] = []  # (route rows, body bytes) per request

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt, params = body["token_ids"], body["sampling_params"]
        start, count = params["routed_experts_prompt_start"], params["max_tokens"]
        ids = [7 + (len(prompt) + i) % 80 for i in range(count)]
        routes = self.pool[start : len(prompt) + count - 1]
        envelope = {
            "data": base64.b64encode(routes.tobytes()).decode(),
            "shape": list(routes.shape),
            "dtype": "uint8",
        }
        choice = {"token_ids": ids, "finish_reason": "length", "logprobs": None, "routed_experts": envelope}
        data = json.dumps({"choices": [choice]}).encode()
        self.bodies.append((routes.shape[0], len(data)))
        return web.Response(body=data, content_type="application/json")


class ToolEnv:
    def __init__(self, turns: int, observation: int) -> None:
        self.turns, self.observation, self.turn = turns, observation, 0

    def reset(self, prompt: RolloutPrompt) -> list[int]:
        return prompt.token_ids

    def step(self, response: list[int]):
        self.turn += 1
        return [9] * self.observation, 0.0, self.turn == self.turns, {}


async def episode(client: RemoteGenerateClient, args, resend: bool):
    def generate(tokens, turn, start):
        async def run():
            result = await client.generate(
                tokens,
                {"max_tokens": args.G},
                return_routed_experts=True,
                routed_experts_prompt_start=0 if resend else start,
            )
            if resend:  # the trajectory keeps only the rows it does not hold yet
                result.routed_experts = result.routed_experts[start:]
            return result

        return run()

    trace = RoutedExpertTrace(NUM_LAYERS, TOP_K, NUM_EXPERTS)
    env = ToolEnv(args.T, args.O)
    done = await run_episode(env, RolloutPrompt([5] * args.P), generate, max_turns=args.T, trace=trace)
    return done.routes


async def main(args) -> None:
    engine = Engine(args.P + args.T * (args.G + args.O))
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/skyrl/v1/generate", engine.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    schema = RouteSchema(NUM_LAYERS, TOP_K, NUM_EXPERTS)
    per_turn: dict[str, list[tuple[int, int]]] = {}
    async with RemoteGenerateClient(url, schema=schema, retry=RetryPolicy(max_attempts=1)) as client:
        finals = {}
        for name, resend in (("incremental", False), ("resend all", True)):
            engine.bodies.clear()
            finals[name] = await episode(client, args, resend)
            per_turn[name] = list(engine.bodies)
        assert np.array_equal(finals["incremental"].numpy(), finals["resend all"].numpy())
        assert finals["incremental"].shape[0] == args.P + args.T * args.G + (args.T - 1) * args.O - 1

        times = {}
        for round_index in range(args.repeats + 1):  # interleaved; the first round warms up
            for name, resend in (("incremental", False), ("resend all", True)):
                loop = asyncio.get_running_loop()
                start = loop.time()
                await episode(client, args, resend)
                if round_index:
                    times.setdefault(name, []).append(loop.time() - start)
    await runner.cleanup()

    print(_common.machine_line())
    print(
        f"trajectory: P={args.P} prompt tokens, T={args.T} turns of G={args.G} tokens, O={args.O}-token "
        f"observations; routes [rows, {NUM_LAYERS}, {TOP_K}] uint8"
    )
    inc, full = per_turn["incremental"], per_turn["resend all"]
    kib = 1024.0
    _common.print_table(
        "Multi-turn route bytes per turn",
        [
            "turn",
            "incremental rows",
            "incremental KiB",
            "resend-all rows",
            "resend-all KiB",
            "resend / incremental",
        ],
        [
            (k + 1, a[0], f"{a[1] / kib:.0f}", b[0], f"{b[1] / kib:.0f}", _common.ratio(b[1], a[1]))
            for k, (a, b) in enumerate(zip(inc, full, strict=True))
        ],
    )
    total = {name: sum(size for _, size in bodies) for name, bodies in per_turn.items()}
    rows = {name: sum(r for r, _ in bodies) for name, bodies in per_turn.items()}
    median = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    _common.print_table(
        "Multi-turn capture, whole trajectory",
        ["arm", "route rows received", "wire MiB", "vs incremental", "episode ms (median)"],
        [
            (
                name,
                rows[name],
                f"{total[name] / _common.MiB:.2f}",
                _common.ratio(total[name], total["incremental"]),
                _common.ms(median[name]),
            )
            for name in ("incremental", "resend all")
        ],
    )
    print(
        f"\nincremental capture receives each row once ({rows['incremental']} rows = trajectory length - 1); "
        f"resending every row sends {rows['resend all'] / rows['incremental']:.2f}x the rows"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI size")
    parsed = parser.parse_args()
    sizes = (
        dict(P=256, G=128, O=64, T=4, repeats=2)
        if parsed.quick
        else dict(P=2048, G=1024, O=512, T=8, repeats=5)
    )
    asyncio.run(main(argparse.Namespace(**sizes)))
