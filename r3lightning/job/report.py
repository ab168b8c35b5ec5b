"""Run outputs: per-step metrics CSV, the final summary table, and the PNG plot.

A run's history is a list of flat ``{metric: float}`` records, one per RL step. Per-layer
routing agreement is stored as ``used_agreement/layer_<i>`` columns. Plotting uses matplotlib's
Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

AGREEMENT_PREFIX = "used_agreement/layer_"


def write_csv(path: str | Path, records: Sequence[Mapping[str, float]]) -> None:
    """(Re)write ``path`` with one row per record; columns are the union of keys, in order."""
    columns: list[str] = []
    for record in records:
        columns.extend(k for k in record if k not in columns)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(records)


def read_csv(path: str | Path) -> list[dict[str, float]]:
    """Records written by :func:`write_csv`; empty cells are dropped."""
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def agreement_keys(record: Mapping[str, float]) -> list[str]:
    """The record's per-layer agreement columns, by layer index."""
    keys = [k for k in record if k.startswith(AGREEMENT_PREFIX)]
    return sorted(keys, key=lambda k: int(k[len(AGREEMENT_PREFIX) :]))


def mean_agreement(record: Mapping[str, float]) -> float:
    """Mean routing agreement over layers (NaN when the step has none)."""
    values = [record[k] for k in agreement_keys(record)]
    return sum(values) / len(values) if values else math.nan


def _window_mean(records: Sequence[Mapping[str, float]], key: str, first: bool, window: int) -> float:
    values = [r[key] for r in records if key in r and not math.isnan(r[key])]
    if not values:
        return math.nan
    part = values[:window] if first else values[-window:]
    return sum(part) / len(part)


def summarize(records: Sequence[Mapping[str, float]], window: int = 3) -> dict[str, float]:
    """Headline figures of one run: reward at the start and end (means over ``window`` steps),
    mean mismatch metrics, and the lowest per-layer routing agreement seen in any step."""
    agreements = [r[k] for r in records for k in agreement_keys(r)]  # every (step, layer) value
    n = len(records)
    return {
        "steps": float(n),
        "reward_start": _window_mean(records, "reward", True, window),
        "reward_end": _window_mean(records, "reward", False, window),
        "k3_kl": _window_mean(records, "k3_kl", True, n),
        "ratio_out_of_band": _window_mean(records, "ratio_out_of_band", True, n),
        "agreement_mean": sum(agreements) / len(agreements) if agreements else math.nan,
        "agreement_min": min(agreements) if agreements else math.nan,
    }


def _band(ratio_band: float) -> str:
    return f"[{1 / ratio_band:g}, {ratio_band:g}]"


def format_table(runs: Mapping[str, Sequence[Mapping[str, float]]], ratio_band: float = 2.0) -> str:
    """Fixed-width summary, one row per run (e.g. ``{"replay=r3": ..., "replay=off": ...}``);
    ``ratio_band`` is the one the ``ratio_out_of_band`` metric was measured with."""
    header = [
        "run",
        "steps",
        "reward start->end",
        "k3 KL",
        f"ratio outside {_band(ratio_band)}",
        "routing agreement",
        "min",
    ]
    rows = [header]

    def pct(value: float, digits: int) -> str:
        return "n/a" if math.isnan(value) else f"{100 * value:.{digits}f}%"

    for name, records in runs.items():
        s = summarize(records)
        rows.append(
            [
                name,
                f"{int(s['steps'])}",
                f"{s['reward_start']:.3f} -> {s['reward_end']:.3f}",
                f"{s['k3_kl']:.2e}",
                pct(s["ratio_out_of_band"], 3),
                pct(s["agreement_mean"], 2),
                pct(s["agreement_min"], 2),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [
        "",
        "reward: mean of the first / last 3 steps",
        f"k3 KL (rollout || trainer), ratio outside {_band(ratio_band)}: token means, averaged over steps",
        "routing agreement: share of the engine's experts the training forward used (mean, min over steps x MoE layers)",
    ]
    return "\n".join(lines)


def plot_runs(
    path: str | Path, runs: Mapping[str, Sequence[Mapping[str, float]]], ratio_band: float = 2.0
) -> None:
    """Four panels over RL steps, one colour per run: mean reward, k3 KL(rollout || trainer),
    fraction of tokens with probability ratio outside ``[1 / ratio_band, ratio_band]``, routing
    agreement per layer (thin lines) and its mean (thick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    panels = [
        (axes[0, 0], "reward", "mean reward"),
        (axes[0, 1], "k3_kl", "k3 KL(rollout || trainer)"),
        (axes[1, 0], "ratio_out_of_band", f"tokens with ratio outside {_band(ratio_band)}"),
    ]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (name, records), color in zip(runs.items(), colors, strict=False):
        steps = [r["step"] for r in records]
        for ax, key, _ in panels:
            ax.plot(steps, [r.get(key, math.nan) for r in records], color=color, label=name, marker=".")
        ax = axes[1, 1]
        keys = sorted({k for r in records for k in agreement_keys(r)})
        for key in keys:
            ax.plot(steps, [100 * r.get(key, math.nan) for r in records], color=color, alpha=0.35, lw=0.8)
        ax.plot(
            steps, [100 * mean_agreement(r) for r in records], color=color, lw=2.2, label=f"{name} (mean)"
        )
    for ax, _, title in panels:
        ax.set_title(title)
    axes[1, 1].set_title("routing agreement with rollout, per layer (%)")
    axes[0, 1].set_yscale("symlog", linthresh=1e-6)
    for ax in axes.flat:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
