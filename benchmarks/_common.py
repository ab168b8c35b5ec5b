"""Shared benchmark helpers: interleaved timing, peak-RSS probes in child processes, tables.

Every benchmark times its arms *side by side in one run*: each repeat runs every arm once, in
turn, so drift on a shared machine (other processes, thermal state) hits all arms alike, and the
reported figure is the median over repeats.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/x.py` from a checkout without installing
    sys.path.insert(0, str(ROOT))

GiB = float(1 << 30)
MiB = float(1 << 20)


def time_arms(
    arms: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1, *, interleave: bool = True
) -> dict[str, float]:
    """Median wall time (seconds) of each arm.

    ``interleave=True`` runs every arm once per round, so slow drift hits all arms alike; with
    ``False`` each arm runs its warm-up and repeats back to back, reaching its own steady state
    (the allocator then reuses the arm's previous buffers instead of inheriting another arm's
    heap). Each call's result is dropped (and garbage collected) before the clock starts again.
    """
    samples: dict[str, list[float]] = {name: [] for name in arms}
    if interleave:
        schedule = [(name, r) for r in range(warmup + repeats) for name in arms]
    else:
        schedule = [(name, r) for name in arms for r in range(warmup + repeats)]
    for name, round_index in schedule:
        gc.collect()
        start = time.perf_counter()
        result = arms[name]()
        elapsed = time.perf_counter() - start
        del result
        if round_index >= warmup:
            samples[name].append(elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


def reset_peak_rss() -> int:
    """Reset the peak-RSS mark to the current RSS (Linux >= 4.0) and return the current RSS.

    Without ``/proc`` support the mark is not reset and the process's lifetime peak is used.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass
    current = _status_bytes("VmRSS")
    return current if current is not None else peak_rss()


def peak_rss() -> int:
    """Peak resident set size (bytes) since the last :func:`reset_peak_rss` or process start."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(script: Path, args: Sequence[str], timeout: float = 600.0) -> dict[str, Any]:
    """Run ``script args`` in a fresh interpreter and parse the JSON object on its last line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{script.name} {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A Markdown table (pasteable into RESULTS.md / README)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    print(f"\n### {title}\n")
    print(line(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print(line(row))
    sys.stdout.flush()


def ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x" if reference > 0 else "n/a"


def machine_line() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import torch

    from r3lightning.app.job.report import environment

    env = environment()  # the CPU model and the capability torch dispatches to decide the numbers
    load = f", 1-min load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (
        f"python {sys.version.split()[0]}, torch {torch.__version__}, {cpus} usable CPUs, "
        f"torch threads {torch.get_num_threads()}{load}, CPU {env['cpu']}, torch CPU capability {env['capability']}"
    )
