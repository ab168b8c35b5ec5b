"""Run outputs: per-step metrics CSV, the summary table, the plot, and the environment line.

A run's history is a list of flat ``{metric: float}`` records, one per RL step: per-layer routing
agreement as ``used_agreement/layer_<i>``, the GRPO module's paired mismatch as ``mismatch/<name>``
(on the steps it was measured), its importance-sampling correction as ``correction/<name>`` (when
one is applied), ``simulated_disagreement`` when the engine simulated one. Runs
named ``<arm>/seed=<s>`` are seeds of one arm: the table and the plot show the median over seeds
and its [min, max]. Plotting uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import math
import platform
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

AGREEMENT_PREFIX = "used_agreement/layer_"
MISMATCH_PREFIX = "mismatch/"
CORRECTION_PREFIX = "correction/"  # the GRPO module's importance-sampling correction (when applied)
CORRECTED = ("ess", "truncated_fraction", "masked_fraction")
SEED_SEP = "/seed="
SIMULATED = "simulated_disagreement"
PAIRED = ("native_agreement", "k3_native", "k3_replayed", "outside_band_native", "outside_band_replayed")
History = Sequence[Mapping[str, float]]


def write_csv(path: str | Path, records: History) -> None:
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


def environment() -> dict[str, str]:
    """What a run's rows depend on besides its config: library versions, intra-op threads, CPU."""
    import lightning
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {"torch": torch, "transformers": transformers, "lightning": lightning}
    return {
        **{k: m.__version__ for k, m in versions.items()},
        "threads": str(torch.get_num_threads()),
        "cpu": cpu,
    }


def environment_line(env: Mapping[str, str]) -> str:
    return (
        f"environment: torch {env['torch']}, transformers {env['transformers']}, lightning "
        f"{env['lightning']}, {env['threads']} intra-op threads, CPU {env['cpu']}"
    )


def simulated_share(runs: Mapping[str, History]) -> str | None:
    """The simulated engine disagreement of ``runs`` as a share (``"10%"``; None: not simulated)."""
    values = sorted({r[SIMULATED] for h in runs.values() for r in h if r.get(SIMULATED)})
    return ", ".join(f"{100 * v:g}%" for v in values) if values else None


def seed_groups(runs: Mapping[str, History]) -> dict[str, list[History]]:
    """``{arm: [history of each seed]}`` from run names ``<arm>`` or ``<arm>/seed=<s>``."""
    out: dict[str, list[History]] = {}
    for name, history in runs.items():
        out.setdefault(name.split(SEED_SEP)[0], []).append(history)
    return out


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """``(median, min, max)`` of the values that are not NaN (NaNs when none is)."""
    kept = sorted(v for v in values if not math.isnan(v))
    return (statistics.median(kept), kept[0], kept[-1]) if kept else (math.nan,) * 3


def _mean(records: History, key: str, part: slice = slice(None)) -> float:
    values = [r[key] for r in records if key in r and not math.isnan(r[key])][part]
    return sum(values) / len(values) if values else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def summarize(records: History, window: int = 3) -> dict[str, float]:
    """Headline figures of one run: reward at the start and end (means over ``window`` steps),
    mean mismatch metrics, the lowest per-layer routing agreement seen in any step, and the
    paired mismatch (``mismatch/*``: means over the steps it was measured, and step 0's)."""
    agreements = [r[k] for r in records for k in agreement_keys(r)]  # every (step, layer) value
    out = {
        "steps": float(len(records)),
        "reward_start": _mean(records, "reward", slice(window)),
        "reward_end": _mean(records, "reward", slice(-window, None)),
        "k3_kl": _mean(records, "k3_kl"),
        "ratio_out_of_band": _mean(records, "ratio_out_of_band"),
        "agreement_mean": sum(agreements) / len(agreements) if agreements else math.nan,
        "agreement_min": min(agreements) if agreements else math.nan,
    }
    for name in (*PAIRED, "policy_entropy"):
        key = MISMATCH_PREFIX + name
        out[name] = _mean(records, key)
        out[f"{name}_step0"] = records[0].get(key, math.nan) if records else math.nan
        out[f"{name}_end"] = _mean(records, key, slice(-window, None))
    for name in CORRECTED:
        out[name] = _mean(records, CORRECTION_PREFIX + name)
    for suffix in ("", "_step0"):
        out[f"k3_ratio{suffix}"] = _ratio(out[f"k3_native{suffix}"], out[f"k3_replayed{suffix}"])
    return out


def _fmt(kind: str) -> Callable[[float], str]:
    def fmt(value: float) -> str:
        if math.isnan(value):
            return "n/a"
        digits = {"pct2": 2, "pct3": 3}.get(kind)
        if digits is not None:
            return f"{100 * value:.{digits}f}%"
        return {"int": f"{value:.0f}", "f3": f"{value:.3f}", "sci": f"{value:.2e}", "x": f"{value:.1f}x"}[
            kind
        ]

    return fmt


def _fmt_table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def format_table(
    runs: Mapping[str, History], ratio_band: float = 2.0, *, env: Mapping[str, str] | None = None
) -> str:
    """Fixed-width summary, one row per arm (``{"replay=r3": ..., "replay=off": ...}``, or
    ``<arm>/seed=<s>`` names: the arm's row is the median over seeds of each figure, the row
    under it its [min, max]); a second table has step 0 of every run, where every arm has the same
    weights and rollouts. ``ratio_band``: the one the out-of-band metrics were measured with.
    The simulation label (if any) heads the text, ``env``'s line ends it.

    Every mismatch figure is paired: on the same weights and batch, the trainer's logprobs routed
    natively and with the engine's routes replayed, each against the engine's."""
    band = f"[{1 / ratio_band:g}, {ratio_band:g}]"
    columns = [  # header, the summarize() keys joined by "->", format
        ("steps", ("steps",), "int"),
        ("reward start->end", ("reward_start", "reward_end"), "f3"),
        ("native agreement", ("native_agreement",), "pct2"),
        ("k3 native", ("k3_native",), "sci"),
        ("k3 replayed", ("k3_replayed",), "sci"),
        ("native/replayed", ("k3_ratio",), "x"),
        (f"outside {band} native", ("outside_band_native",), "pct3"),
        ("replayed", ("outside_band_replayed",), "pct3"),
        ("entropy start->end", ("policy_entropy_step0", "policy_entropy_end"), "f3"),
    ]
    corrected = any(CORRECTION_PREFIX + "ess" in r for h in runs.values() for r in h)
    if corrected:
        columns += [("IS ESS", ("ess",), "f3"), ("truncated", ("truncated_fraction",), "pct2")]
        columns += [("masked", ("masked_fraction",), "pct2")]
    step0 = [("k3 native", "sci"), ("k3 replayed", "sci"), ("native/replayed", "x")]
    step0 += [("outside native", "pct3"), ("replayed", "pct3")]
    rows, first = [["run", *(c[0] for c in columns)]], [["run", *(c[0] for c in step0)]]
    groups = seed_groups(runs)
    for arm, histories in groups.items():
        summaries = [summarize(h) for h in histories]
        stats = {k: spread([s[k] for s in summaries]) for _, keys, _ in columns for k in keys}
        rows.append([arm, *(" -> ".join(_fmt(f)(stats[k][0]) for k in keys) for _, keys, f in columns)])
        if len(histories) > 1:
            cells = [
                " -> ".join(f"[{_fmt(f)(stats[k][1])}, {_fmt(f)(stats[k][2])}]" for k in keys)
                for _, keys, f in columns
            ]
            rows.append([f"  [min, max] of {len(histories)}", *cells])
    for name, history in runs.items():
        s = summarize(history)
        keys = ("k3_native", "k3_replayed", "k3_ratio", "outside_band_native", "outside_band_replayed")
        first.append([name, *(_fmt(f)(s[f"{k}_step0"]) for k, (_, f) in zip(keys, step0, strict=True))])
    share = simulated_share(runs)
    lines = (
        [f"SIMULATED engine disagreement: {share} of expert slots (rollout.server.{SIMULATED})", ""]
        if share
        else []
    )
    if any(len(h) > 1 for h in groups.values()):
        lines += ["median over seeds per arm; the row under each arm: [min, max] over its seeds", ""]
    lines += _fmt_table(rows)
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
    if corrected:
        lines.append(
            "IS ESS, truncated, masked: the loss's importance-sampling correction (algorithm.correction; "
            "n/a: none), effective sample size (sum w)^2 / (n sum w^2) and shares of loss tokens, "
            "means over steps"
        )
    return "\n".join(lines + ([environment_line(env)] if env else []))


def plot_runs(path: str | Path, runs: Mapping[str, History], ratio_band: float = 2.0) -> list[str]:
    """Six panels over RL steps, one colour per arm: mean reward, native routing agreement, paired
    k3 KL (solid: native routing, dashed: replayed), its native/replayed ratio, the share of
    tokens with ratio outside ``[1 / ratio_band, ratio_band]`` (native / replayed) and the policy
    entropy. Several seeds of an arm: the median line in a [min, max] band. Returns the titles
    (figure, then panels), which name a simulated disagreement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def k3_ratio(r: Mapping[str, float]) -> float:
        native, replayed = (r.get(f"{MISMATCH_PREFIX}k3_{s}", math.nan) for s in ("native", "replayed"))
        return _ratio(native, replayed)

    m = MISMATCH_PREFIX
    panels = [  # title, [(value of a record, line style suffix)], percent
        ("mean reward", [(lambda r: r.get("reward", math.nan), "")]),
        (
            "native routing agreement with the engine (%)",
            [(lambda r: 100 * r.get(m + "native_agreement", math.nan), "")],
        ),
        (
            "paired k3 KL(engine || trainer)",
            [(lambda r, s=s: r.get(f"{m}k3_{s}", math.nan), s) for s in ("native", "replayed")],
        ),
        ("k3 native / k3 replayed (same weights)", [(k3_ratio, "")]),
        (
            f"tokens with ratio outside [{1 / ratio_band:g}, {ratio_band:g}] (%)",
            [
                (lambda r, s=s: 100 * r.get(f"{m}outside_band_{s}", math.nan), s)
                for s in ("native", "replayed")
            ],
        ),
        ("policy entropy (nats)", [(lambda r: r.get(m + "policy_entropy", math.nan), "")]),
    ]
    share = simulated_share(runs)
    label = f"SIMULATED engine disagreement {share} (rollout.server.{SIMULATED})" if share else ""
    titles = [f"{t}, simulated {share}" if share else t for t, _ in panels]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5 + 0.4 * bool(share)), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (arm, histories), color in zip(seed_groups(runs).items(), colors, strict=False):
        for ax, (_, lines) in zip(axes.flat, panels, strict=True):
            for value, style in lines:
                by_step: dict[float, list[float]] = {}
                for history in histories:
                    for r in history:
                        if not math.isnan(v := value(r)):
                            by_step.setdefault(r["step"], []).append(v)
                steps = sorted(by_step)
                med, low, high = (
                    zip(*(spread(by_step[s]) for s in steps), strict=True) if steps else ((), (), ())
                )
                dashed = style == "replayed"
                name = arm if len(histories) == 1 else f"{arm} (median of {len(histories)})"
                ax.plot(
                    steps,
                    med,
                    color=color,
                    ls="--" if dashed else "-",
                    marker="x" if dashed else ".",
                    label=f"{name} {style}".strip(),
                )
                if len(histories) > 1:
                    ax.fill_between(steps, low, high, color=color, alpha=0.15, lw=0)
    for ax, title in zip(axes.flat, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0, 2].set_yscale("log")
    axes[1, 0].axhline(1.0, color="grey", lw=0.8)
    axes[1, 0].set_ylim(bottom=0)
    axes[1, 1].set_ylim(bottom=0)
    if label:
        fig.suptitle(label)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [label, *titles]
