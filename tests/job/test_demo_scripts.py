"""scripts/check_conditioning.py decides on the right figures; scripts/demo_tables.py prints each
experiment's summary with its environment line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run(k3_replayed: list[float], rewards: list[float]):
    return [
        {"step": float(i), "reward": r, "mismatch/k3_replayed": k, "mismatch/k3_native": 2 * k}
        for i, (k, r) in enumerate(zip(k3_replayed, rewards, strict=True))
    ]


def test_conditioning_check_fails_on_any_spike_or_a_low_median_reward():
    check = _script("check_conditioning").check
    good = [1e-4, 2e-4, 5e-5, 1e-4]
    runs = {f"replay=r3/seed={s}": _run(good, [0.5, 0.8, 0.95, 0.95]) for s in range(3)}
    runs |= {f"replay=off/seed={s}": _run(good, [0.5, 0.9, 0.9, 0.9]) for s in range(3)}
    lines, ok = check(runs, 1e-3, 0.9)
    assert ok, lines
    assert lines[1].split() == ["replay=r3/seed=0", "2.00e-04", "(1)", "4.00e-04", "(1)", "0.900"]
    assert "largest k3_replayed of any step: 2.00e-04 (limit 0.001)" in lines
    # one step of one seed above the limit fails the check
    spiked = dict(runs, **{"replay=off/seed=2": _run([1e-4, 1.2e-3, 1e-4, 1e-4], [0.5, 0.9, 0.9, 0.9])})
    lines, ok = check(spiked, 1e-3, 0.9)
    assert not ok and "largest k3_replayed of any step: 1.20e-03 (limit 0.001)" in lines
    # the median over seeds of the reward end (mean of the last 3 steps) must reach the limit:
    # seeds end at 0.9, 0.85, 0.95 -> median 0.9 passes; 0.9, 0.85, 0.85 -> 0.85 fails
    ends = {0: 0.9, 1: 0.85, 2: 0.95}
    runs = {f"replay=r3/seed={s}": _run(good, [0.5, e, e, e]) for s, e in ends.items()}
    assert check(runs, 1e-3, 0.9)[1]
    runs["replay=r3/seed=2"] = _run(good, [0.5, 0.85, 0.85, 0.85])
    lines, ok = check(runs, 1e-3, 0.9)
    assert not ok and any(line.startswith("replay=r3: median reward end 0.850") for line in lines)


def test_demo_tables_prints_each_summary_with_its_environment_line(tmp_path, capsys):
    tables = _script("demo_tables")
    assert tables.plot_name("compare") == "demo_metrics.png"
    assert tables.plot_name("compare_realistic") == "demo_metrics_realistic.png"
    for name in ("compare", "compare_realistic"):
        (tmp_path / name).mkdir()
        summary = (
            f"table of {name}\nenvironment: torch X, transformers Y, lightning Z, 2 intra-op threads, CPU W\n"
        )
        (tmp_path / name / "summary.txt").write_text(summary)
        (tmp_path / name / "metrics.png").write_bytes(b"\x89PNG")
    tables.main(
        ["compare", "compare_realistic", "--out", str(tmp_path), "--reuse", "--plots", str(tmp_path / "docs")]
    )
    out = capsys.readouterr().out
    for name in ("compare", "compare_realistic"):
        block = f"### `python -m r3lightning.app.job.main experiment={name}`\n\n```text\ntable of {name}\nenvironment: "
        assert block in out
    assert out.count("2 intra-op threads, CPU W\n```") == 2
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == [
        "demo_metrics.png",
        "demo_metrics_realistic.png",
    ]
