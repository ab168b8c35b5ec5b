"""``step``: what R3 costs per training step, ``replay=r3`` against ``replay=off``.

The measurement of ``benchmarks/bench_step.py`` (one Lightning fit alternating the arms on one
batch and weights, each step checked; then the route work piece by piece): on CUDA the tiny demo
model and the mid-size MoE (8 layers, 64 experts, top-8, 4k tokens), and the mid-size r3 step must
stay below ``GPU_TARGET`` x the off step; on the CPU the tiny model only, reported, not asserted.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch

from gpu_checks.common import expect

GPU_TARGET = 1.01  # r3 step / off step on a GPU
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def check_step(device: torch.device) -> dict[str, Any]:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    bench = importlib.import_module("bench_step")
    cuda = device.type == "cuda"
    cases = bench.cases(quick=not cuda)
    if not cuda:
        cases = {"tiny": cases["tiny"]}
    repeats = 10 if cuda else 2
    figures: dict[str, Any] = {}
    for name, case in cases.items():
        result = bench.measure(case, device, repeats, piece_repeats=repeats)
        in_step = sum(work for piece, (_, _, work) in result["pieces"].items() if piece != "parse")
        figures[f"{name}_off_ms"] = result["off"] * 1e3
        figures[f"{name}_r3_ms"] = result["r3"] * 1e3
        figures[f"{name}_ratio"] = result["r3"] / result["off"]
        figures[f"{name}_route_work_share"] = in_step / result["r3"]
    if cuda:
        ratio = figures["mid_ratio"]
        expect(
            ratio < GPU_TARGET,
            f"the mid-size MoE's r3 step takes {ratio:.4f}x its off step; the target is below {GPU_TARGET}x",
        )
    return figures
