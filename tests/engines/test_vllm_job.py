"""``rollout=vllm_local``: the job starts a real vLLM engine on its model, trains from its routes,
and stops it when interrupted (Ctrl-C) -- no engine process and no served model directory left;
an engine that cannot start is one line saying what to do."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_procs import group_members, wait_gone
from omegaconf import OmegaConf
from python_process import REPO, run_python

from r3lightning.app.job.common import JobError
from r3lightning.app.job.rollout_settings import launch_settings
from r3lightning.app.models.tiny import tiny_moe_config
from r3lightning.app.vllm import VLLM_HEAD_DIM, tiny_vllm_moe_config

JOB = ["-m", "r3lightning.app.job.main", "rollout=vllm_local", "model=tiny_qwen3_moe_vllm"]
JOB += ["prompts_per_step=2", "plot=false", "trainer.enable_progress_bar=false"]


def engines_under(directory: Path) -> list[int]:
    """Process groups of the engines serving a model from ``directory`` (their command lines name it)."""
    groups = set()
    for entry in os.listdir("/proc"):
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"cli_shim.py") for a in args) and str(directory).encode() in b" ".join(args):
            groups.add(os.getpgid(int(entry)))
    return sorted(groups)


def metrics_rows(run_dir: Path) -> list[dict]:
    paths = list(run_dir.glob("*/metrics.csv"))
    if not paths:
        return []
    with paths[0].open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.vllm
def test_the_job_trains_from_a_launched_engine_and_stops_it_on_ctrl_c(vllm_engine_python, tmp_path):
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TMPDIR": str(tmp_path),
        "R3_VLLM_PYTHON": str(vllm_engine_python),
    }
    job = subprocess.Popen(
        [sys.executable, *JOB, "steps=1000", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 900
        while len(metrics_rows(run_dir)) < 2 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        assert job.poll() is None, job.stderr.read()[-3000:]
        rows = metrics_rows(run_dir)
        assert len(rows) >= 2  # two steps trained from the engine's rollouts
        # the engine's routes were installed: the trainer used the engine's experts on every slot
        assert all(float(rows[0][f"used_agreement/layer_0{layer}"]) == 1.0 for layer in (1, 2, 3))
        assert float(rows[0]["engine_errors"]) == 0
        (group,) = engines_under(tmp_path)
        members = group_members(group)
        assert members
        job.send_signal(signal.SIGINT)
        assert job.wait(timeout=120) == 130
        assert "interrupted" in job.stderr.read()
    finally:
        job.kill()
        job.wait()
    assert wait_gone(members) == []
    assert engines_under(tmp_path) == []
    assert not list(tmp_path.glob("r3-vllm-model-*"))  # the served model's directory is removed


def test_an_engine_that_cannot_start_is_one_line_saying_make_vllm(tmp_path):
    run = run_python(
        tmp_path,
        *JOB,
        "steps=1",
        f"rollout.launch.python={tmp_path / 'no-python'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert run.returncode != 0
    (line,) = [line for line in run.stderr.splitlines() if "rollout.launch" in line]
    assert "does not exist; run `make vllm`" in line


@pytest.mark.parametrize(
    "launch, expected",
    [
        ({"dtype": "fp8"}, "rollout.launch.dtype must be one of"),
        ({"model": "/m"}, "rollout.launch.model is set by the job"),
        ({"process": {"threads": 0}}, "rollout.launch.process.threads must be"),
        ({"serve": {"extra_args": "--x"}}, "rollout.launch.serve.extra_args must be a list"),
        ({"serve": {"eagre": True}}, "rollout.launch.serve.eagre is not a setting here"),
        ({"colour": 1}, "rollout.launch.colour is not a setting here"),
    ],
)
def test_bad_launch_settings_are_one_line_naming_the_key(launch, expected):
    rollout = OmegaConf.create({"launch": launch})
    with pytest.raises(JobError, match=re.escape(expected)):
        launch_settings(rollout, model="/served")


def test_launch_settings_reach_the_engine_as_given():
    launch = {"dtype": "float32", "process": {"threads": 2}, "serve": {"extra_args": ["--max-num-seqs", "4"]}}
    settings = launch_settings(OmegaConf.create({"launch": launch}), model="/served")
    assert (settings.model, settings.dtype, settings.process.threads) == ("/served", "float32", 2)
    assert settings.serve.extra_args == ("--max-num-seqs", "4")


def test_the_vllm_model_option_is_the_vllm_variant_of_the_tiny_model():
    option = OmegaConf.load(REPO / "conf/model/tiny_qwen3_moe_vllm.yaml")
    assert option.overrides == {"head_dim": VLLM_HEAD_DIM}
    assert tiny_vllm_moe_config().head_dim == VLLM_HEAD_DIM != tiny_moe_config().head_dim
