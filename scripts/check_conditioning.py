"""Check that the demo's defaults are well conditioned, and record the figures.

    python scripts/check_conditioning.py [--seeds 5] [--steps 30] [--out DIR] [-- overrides]

Runs ``experiment=compare`` (replay r3 and off) for seeds 0..seeds-1 and checks, over every
step of every arm and seed, that the paired ``mismatch/k3_replayed`` (bf16 engine vs fp32
trainer on the same weights and routes: precision alone) stays at or below ``--k3-max``
(1e-3), and that each arm's median reward over seeds (the mean of its last 3 steps) reaches
``--reward-min`` (0.9). Prints per run the largest k3 (replayed and native, with its step) and
the final rewards, per arm the median reward curve, then PASS or FAIL (exit status 1).
An existing run folder (``--out``) resumes: finished runs are read back, not trained again.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from r3lightning.app.job.main import compose_config, run
from r3lightning.app.job.report import environment, environment_line, seed_groups, summarize


def largest(history, key: str) -> tuple[float, int]:
    values = [(r[key], int(r["step"])) for r in history if key in r and not math.isnan(r[key])]
    return max(values) if values else (math.nan, -1)


def check(runs, k3_max: float, reward_min: float) -> tuple[list[str], bool]:
    """The report's lines and whether both conditions hold."""
    lines = [f"{'run':<22} {'max k3 replayed (step)':>24} {'max k3 native (step)':>22} {'reward end':>10}"]
    worst = 0.0
    for name, history in runs.items():
        (k3r, at_r), (k3n, at_n) = (largest(history, f"mismatch/k3_{s}") for s in ("replayed", "native"))
        worst = max(worst, k3r)
        end = summarize(history)["reward_end"]
        lines.append(f"{name:<22} {f'{k3r:.2e} ({at_r})':>24} {f'{k3n:.2e} ({at_n})':>22} {end:>10.3f}")
    ok = worst <= k3_max
    lines.append(f"largest k3_replayed of any step: {worst:.2e} (limit {k3_max:g})")
    for arm, histories in seed_groups(runs).items():
        steps = min(len(h) for h in histories)
        curve = [statistics.median(h[i]["reward"] for h in histories) for i in range(steps)]
        end = statistics.median(summarize(h)["reward_end"] for h in histories)
        first = next((i for i, v in enumerate(curve) if v >= reward_min), None)
        ok &= end >= reward_min
        lines.append(
            f"{arm}: median reward end {end:.3f} (limit {reward_min:g}); median first >= {reward_min:g} "
            f"at step {first}; median curve " + " ".join(f"{v:.2f}" for v in curve)
        )
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--k3-max", type=float, default=1e-3)
    parser.add_argument("--reward-min", type=float, default=0.9)
    parser.add_argument("--out", type=Path, default=Path("outputs/check_conditioning"))
    args, overrides = parser.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    job = ["experiment=compare", "seed=0", f"seeds={args.seeds}", f"steps={args.steps}", "plot=false"]
    runs = run(compose_config([*job, "trainer.enable_progress_bar=false", *overrides]), args.out)
    lines, ok = check(runs, args.k3_max, args.reward_min)
    print(
        "\n".join(["", " ".join(["overrides:", *job, *overrides]), *lines, environment_line(environment())])
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
