"""Run outputs: metrics CSV, summary table, plot, environment line. A history is one ``{metric: float}``
record per RL step; runs ``<arm>/seed=<s>`` are seeds of one arm (shown: median and [min, max])."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

# what a run's rows depend on besides its config; imported from here with the other run outputs
from r3lightning.app.job.environment import environment, environment_line

__all__ = [
    "AGREEMENT_PREFIX",
    "CORRECTION_PREFIX",
    "MISMATCH_PREFIX",
    "agreement_keys",
    "environment",
    "environment_line",
    "format_table",
    "plot_runs",
    "read_csv",
    "seed_groups",
    "simulated_share",
    "spread",
    "summarize",
    "write_csv",
]

AGREEMENT_PREFIX = "used_agreement/layer_"
MISMATCH_PREFIX = "mismatch/"
CORRECTION_PREFIX = "correction/"
SEED_SEP = "/seed="
SIMULATED = "simulated_disagreement"
TURN_REWARD = "turn_reward/turn_2"
VLLM = "vllm_engine"  # the label of runs against a real vLLM engine
# the paired mismatch the GRPO module measures (logged as mismatch/<name>)
PAIRED = (
    "native_agreement",
    "k3_native",
    "k3_replayed",
    "outside_band_native",
    "outside_band_replayed",
    "abs_logprob_diff_native",
    "abs_logprob_diff_replayed",
)
History = Sequence[Mapping[str, float]]


def write_csv(path: str | Path, records: History) -> None:
    """(Re)writes a CSV file of a history.

    Args:
        path: The file, replaced if it exists.
        records: One row each; the columns are the union of their keys, in first-seen order,
            and a record without a column leaves its cell empty.
    """
    columns = list(dict.fromkeys(k for record in records for k in record))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(records)


def read_csv(path: str | Path) -> list[dict[str, float]]:
    """The history `write_csv` wrote.

    Args:
        path: The CSV file.

    Returns:
        One ``{column: value}`` record per row; empty cells are left out.

    Raises:
        ValueError: A cell is not a number.
    """
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def agreement_keys(record: Mapping[str, float]) -> list[str]:
    """The per-layer agreement columns of a record.

    Args:
        record: One step's metrics.

    Returns:
        Its ``used_agreement/layer_XX`` keys, by layer index.
    """
    keys = [k for k in record if k.startswith(AGREEMENT_PREFIX)]
    return sorted(keys, key=lambda k: int(k[len(AGREEMENT_PREFIX) :]))


def simulated_share(runs: Mapping[str, History]) -> str | None:
    """The engine disagreement the runs simulated, for the titles that must say so.

    Args:
        runs: ``{run name: history}``.

    Returns:
        The distinct simulated shares, ascending, as percentages (``"10%"``, ``"5%, 10%"``);
        None when no run simulated one.
    """
    shares = {record[SIMULATED] for history in runs.values() for record in history if record.get(SIMULATED)}
    if not shares:
        return None
    return ", ".join(f"{100 * share:g}%" for share in sorted(shares))


def seed_groups(runs: Mapping[str, History]) -> dict[str, list[History]]:
    """The runs grouped by arm.

    Args:
        runs: ``{run name: history}``, the names ``<arm>`` or ``<arm>/seed=<s>``.

    Returns:
        ``{arm: [history of each of its seeds]}``, in the order the arms first appear.
    """
    out: dict[str, list[History]] = {}
    for name, history in runs.items():
        out.setdefault(name.split(SEED_SEP)[0], []).append(history)
    return out


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """The median and range of the values that are not NaN.

    Args:
        values: Any numbers, NaN among them.

    Returns:
        ``(median, min, max)``; three NaNs when every value is NaN (or there are none).
    """
    kept = sorted(v for v in values if not math.isnan(v))
    return (statistics.median(kept), kept[0], kept[-1]) if kept else (math.nan,) * 3


def _mean(records: History, key: str, part: slice = slice(None)) -> float:  # NaNs left out
    values = [r[key] for r in records if key in r and not math.isnan(r[key])][part]
    return sum(values) / len(values) if values else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def summarize(records: History, window: int = 3) -> dict[str, float]:
    """The headline figures of one run, as the summary table shows them.

    Means leave out steps where a metric is missing or NaN; a figure nothing measured is NaN.

    Args:
        records: The run's history.
        window: Steps averaged at the start and at the end of the run.

    Returns:
        ``{figure: value}``: reward at the start and end (means over ``window`` steps), routing
        agreement (mean, lowest), mismatch means, each paired mismatch metric's mean, ``_end``
        (last ``window`` steps) and ``_step0``, and the correction, GSPO and multi-turn figures.
    """
    agreements = [r[k] for r in records for k in agreement_keys(r)]  # every (step, layer) value
    end = slice(-window, None)
    out = {
        "steps": float(len(records)),
        "reward_start": _mean(records, "reward", slice(window)),
        "reward_end": _mean(records, "reward", end),
        "agreement_min": min(agreements, default=math.nan),
        "k3_kl": _mean(records, "k3_kl"),
        "ratio_out_of_band": _mean(records, "ratio_out_of_band"),
        "agreement_mean": sum(agreements) / len(agreements) if agreements else math.nan,
    }
    for name in (*PAIRED, "policy_entropy"):
        key = MISMATCH_PREFIX + name
        out[name] = _mean(records, key)
        out[f"{name}_end"] = _mean(records, key, end)
        out[f"{name}_step0"] = records[0].get(key, math.nan) if records else math.nan
    for _header, name, _format in CORRECTED_COLUMNS:
        out[name] = _mean(records, CORRECTION_PREFIX + name)
    out[SEQUENCE_CLIP] = _mean(records, SEQUENCE_CLIP)
    out["turns_end"] = _mean(records, "turns", end)
    out["turn_2_reward_end"] = _mean(records, TURN_REWARD, end)
    for turn in (1, 2):
        out[f"route_bytes_{turn}"] = _mean(records, f"route_bytes/turn_{turn}")
    for suffix in ("", "_step0"):
        out[f"k3_ratio{suffix}"] = _ratio(out[f"k3_native{suffix}"], out[f"k3_replayed{suffix}"])
    return out


def _fmt_table(rows: list[list[str]]) -> list[str]:
    """``rows`` (the first is the header) as left-aligned columns, a dashed rule under the header."""
    widths = [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    rule = "  ".join("-" * width for width in widths)
    return [lines[0], rule, *lines[1:]]


# The summary's columns: header ({band}: the ratio band), summarize() keys (joined by "->"), format.
COLUMNS = (
    ("steps", "steps", "{:.0f}"),
    ("reward start->end", "reward_start reward_end", "{:.3f}"),
    ("native agreement", "native_agreement", "{:.2%}"),
    ("k3 native", "k3_native", "{:.2e}"),
    ("k3 replayed", "k3_replayed", "{:.2e}"),
    ("native/replayed", "k3_ratio", "{:.1f}x"),
    ("outside {band} native", "outside_band_native", "{:.3%}"),
    ("replayed", "outside_band_replayed", "{:.3%}"),
    ("entropy start->end", "policy_entropy_step0 policy_entropy_end", "{:.3f}"),
)
CORRECTED_COLUMNS = (  # shown when a run applied an importance-sampling correction
    ("IS ESS", "ess", "{:.4f}"),
    ("truncated", "truncated_fraction", "{:.2%}"),
    ("masked", "masked_fraction", "{:.2%}"),
)
SEQUENCE_CLIP = "sequence_clip_fraction"  # logged by algorithm.loss=gspo
GSPO_COLUMNS = (("clipped seqs", SEQUENCE_CLIP, "{:.1%}"),)
MULTITURN_COLUMNS = (  # shown when a run's trajectories had turns (task=<an environment>)
    ("turns end", "turns_end", "{:.2f}"),
    ("turn 2 reward end", "turn_2_reward_end", "{:.3f}"),
    ("route B turn 1->2", "route_bytes_1 route_bytes_2", "{:.0f}"),
    ("used agreement", "agreement_mean", "{:.2%}"),
)
REAL_ENGINE_COLUMNS = (  # shown for runs against a real engine (rollout.protocol=vllm)
    ("|dlogp| native", "abs_logprob_diff_native", "{:.4f}"),
    ("replayed", "abs_logprob_diff_replayed", "{:.4f}"),
)
# the step-0 table: the paired columns of COLUMNS (k3 native ... outside replayed) at step 0
STEP0 = tuple((header.replace(" {band}", ""), f"{keys}_step0", spec) for header, keys, spec in COLUMNS[3:8])


def _cell(spec: str, value: float) -> str:
    return "n/a" if math.isnan(value) else spec.format(value)


def _rows(name: str, summaries: list[dict[str, float]], columns: Sequence[tuple]) -> list[list[str]]:
    """``name``'s row of medians over ``summaries`` and, for several, the row of their [min, max]."""
    medians = [name]
    ranges = [f"  [min, max] of {len(summaries)}"]
    for _header, keys, spec in columns:
        # a cell shows one figure, or several joined by "->" (a start and an end)
        spreads = [spread([summary[key] for summary in summaries]) for key in keys.split()]
        medians.append(" -> ".join(_cell(spec, median) for median, _, _ in spreads))
        ranges.append(" -> ".join(f"[{_cell(spec, low)}, {_cell(spec, high)}]" for _, low, high in spreads))
    return [medians, ranges] if len(summaries) > 1 else [medians]


def format_table(
    runs: Mapping[str, History], ratio_band: float = 2.0, *, env: Mapping[str, str] | None = None
) -> str:
    """The fixed-width summary of the runs (docs/demo.md): a row per arm (several seeds: their
    medians, their [min, max] in the row under it), every run's step 0, a legend. Columns for
    corrections, GSPO, multi-turn and a real engine appear when a run logged them.

    Args:
        runs: ``{run name: history}``, the names ``<arm>`` or ``<arm>/seed=<s>``.
        ratio_band: The band of the ``outside`` columns, as the runs measured it.
        env: What `environment` returned, shown as the last line; None leaves it out.

    Returns:
        The table, lines joined by newlines.
    """
    band = f"[{1 / ratio_band:g}, {ratio_band:g}]"
    groups = {arm: [summarize(h) for h in histories] for arm, histories in seed_groups(runs).items()}
    every_record = [record for history in runs.values() for record in history]
    corrected = any(CORRECTION_PREFIX + "ess" in r for r in every_record)
    multiturn = any(TURN_REWARD in r for r in every_record)
    gspo = any(SEQUENCE_CLIP in r for r in every_record)
    real = any(r.get(VLLM) for r in every_record)
    columns = COLUMNS
    if corrected:
        columns += CORRECTED_COLUMNS
    if gspo:
        columns += GSPO_COLUMNS
    if multiturn:
        columns += MULTITURN_COLUMNS
    if real:
        columns += REAL_ENGINE_COLUMNS
    table = [["run", *(header.format(band=band) for header, _, _ in columns)]]
    for arm, summaries in groups.items():
        table += _rows(arm, summaries, columns)
    first = [["run", *(header for header, _, _ in STEP0)]]
    for name, history in runs.items():
        first += _rows(name, [summarize(history)], STEP0)
    lines = []
    share = simulated_share(runs)
    if share:
        lines += [f"SIMULATED engine disagreement: {share} of expert slots (rollout.server.{SIMULATED})", ""]
    if real:
        lines += [
            "REAL ENGINE: vLLM serves the rollouts, its weights synced every step (rollout.protocol=vllm)",
            "",
        ]
    if any(len(s) > 1 for s in groups.values()):
        lines += ["median over seeds per arm; the row under each arm: [min, max] over its seeds", ""]
    lines += [*_fmt_table(table), "", "step 0 (same weights and rollouts in every arm):", *_fmt_table(first)]
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
    if gspo:
        lines.append(
            "clipped seqs: share of sequences whose GSPO ratio exp(mean token log-ratio) was clipped "
            "(algorithm.loss=gspo; mean over steps)"
        )
    if real:
        lines.append(
            "|dlogp|: mean |log p_trainer - log p_engine| over loss tokens, native / replayed, means over steps"
        )
    if multiturn:
        lines.append(
            "turns end, turn 2 reward end: means over the last 3 steps; route B: route bytes a "
            "trajectory's turn 1 / turn 2 received (means over steps; only new rows travel); used "
            "agreement: share of the engine's expert slots the training forward used, every turn's rows"
        )
    return "\n".join(lines + ([environment_line(env)] if env else []))


def plot_runs(path: str | Path, runs: Mapping[str, History], ratio_band: float = 2.0) -> list[str]:
    """Plots the runs: six panels over RL steps, one colour per arm (several seeds: the median in
    a [min, max] band; dashed: replayed routing). Titles name a simulated disagreement.

    Args:
        path: The image file (its suffix picks the format, e.g. ``.png``).
        runs: ``{run name: history}``, the names ``<arm>`` or ``<arm>/seed=<s>``.
        ratio_band: The band of the ``outside`` panel, as the runs measured it.

    Returns:
        The figure's title (empty unless simulated), then the six panels' titles.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = MISMATCH_PREFIX  # most panels plot a paired mismatch column
    band = f"[{1 / ratio_band:g}, {ratio_band:g}]"
    pair = [m + "k3_native", m + "k3_replayed"]
    outside = [m + "outside_band_native", m + "outside_band_replayed"]
    panels = {  # title: columns (the second one, replayed, dashed), scale
        "mean reward": (["reward"], 1),
        "native routing agreement with the engine (%)": ([m + "native_agreement"], 100),
        "paired k3 KL(engine || trainer)": (pair, 1),
        "k3 native / k3 replayed (same weights)": (["k3_ratio"], 1),
        f"tokens with ratio outside {band} (%)": (outside, 100),
        "policy entropy (nats)": ([m + "policy_entropy"], 1),
    }
    share = simulated_share(runs)
    titles = [f"{t}, simulated {share}" if share else t for t in panels]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (arm, histories), color in zip(seed_groups(runs).items(), colors, strict=False):
        name = arm if len(histories) == 1 else f"{arm} (median of {len(histories)})"
        records = []  # every seed's, with the k3 ratio on the steps that measured both k3
        for history in histories:
            for record in history:
                if set(pair) <= set(record):
                    record = {**record, "k3_ratio": _ratio(record[pair[0]], record[pair[1]])}
                records.append(record)
        for ax, (keys, scale) in zip(axes.flat, panels.values(), strict=True):
            for dashed, key in enumerate(keys):
                steps = sorted({r["step"] for r in records if key in r})
                stats = []  # (median, min, max) over the seeds, per step
                for step in steps:
                    values = [scale * r[key] for r in records if r["step"] == step and key in r]
                    stats.append(spread(values))
                # one sequence per line of the plot: medians, lows, highs
                med, low, high = zip(*stats, strict=True) if stats else [(), (), ()]
                label = f"{name} {key.rsplit('_', 1)[1]}" if len(keys) > 1 else name
                style = {"ls": "--", "marker": "x"} if dashed else {"ls": "-", "marker": "."}
                ax.plot(steps, med, color=color, label=label, **style)
                if len(histories) > 1:
                    ax.fill_between(steps, low, high, color=color, alpha=0.15, lw=0)
    for ax, title in zip(axes.flat, titles, strict=True):
        ax.set(title=title, xlabel="RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0, 2].set_yscale("log")
    axes[1, 0].axhline(1.0, color="grey", lw=0.8)
    for ax in (axes[1, 0], axes[1, 1]):
        ax.set_ylim(bottom=0)
    suptitle = f"SIMULATED engine disagreement {share} (rollout.server.{SIMULATED})" if share else ""
    fig.suptitle(suptitle)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [suptitle, *titles]
