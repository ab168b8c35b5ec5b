"""The job keeps a launched vLLM on-policy: with an fp32 engine and replay off, the trainer's native
routes agree with the engine's after every step's weight sync, and every trajectory of the last
step carries the policy version it was generated with (in the checkpoint's buffer)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch
from python_process import REPO

pytestmark = pytest.mark.vllm


def test_every_step_samples_from_the_synced_weights(vllm_engine_python, tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "r3lightning.app.job.main", "rollout=vllm_local"]
    command += ["model=tiny_qwen3_moe_vllm", "rollout.launch.dtype=float32", "replay=off", "steps=3"]
    command += [
        "prompts_per_step=4",
        "plot=false",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "R3_VLLM_PYTHON": str(vllm_engine_python),
        "TMPDIR": str(tmp_path),
    }
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (metrics,) = run_dir.glob("*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    assert [float(r["vllm_engine"]) for r in rows] == [1.0, 1.0, 1.0]
    # an engine a step behind would route by the old weights: the default lr moves ~10% of slots a step
    for step, row in enumerate(rows):
        assert float(row["mismatch/native_agreement"]) >= 0.995, (
            f"step {step}: {row['mismatch/native_agreement']}"
        )
        assert float(row["mismatch/k3_native"]) < 1e-5, f"step {step}: {row['mismatch/k3_native']}"
    (checkpoint,) = run_dir.glob("*/checkpoints/last.ckpt")
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    buffer = next(v["buffer"] for v in state.values() if isinstance(v, dict) and "buffer" in v)
    versions = buffer["trajectories"]["weight_versions"]
    assert versions.tolist() == [state["global_step"] - 1] * len(versions)  # collected before the last step
