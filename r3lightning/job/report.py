"""Run outputs: per-step metrics CSV, the final summary table, and the PNG plot.

A run's history is a list of flat ``{metric: float}`` records, one per RL step. Per-layer
routing agreement is stored as ``used_agreement/layer_<i>`` columns, the GRPO module's paired
mismatch as ``mismatch/<name>`` columns (present on the steps it was measured). Plotting uses
matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

AGREEMENT_PREFIX = "used_agreement/layer_"
MISMATCH_PREFIX = "mismatch/"


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
    mean mismatch metrics, the lowest per-layer routing agreement seen in any step, and the
    paired mismatch (``mismatch/*``: means over the steps it was measured, and step 0's)."""
    agreements = [r[k] for r in records for k in agreement_keys(r)]  # every (step, layer) value
    n = len(records)
    out = {
        "steps": float(n),
        "reward_start": _window_mean(records, "reward", True, window),
        "reward_end": _window_mean(records, "reward", False, window),
        "k3_kl": _window_mean(records, "k3_kl", True, n),
        "ratio_out_of_band": _window_mean(records, "ratio_out_of_band", True, n),
        "agreement_mean": sum(agreements) / len(agreements) if agreements else math.nan,
        "agreement_min": min(agreements) if agreements else math.nan,
    }
    for name in PAIRED:
        key = MISMATCH_PREFIX + name
        out[name] = _window_mean(records, key, True, n)
        out[f"{name}_step0"] = records[0].get(key, math.nan) if records else math.nan
        out[f"{name}_end"] = _window_mean(records, key, False, window)
    for suffix in ("", "_step0"):
        out[f"k3_ratio{suffix}"] = _ratio(out[f"k3_native{suffix}"], out[f"k3_replayed{suffix}"])
    return out


PAIRED = (
    "native_agreement",
    "k3_native",
    "k3_replayed",
    "outside_band_native",
    "outside_band_replayed",
    "policy_entropy",
)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def _band(ratio_band: float) -> str:
    return f"[{1 / ratio_band:g}, {ratio_band:g}]"


def _fmt_table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_table(runs: Mapping[str, Sequence[Mapping[str, float]]], ratio_band: float = 2.0) -> str:
    """Fixed-width summary, one row per run (e.g. ``{"replay=r3": ..., "replay=off": ...}``);
    ``ratio_band`` is the one the out-of-band metrics were measured with.

    Every mismatch figure is paired: on the same weights and batch, the trainer's logprobs routed
    natively and with the engine's routes replayed, each against the engine's, so the native and
    replayed columns compare like with like in every arm. A second table shows step 0, where
    every arm has the same weights and rollouts."""

    def pct(value: float, digits: int) -> str:
        return "n/a" if math.isnan(value) else f"{100 * value:.{digits}f}%"

    def sci(value: float) -> str:
        return "n/a" if math.isnan(value) else f"{value:.2e}"

    def times(value: float) -> str:
        return "n/a" if math.isnan(value) else f"{value:.1f}x"

    band = _band(ratio_band)
    header = [
        "run",
        "steps",
        "reward start->end",
        "native agreement",
        "k3 native",
        "k3 replayed",
        "native/replayed",
        f"outside {band} native",
        "replayed",
        "entropy start->end",
    ]
    rows, first = (
        [header],
        [["run", "k3 native", "k3 replayed", "native/replayed", "outside native", "replayed"]],
    )
    for name, records in runs.items():
        s = summarize(records)
        rows.append(
            [
                name,
                f"{int(s['steps'])}",
                f"{s['reward_start']:.3f} -> {s['reward_end']:.3f}",
                pct(s["native_agreement"], 2),
                sci(s["k3_native"]),
                sci(s["k3_replayed"]),
                times(s["k3_ratio"]),
                pct(s["outside_band_native"], 3),
                pct(s["outside_band_replayed"], 3),
                f"{s['policy_entropy_step0']:.3f} -> {s['policy_entropy_end']:.3f}",
            ]
        )
        first.append(
            [
                name,
                sci(s["k3_native_step0"]),
                sci(s["k3_replayed_step0"]),
                times(s["k3_ratio_step0"]),
                pct(s["outside_band_native_step0"], 3),
                pct(s["outside_band_replayed_step0"], 3),
            ]
        )
    lines = _fmt_table(rows)
    lines += ["", "step 0 (same weights and rollouts in every arm):", *_fmt_table(first)]
    lines += [
        "",
        "reward: mean of the first / last 3 steps; entropy (nats) of the policy on response tokens: "
        "step 0 -> mean of the last 3 measured steps",
        "native agreement: share of the engine's expert slots the trainer's router picks natively",
        "k3 = KL(engine || trainer) estimate, outside: tokens with p_trainer / p_engine outside "
        f"{band}; native / replayed: the trainer's own routing / the engine's routes replayed, "
        "same weights and batch; means over the measured steps",
    ]
    return "\n".join(lines)


def plot_runs(
    path: str | Path, runs: Mapping[str, Sequence[Mapping[str, float]]], ratio_band: float = 2.0
) -> None:
    """Six panels over RL steps, one colour per run: mean reward, native routing agreement, paired
    k3 KL (solid: native routing, dashed: replayed), its native/replayed ratio, the fraction of
    tokens with ratio outside ``[1 / ratio_band, ratio_band]`` (native / replayed) and the policy
    entropy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def series(records, key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
        points = [(r["step"], scale * r[key]) for r in records if key in r and not math.isnan(r[key])]
        return [p[0] for p in points], [p[1] for p in points]

    for (name, records), color in zip(runs.items(), colors, strict=False):
        axes[0, 0].plot(*series(records, "reward"), color=color, marker=".", label=name)
        axes[0, 1].plot(
            *series(records, MISMATCH_PREFIX + "native_agreement", 100), color=color, marker=".", label=name
        )
        for col, key, scale in ((2, "k3", 1.0), (1, "outside_band", 100.0)):
            ax = axes[0, 2] if col == 2 else axes[1, 1]
            ax.plot(
                *series(records, f"{MISMATCH_PREFIX}{key}_native", scale),
                color=color,
                marker=".",
                label=f"{name} native",
            )
            ax.plot(
                *series(records, f"{MISMATCH_PREFIX}{key}_replayed", scale),
                color=color,
                ls="--",
                marker="x",
                label=f"{name} replayed",
            )
        ratios = [
            (r["step"], _ratio(r[MISMATCH_PREFIX + "k3_native"], r[MISMATCH_PREFIX + "k3_replayed"]))
            for r in records
            if MISMATCH_PREFIX + "k3_native" in r and MISMATCH_PREFIX + "k3_replayed" in r
        ]
        axes[1, 0].plot([p[0] for p in ratios], [p[1] for p in ratios], color=color, marker=".", label=name)
        axes[1, 2].plot(
            *series(records, MISMATCH_PREFIX + "policy_entropy"), color=color, marker=".", label=name
        )
    titles = {
        (0, 0): "mean reward",
        (0, 1): "native routing agreement with the engine (%)",
        (0, 2): "paired k3 KL(engine || trainer)",
        (1, 0): "k3 native / k3 replayed (same weights)",
        (1, 1): f"tokens with ratio outside {_band(ratio_band)} (%)",
        (1, 2): "policy entropy (nats)",
    }
    for (i, j), title in titles.items():
        axes[i, j].set_title(title)
    axes[0, 2].set_yscale("log")
    axes[1, 0].axhline(1.0, color="grey", lw=0.8)
    axes[1, 0].set_ylim(bottom=0)
    axes[1, 1].set_ylim(bottom=0)
    for ax in axes.flat:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    plt.close(fig)
