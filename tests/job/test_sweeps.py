"""``r3lightning-train -m`` through Hydra's sweeper and launchers: the basic launcher runs the jobs
in this process one after the other, the joblib launcher in worker processes at once."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf
from python_process import REPO, run_python

pytestmark = pytest.mark.slow
TINY = [
    "steps=1",
    "prompts_per_step=1",
    "algorithm.group_size=2",
    "task.response_length=2",
    "plot=false",
    "trainer.enable_progress_bar=false",
    "+callbacks.pid._target_=pid_callback.RecordPid",
    "+callbacks.pid.path=${hydra:runtime.output_dir}/pid",
]


def _sweep(tmp_path, *launcher: str):
    sweep_dir = tmp_path / "sweep"
    proc = run_python(
        tmp_path,
        "-m",
        "r3lightning.app.job.main",
        "-m",
        "seed=0,1",
        *TINY,
        *launcher,
        f"hydra.sweep.dir={sweep_dir}",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests" / "support")]),
        OMP_NUM_THREADS="1",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [sweep_dir / str(number) for number in range(2)]
    for number, job in enumerate(jobs):  # each job trained its own seed into its own folder
        assert (job / "replay_r3" / "metrics.csv").is_file()
        assert OmegaConf.load(job / "config.yaml").seed == number
    launchers = {OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra.launcher._target_ for job in jobs}
    return [int((job / "pid").read_text()) for job in jobs], launchers


def test_the_basic_launcher_runs_the_jobs_one_after_the_other_in_one_process(tmp_path):
    pids, launchers = _sweep(tmp_path)
    assert launchers == {"hydra._internal.core_plugins.basic_launcher.BasicLauncher"}
    assert pids[0] == pids[1]


def test_the_joblib_launcher_runs_the_jobs_in_parallel_processes(tmp_path):
    pids, launchers = _sweep(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert launchers == {"hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"}
    assert pids[0] != pids[1]  # two workers, each its own job
