"""The job's outputs over seeds: medians and ranges, the environment line, the simulation label,
and the constraints file the Makefile installs from."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from r3lightning.app.job.report import environment, environment_line, format_table, plot_runs, spread

REPO = Path(__file__).resolve().parents[2]


def _seed(k3_native: float, k3_replayed: float, reward: float, sim: float | None = None):
    """A 2-step history: the paired mismatch on step 0, the same reward on both steps."""
    label = {} if sim is None else {"simulated_disagreement": sim}
    first = {"mismatch/k3_native": k3_native, "mismatch/k3_replayed": k3_replayed}
    return [{"step": 0.0, **label, "reward": reward, **first}, {"step": 1.0, **label, "reward": reward}]


def _row(lines: list[str], name: str) -> list[str]:
    """The cells of the row starting with ``name`` (cells are separated by two spaces or more)."""
    line = next(line for line in lines if line.startswith(name))
    return re.split(r"\s{2,}", line.strip())


def test_spread_is_median_min_max_without_nans():
    assert spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert spread([4.0, 1.0, float("nan"), 2.0, 3.0]) == (2.5, 1.0, 4.0)  # even count: mean of the middle two
    assert all(v != v for v in spread([float("nan")]))


def test_table_shows_median_and_range_over_seeds_and_every_seeds_step0_ratio():
    # arm a: per-seed ratios 40, 2, 5 -> median 5 (the ratio of the medians would be 3e-3 / 5e-4 = 6)
    a = [(4e-3, 1e-4, 0.9), (1e-3, 5e-4, 0.5), (3e-3, 6e-4, 1.0)]
    b = [(2e-3, 1e-3, 0.5), (2e-3, 5e-4, 0.8)]  # two seeds: the median is the mean of both
    runs = {f"a/seed={i}": _seed(*v) for i, v in enumerate(a)}
    runs |= {f"b/seed={i + 7}": _seed(*v) for i, v in enumerate(b)}
    lines = format_table(runs).splitlines()
    assert lines[0] == "median over seeds per arm; the row under each arm: [min, max] over its seeds"
    header = _row(lines, "run")
    assert header[:7] == [
        "run",
        "steps",
        "reward start->end",
        "native agreement",
        "k3 native",
        "k3 replayed",
        "native/replayed",
    ]
    at = next(i for i, line in enumerate(lines) if line.startswith("a "))
    med, rng = _row(lines, "a "), lines[at + 1]
    assert med[:7] == ["a", "2", "0.900 -> 0.900", "n/a", "3.00e-03", "5.00e-04", "5.0x"]
    assert re.split(r"\s{2,}", rng.strip())[:7] == [
        "[min, max] of 3",
        "[2, 2]",
        "[0.500, 1.000] -> [0.500, 1.000]",
        "[n/a, n/a]",
        "[1.00e-03, 4.00e-03]",
        "[1.00e-04, 6.00e-04]",
        "[2.0x, 40.0x]",
    ]
    assert _row(lines, "b ")[2:7] == ["0.650 -> 0.650", "n/a", "2.00e-03", "7.50e-04", "3.0x"]  # ratios 2, 4
    # step 0: one row per seed, with its own paired ratio
    step0 = lines[lines.index("step 0 (same weights and rollouts in every arm):") :]
    ratios = {name: _row(step0, name)[3] for name in [*runs]}
    assert ratios == {
        "a/seed=0": "40.0x",
        "a/seed=1": "2.0x",
        "a/seed=2": "5.0x",
        "b/seed=7": "2.0x",
        "b/seed=8": "4.0x",
    }
    # one seed per arm: no range rows and no seed note (the table reads as before)
    single = format_table({"a": _seed(*a[0])}).splitlines()
    assert single[0].startswith("run") and not any("[min, max]" in line for line in single)


def test_multiturn_runs_add_turns_per_turn_route_bytes_and_used_agreement_columns():
    def history(turns_end: float, turn2: float, agreement: float):
        steps = [{"step": float(s), "reward": 1.0, "turns": 1.0 + s / 3} for s in range(6)]
        for record in steps:  # turn 2 reward only on the last steps; route bytes on every step
            record |= {"route_bytes/turn_1": 72.0, "route_bytes/turn_2": 48.0, "turn_reward/turn_2": turn2}
            record |= {"used_agreement/layer_01": agreement, "used_agreement/layer_02": agreement}
        steps[-1]["turns"] = turns_end
        return steps

    runs = {"r3/seed=0": history(2.0, 0.5, 1.0), "r3/seed=1": history(3.0, 0.9, 0.8)}
    lines = format_table(runs).splitlines()
    header = _row(lines, "run")
    assert header[-4:] == ["turns end", "turn 2 reward end", "route B turn 1->2", "used agreement"]
    # turns end: mean of the last 3 steps (2 + 7/3 + end) / 3 per seed, then the median of both
    ends = [(2.0 + 7 / 3 + end) / 3 for end in (2.0, 3.0)]
    assert _row(lines, "r3 ")[-4:] == [f"{sum(ends) / 2:.2f}", "0.700", "72 -> 48", "90.00%"]
    assert any(line.startswith("turns end, turn 2 reward end") for line in lines)
    # a single-turn run (no turn 2 anywhere) keeps the table without those columns
    single = format_table({"a": _seed(1e-3, 1e-4, 0.5)}).splitlines()
    assert "turns end" not in _row(single, "run")


def test_environment_line_names_versions_threads_and_cpu():
    import lightning
    import transformers

    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        env = environment()
    finally:
        torch.set_num_threads(threads)
    cpu = [
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    ]
    assert env == {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lightning": lightning.__version__,
        "threads": "3",
        "cpu": cpu[0],
        "capability": torch.backends.cpu.get_cpu_capability(),  # what decides the float results
    }
    assert env["capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256", "NO AVX")
    assert environment_line(env) == (
        f"environment: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"lightning {lightning.__version__}, 3 intra-op threads, CPU {cpu[0]}, "
        f"torch CPU capability {env['capability']}"
    )
    assert format_table({"a": _seed(1e-3, 1e-4, 0.5)}, env=env).splitlines()[-1] == environment_line(env)


def test_simulated_disagreement_labels_the_summary_and_every_plot_title(tmp_path):
    sim = {"replay=r3": _seed(1e-3, 1e-4, 0.5, sim=0.1), "replay=off": _seed(1e-3, 1e-4, 0.5, sim=0.1)}
    text = format_table(sim)
    assert (
        text.splitlines()[0]
        == "SIMULATED engine disagreement: 10% of expert slots (rollout.server.simulated_disagreement)"
    )
    titles = plot_runs(tmp_path / "sim.png", sim)
    assert titles[0] == "SIMULATED engine disagreement 10% (rollout.server.simulated_disagreement)"
    assert len(titles) == 7 and all(t.endswith(", simulated 10%") for t in titles[1:])
    assert (tmp_path / "sim.png").read_bytes()[:4] == b"\x89PNG"
    plain = {"replay=r3": _seed(1e-3, 1e-4, 0.5)}
    assert "SIMULATED" not in format_table(plain) and "simulated" not in "".join(
        plot_runs(tmp_path / "p.png", plain)
    )
    seeds = {f"replay=r3/seed={i}": _seed(1e-3, 1e-4, 0.5 + 0.1 * i) for i in range(3)}
    assert plot_runs(tmp_path / "band.png", seeds)[1] == "mean reward"


def test_makefile_installs_from_the_constraints_file(tmp_path):
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")  # exact pins only
            pins[name.lower()] = version
    assert pins["torch"] == "2.13.0"
    for name in ("transformers", "lightning", "megatron-core", "numpy", "hydra-core"):
        assert pins[name] == importlib.metadata.version(name), name  # what the README's tables came from
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry = subprocess.run(
        ["make", "-n", "setup", f"VENV={tmp_path / 'venv'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installs = [line for line in dry.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert len(installs) == 2 and all("-c constraints.txt" in line for line in installs)


def test_runs_against_a_real_engine_add_the_logprob_columns_and_say_so():
    """Runs labelled ``vllm_engine`` get a heading and the mean |dlogp| columns (native, replayed:
    the means of their steps); other runs keep the table they had."""
    paired = {"mismatch/abs_logprob_diff_native": 0.02, "mismatch/abs_logprob_diff_replayed": 0.004}
    real = [{**r, "vllm_engine": 1.0, **paired} for r in _seed(1e-3, 1e-4, 0.5)]
    lines = format_table({"r3": real}).splitlines()
    assert lines[0].startswith("REAL ENGINE: vLLM serves the rollouts")
    header = _row(lines, "run")
    assert header[-2:] == ["|dlogp| native", "replayed"]
    assert _row(lines, "r3 ")[-2:] == ["0.0200", "0.0040"]
    plain = format_table({"r3": _seed(1e-3, 1e-4, 0.5)})
    assert "|dlogp|" not in plain and "REAL ENGINE" not in plain
