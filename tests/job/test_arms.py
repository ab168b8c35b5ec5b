"""The job's arms (``compare``: replay modes or ``{name, replay, overrides}``) and seeds."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from r3lightning.app.job.common import JobError
from r3lightning.app.job.main import arms, compose_config, run, run_seeds
from r3lightning.app.job.report import read_csv

QUIET = ["trainer.enable_progress_bar=false", "plot=false"]


def _with_arms(entries, *overrides):
    cfg = compose_config(list(overrides))
    cfg.compare = entries
    return cfg


def test_modes_and_mappings_become_named_arm_configs():
    assert list(arms(compose_config())) == ["replay=r3"]  # no compare: one arm, the replay group's
    assert list(arms(compose_config(["replay=off"]))) == ["replay=off"]
    compare = arms(compose_config(["experiment=compare"]))
    assert list(compare) == ["replay=r3", "replay=off"]
    assert [c.replay.mode for c in compare.values()] == ["r3", "off"]
    cfg = _with_arms(
        [
            "r3",
            {
                "name": "off+lr",
                "replay": "off",
                "overrides": {"algorithm.optim.lr": 1e-3, "rollout.server": {"port": 0}},
            },
            {"name": "same-replay", "overrides": {"algorithm": {"clip_low": 0.1}}},
        ]
    )
    out = arms(cfg)
    assert list(out) == ["replay=r3", "off+lr", "same-replay"]
    assert out["off+lr"].replay.mode == "off" and out["off+lr"].algorithm.optim.lr == 1e-3
    assert out["replay=r3"].algorithm.optim.lr == cfg.algorithm.optim.lr == 5e-3  # others untouched
    assert out["same-replay"].replay.mode == "r3" and out["same-replay"].algorithm.clip_low == 0.1
    assert out["same-replay"].algorithm.clip_high == cfg.algorithm.clip_high  # a mapping merges
    assert all(list(c.compare) == [] for c in out.values())
    # the command-line form, dotted keys included
    cli = compose_config(["compare=[r3,{name:lr,replay:off,overrides:{algorithm.optim.lr:0.001}}]"])
    assert {n: (c.replay.mode, c.algorithm.optim.lr) for n, c in arms(cli).items()} == {
        "replay=r3": ("r3", 5e-3),
        "lr": ("off", 1e-3),
    }


@pytest.mark.parametrize(
    "entries,message",
    [
        (["r3", "r5"], r"compare\[1\]\.replay must be one of \['r3', 'r2', 'off'\], got 'r5'"),
        (
            [{"name": "a", "replays": "r3"}],
            r"compare\[0\]: unknown keys \['replays'\]; an arm has name, replay",
        ),
        (["r3", {"replay": "r3"}], r"compare\[1\]\.name 'replay=r3' is used twice"),
        ([{"name": "a/b"}], r"compare\[0\]\.name 'a/b' may hold only letters, digits and _\.\+=,-"),
        (
            [{"name": "a", "overrides": ["x"]}],
            r"compare\[0\]\.overrides must map dotted config keys to values",
        ),
        (
            [{"name": "a", "overrides": {"algorithm.optim.rl": 1}}],
            r"compare\[0\]\.overrides: 'algorithm\.optim\.rl' is not a key of the config",
        ),
        (
            ["off", {"name": "bad-lr", "overrides": {"algorithm.optim.lr": -1}}],
            r"compare\[1\] \(bad-lr\): algorithm\.optim\.lr must be a number >= 0, got -1\.0$",
        ),
        (
            ["off", {"name": "p", "overrides": {"plot": 1}}],
            r"compare\[1\] \(p\): plot must be true or false, got 1$",
        ),
        (
            [{"name": "copy", "overrides": {"rollout": {"server": {"copy_model": "yes"}}}}],
            r"compare\[0\] \(copy\): rollout\.server\.copy_model must be true or false, got 'yes'$",
        ),
    ],
)
def test_bad_arms_are_refused_naming_the_entry(entries, message):
    with pytest.raises(JobError, match=message):
        arms(_with_arms(entries))


def test_seeds_count_from_seed():
    assert run_seeds(compose_config()) == [0]
    assert run_seeds(compose_config(["seed=5", "seeds=3"])) == [5, 6, 7]
    assert run_seeds(compose_config(["experiment=compare"])) == [0, 1, 2]
    with pytest.raises(JobError, match=r"^seeds must be an integer >= 1 and <= 4294967296, got 0$"):
        run_seeds(compose_config(["seeds=0"]))
    # seed + seeds - 1 stays in Lightning's seed range
    with pytest.raises(JobError, match=r"^seeds must be an integer >= 1 and <= 6, got 7$"):
        run_seeds(compose_config(["seed=4294967290", "seeds=7"]))
    for bad in ("two", "true"):  # not an integer: Hydra's structured config refuses it
        with pytest.raises(ConfigCompositionException):
            compose_config([f"seeds={bad}"])


@pytest.mark.slow
def test_every_arm_runs_every_seed_with_its_overrides(tmp_path):
    """Two arms x two seeds, one step each: folders, names, the override's effect (an arm with a
    simulated disagreement gets its own engine and its label column), and seed s of a multi-seed
    run equals a single run with seed=s."""
    base = ["steps=1", "prompts_per_step=2", "algorithm.group_size=2", *QUIET]
    cfg = _with_arms(
        [
            "r3",
            {"name": "off+sim", "replay": "off", "overrides": {"rollout.server.simulated_disagreement": 0.1}},
        ],
        *base,
        "seeds=2",
    )
    runs = run(cfg, tmp_path / "multi")
    assert list(runs) == ["replay=r3/seed=0", "off+sim/seed=0", "replay=r3/seed=1", "off+sim/seed=1"]
    for name, history in runs.items():
        folder = tmp_path / "multi" / name.replace("=", "_")
        assert read_csv(folder / "metrics.csv") == history and len(history) == 1
        assert ("simulated_disagreement" in history[0]) == name.startswith("off+sim")
    assert runs["off+sim/seed=0"][0]["simulated_disagreement"] == 0.1
    sim, plain = runs["off+sim/seed=0"][0], runs["replay=r3/seed=0"][0]
    assert sim["mismatch/native_agreement"] < plain["mismatch/native_agreement"] - 0.03  # its own engine
    assert runs["replay=r3/seed=0"][0]["reward"] != runs["replay=r3/seed=1"][0]["reward"]
    single = run(compose_config([*base, "seed=1"]), tmp_path / "single")["replay=r3"]
    # every column but the wall-clock ones (rollout_s, train_s, the waits, step_s)
    assert [{k: v for k, v in r.items() if not k.endswith("_s")} for r in single] == [
        {k: v for k, v in r.items() if not k.endswith("_s")} for r in runs["replay=r3/seed=1"]
    ]
    summary = (tmp_path / "multi" / "summary.txt").read_text()
    assert "SIMULATED engine disagreement: 10% of expert slots" in summary.splitlines()[0]
    assert "  [min, max] of 2" in summary
    assert OmegaConf.load(tmp_path / "multi" / "config.yaml").seeds == 2


def test_a_config_dir_option_reaches_the_checks(tmp_path, capsys):
    """--config-dir DIR: Hydra composes DIR's options, and the job checks them before it writes."""
    from job_cli import train_cli

    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "sometimes.yaml").write_text("mode: r4\nrequest_routes: true\n")
    with pytest.raises(SystemExit) as info:
        train_cli("--config-dir", str(tmp_path), "replay=sometimes", f"hydra.run.dir={tmp_path / 'run'}")
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "r3lightning-train: error: replay.mode must be one of ['r3', 'r2', 'off'], got 'r4'\n"
    )
    assert not (tmp_path / "run").exists()
