"""Rollouts ahead of training: the main job on the embedded engine with ``rollout.max_staleness``
0, 1 and 2, side by side in one run.

Each repeat runs every arm once, in turn (``r3lightning-train`` in this process, its own embedded
engine each), so drift on a shared machine hits all arms alike. Per arm, from its ``metrics.csv``
over the steps after the first (step 0 also waits for the engine's start):

- steps per minute: ``60 * steps / sum(step_s)`` (``step_s``: wall time from one step's end to the
  next, data wait, training, checkpoint and weight push included);
- trainer idle share: ``sum(trainer_wait_s) / sum(step_s)``, the time the trainer waited for data;
- engine idle share: ``sum(engine_wait_s) / sum(step_s)``, the time the rollout worker waited for
  weights (the staleness rule);
- staleness: the mean policy versions between a row's weights and the weights that trained on it.

Trainer and engine share the machine's cores: the overlap that ``max_staleness > 0`` buys is
bounded by what the two leave each other. Figures are medians over repeats with their range.
Usage: ``python benchmarks/bench_async.py [--quick] [--steps N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
from pathlib import Path

import _common  # noqa: F401  (puts the checkout on sys.path)

ARMS = (0, 1, 2)


def _environment() -> str:
    from r3lightning.app.job.report import environment, environment_line

    return environment_line(environment())  # versions, threads, CPU model and capability


def _run(k: int, steps: int, prompts: int, response_length: int, seed: int) -> list[dict[str, float]]:
    from r3lightning.app.job.main import compose_config, run

    overrides = [
        f"rollout.max_staleness={k}",
        f"steps={steps}",
        f"prompts_per_step={prompts}",
        "algorithm.group_size=4",
        f"task.response_length={response_length}",
        f"seed={seed}",
        "trainer.enable_progress_bar=false",
        "plot=false",
    ]
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        return run(compose_config(overrides), Path(out))["replay=r3"]


def _figures(history: list[dict[str, float]]) -> dict[str, float]:
    rows = history[1:]
    wall = sum(r["step_s"] for r in rows)
    return {
        "steps/min": 60 * len(rows) / wall,
        "trainer idle": sum(r["trainer_wait_s"] for r in rows) / wall,
        "engine idle": sum(r["engine_wait_s"] for r in rows) / wall,
        "staleness": statistics.fmean(r.get("staleness_mean", 0.0) for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default 10, quick 4)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per arm (default 3, quick 1)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (x4 responses)")
    parser.add_argument("--response-length", type=int, default=16)
    args = parser.parse_args()
    steps = args.steps or (4 if args.quick else 10)
    repeats = args.repeats or (1 if args.quick else 3)
    figures: dict[int, list[dict[str, float]]] = {k: [] for k in ARMS}
    for repeat in range(repeats):
        for k in ARMS:
            history = _run(k, steps, args.prompts, args.response_length, seed=repeat)
            figures[k].append(_figures(history))
    print(f"### Rollouts ahead of training: {steps} steps x {args.prompts} prompts x 4 responses of "
          f"{args.response_length} tokens, {repeats} repeat(s)\n")  # fmt: skip
    print("medians [min, max] over repeats, steps 1 on (step 0 also waits for the engine's start)\n")
    names = ("steps/min", "trainer idle", "engine idle", "staleness")
    print("| arm | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for k in ARMS:
        cells = []
        for name in names:
            values = [f[name] for f in figures[k]]
            scale, unit = (1.0, "") if name in ("steps/min", "staleness") else (100.0, "%")
            median = statistics.median(values) * scale
            cells.append(f"{median:.2f}{unit} [{min(values) * scale:.2f}, {max(values) * scale:.2f}]")
        print(f"| max_staleness={k} | " + " | ".join(cells) + " |")
    base = statistics.median(f["steps/min"] for f in figures[0])
    print()
    for k in ARMS[1:]:
        ratio = statistics.median(f["steps/min"] for f in figures[k]) / base
        print(f"max_staleness={k}: {ratio:.2f}x the steps per minute of max_staleness=0")
    print(f"{_environment()}; 1-minute load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
