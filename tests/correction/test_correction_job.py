"""``algorithm.correction`` in the job: key-naming errors, the CSV and summary columns, and the
four arms of ``experiment=compare_corrections``."""

from __future__ import annotations

import pytest
from job_cli import train_cli

from r3lightning.app.job.main import arms, compose_config, run
from r3lightning.app.job.report import read_csv


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "algorithm.correction.mode=tis",
            "algorithm.correction.mode must be one of ['none', 'token_tis', 'sequence_tis', "
            "'geometric_mask', 'token_mask'], got 'tis'",
        ),
        ("algorithm.correction.threshold=0", "algorithm.correction.threshold must be a number >= 1"),
        ("algorithm.correction.threshold=x", "algorithm.correction.threshold must be a number, got 'x'"),
        (
            "algorithm.correction.lower=3",
            "algorithm.correction.lower and upper must satisfy 0 <= lower <= 1 <= upper",
        ),
        ("+algorithm.correction.cap=1", "algorithm.correction.cap is not a setting here; expected one of"),
        ("algorithm.correction=null", "algorithm.correction must not be null"),
        (
            "algorithm.correction.steps=[{kind: token_tis, cap: 0.8}]",
            "algorithm.correction.steps[0].cap must be a number >= 1",
        ),
        (
            "algorithm.correction.steps=[{kind: veto, floor: 0.1, cap: 2}]",
            "algorithm.correction.steps[0].cap is not a setting of a veto step; it takes ['floor']",
        ),
        (
            "algorithm.correction.steps=[{kind: token_mask, lower: 0.9, upper: 0.9}]",
            "algorithm.correction.steps[0].lower and upper must satisfy 0 <= lower <= 1 <= upper",
        ),
    ],
)
def test_bad_correction_settings_are_one_line_naming_the_key(override, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train_cli(override, f"hydra.run.dir={tmp_path / 'run'}")
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_compare_corrections_runs_four_arms_at_the_simulated_disagreement():
    cfg = compose_config(["experiment=compare_corrections"])
    assert cfg.rollout.server.simulated_disagreement == 0.1 and cfg.seeds == 3
    got = {name: (c.replay.mode, c.algorithm.correction.mode) for name, c in arms(cfg).items()}
    assert got == {
        "replay=off": ("off", "none"),
        "off+token_tis": ("off", "token_tis"),
        "replay=r3": ("r3", "none"),
        "r3+token_tis": ("r3", "token_tis"),
    }
    assert compose_config().algorithm.correction.mode == "none"  # off by default


@pytest.mark.slow
def test_correction_metrics_reach_metrics_csv_and_the_summary(tmp_path):
    overrides = [
        "experiment=compare_corrections",
        "seeds=1",
        "steps=2",
        "prompts_per_step=2",
        "algorithm.correction.threshold=1.05",
        "plot=false",
        "trainer.enable_progress_bar=false",
    ]
    runs = run(compose_config(overrides), tmp_path)
    assert list(runs) == ["replay=off", "off+token_tis", "replay=r3", "r3+token_tis"]
    rows = read_csv(tmp_path / "r3+token_tis" / "metrics.csv")
    assert len(rows) == 2 and rows == runs["r3+token_tis"]
    for row in rows:
        assert 0 < row["correction/ess"] <= 1 and row["correction/weight_max"] <= 1.05 + 1e-6
        assert 0 <= row["correction/truncated_fraction"] <= 1 and row["correction/masked_fraction"] == 0
        assert row["correction/loss_tokens"] > 0 and row["simulated_disagreement"] == 0.1
    assert not any(k.startswith("correction/") for k in runs["replay=r3"][0])  # none: nothing applied
    summary = (tmp_path / "summary.txt").read_text()
    header = next(line for line in summary.splitlines() if line.startswith("run "))
    assert "IS ESS" in header and "truncated" in header
    off_row = next(line for line in summary.splitlines() if line.startswith("replay=off "))
    assert off_row.split()[-3:] == ["n/a", "n/a", "n/a"]
