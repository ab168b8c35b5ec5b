"""Embedded engine throughput: batch-invariant serving vs the plain padded batch forward.

Each arm is a ``GenerationEngine`` over the same tiny Qwen3-MoE in bf16 (the main job's engine),
fed a whole RL step of requests at once through its batching worker (``submit``), routes
recorded, and timed to the last answer. Arms:

- plain: ``batch_invariant=False`` (one padded forward per step, grouped expert GEMMs);
- batch-invariant, tile 16 / 32 / 64 (the default): per-row attention, eager experts, row-tiled
  GEMMs (see ``r3lightning.app.serve.invariance``).

Workloads: the demo's step (128 requests: 7-token prompts, 4 new tokens) and a ragged one (64
requests: prompts of 3-60 tokens, 16 new tokens). Before timing, the invariant arm is checked to
answer a sample of requests exactly as it does one by one. Usage:
``python benchmarks/bench_engine.py [--quick]``.
"""

from __future__ import annotations

import argparse

import _common
import torch

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig
from r3lightning.app.serve.engine import GenerationEngine, GenerationRequest
from r3lightning.app.serve.sampling import SamplingParams

TARGET_COST = 1.5  # batch-invariant time / plain time, on the demo's step


def workload(count: int, min_prompt: int, max_prompt: int, new_tokens: int) -> list[GenerationRequest]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(min_prompt, max_prompt + 1, (count,), generator=generator).tolist()
    return [
        GenerationRequest(
            torch.randint(3, 96, (n,), generator=generator).tolist(),
            SamplingParams(max_new_tokens=new_tokens, seed=i, ignore_eos=True),
            return_routed_experts=True,
        )
        for i, n in enumerate(lengths)
    ]


def serve(engine: GenerationEngine, requests: list[GenerationRequest]) -> list:
    futures = [engine.submit(r) for r in requests]
    return [f.result(timeout=600) for f in futures]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized workloads, fewer repeats")
    args = parser.parse_args()
    scale = 4 if args.quick else 1
    repeats = 2 if args.quick else 5
    workloads = {
        f"demo step ({128 // scale} x 7-token prompts, 4 new tokens)": workload(128 // scale, 7, 7, 4),
        f"ragged ({64 // scale} x 3-60-token prompts, 16 new tokens)": workload(64 // scale, 3, 60, 16),
    }
    model = build_tiny_moe(seed=0)
    arms = {
        "plain (batch_invariant=False)": GenerationEngine(
            model, EngineConfig(batch_invariant=False, max_batch_size=64)
        )
    }
    for tile in (16, 32, 64):
        name = f"batch-invariant, tile {tile}" + (" (default)" if tile == 64 else "")
        arms[name] = GenerationEngine(model, EngineConfig(batch_invariant=True, max_batch_size=64))
        arms[name].invariant_tile_rows = tile

    for requests in workloads.values():  # correctness before speed
        sample = requests[:: max(1, len(requests) // 6)]
        for name, engine in arms.items():
            together = serve(engine, requests)
            assert [len(o.token_ids) for o in together] == [r.params.max_new_tokens for r in requests], name
            if name.startswith("batch-invariant"):
                for request in sample:
                    alone = engine.generate([request])[0]
                    got = together[requests.index(request)]
                    assert alone.token_ids == got.token_ids and alone.logprobs == got.logprobs, name
                    assert (alone.routed_experts == got.routed_experts).all(), name

    print(f"# {_common.machine_line()}; median of {repeats}")
    plain_name = next(iter(arms))
    verdict = ""
    for title, requests in workloads.items():
        times = _common.time_arms(
            {n: (lambda e=e, r=requests: serve(e, r)) for n, e in arms.items()}, repeats
        )
        tokens = sum(r.params.max_new_tokens for r in requests)
        rows = [
            [
                name,
                _common.ms(t),
                f"{len(requests) / t:.1f}",
                f"{tokens / t:.0f}",
                _common.ratio(t, times[plain_name]),
            ]
            for name, t in times.items()
        ]
        _common.print_table(
            f"Engine throughput: {title}",
            ["arm", "ms per step", "requests/s", "new tokens/s", "time vs plain"],
            rows,
        )
        if title.startswith("demo step"):
            cost = times["batch-invariant, tile 64 (default)"] / times[plain_name]
            verdict = f"{'met' if cost <= TARGET_COST else 'missed'} ({cost:.2f}x)"
    print(f"\ntarget: batch-invariant serving of the demo's step within {TARGET_COST}x of plain: {verdict}")
    for engine in arms.values():
        engine.close()


if __name__ == "__main__":
    main()
