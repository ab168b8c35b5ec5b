"""The README's demo tables: run each experiment named on the command line and print its summary.

    python scripts/demo_tables.py compare compare_realistic [--out outputs/demo_tables]
        [--reuse] [--plots docs] [-- extra overrides for every run]

Each experiment runs as ``python -m r3lightning.app.job.main experiment=<name>`` in its own process
(into ``<out>/<name>``), and its ``summary.txt`` (the tables over seeds, the simulation label if
any, the environment line under them) is printed as Markdown. ``--reuse`` prints an existing
``summary.txt`` without running again; ``--plots DIR`` copies each ``metrics.png`` to
``DIR/demo_metrics.png`` (compare) or ``DIR/demo_metrics_<name without compare_>.png``.
Rows are identical for the same versions, intra-op thread count and machine type.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def plot_name(experiment: str) -> str:
    suffix = experiment.removeprefix("compare").lstrip("_")
    return f"demo_metrics{'_' + suffix if suffix else ''}.png"


def table(experiment: str, out: Path, overrides: list[str], reuse: bool) -> str:
    run_dir = out / experiment
    command = [sys.executable, "-m", "r3lightning.app.job.main", f"experiment={experiment}", *overrides]
    seconds = None
    if not (reuse and (run_dir / "summary.txt").is_file()):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        start = time.perf_counter()
        job_args = ["trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"]
        # the job's own output goes to stderr: stdout is only the Markdown
        subprocess.run([*command, *job_args], check=True, env=env, stdout=sys.stderr)
        seconds = time.perf_counter() - start
    shown = " ".join(["python -m r3lightning.app.job.main", *command[3:]])
    took = "" if seconds is None else f" ({seconds:.0f} s)"
    summary = (run_dir / "summary.txt").read_text().rstrip()
    return f"### `{shown}`{took}\n\n```text\n{summary}\n```\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("experiments", nargs="+", help="experiment names (conf/experiment/<name>.yaml)")
    parser.add_argument("--out", type=Path, default=Path("outputs/demo_tables"))
    parser.add_argument("--reuse", action="store_true", help="print existing summaries without running")
    parser.add_argument("--plots", type=Path, default=None, help="copy each run's metrics.png here")
    args, overrides = parser.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    for experiment in args.experiments:
        print(table(experiment, args.out, overrides, args.reuse), flush=True)
        if args.plots is not None and (args.out / experiment / "metrics.png").is_file():
            args.plots.mkdir(parents=True, exist_ok=True)
            shutil.copy(args.out / experiment / "metrics.png", args.plots / plot_name(experiment))


if __name__ == "__main__":
    main()
