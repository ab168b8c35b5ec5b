"""The FSDP2 example (examples/fsdp_moe) on CPU: 2 processes on gloo, a Hugging Face checkpoint
directory, and a separately started engine reached over HTTP, with weights pushed every step."""

from __future__ import annotations

import os

import pytest
from python_process import run_python

from r3lightning.app.job.report import agreement_keys, read_csv
from r3lightning.app.job.sharded import convert_checkpoint
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig
from r3lightning.app.serve.server import RolloutServer

pytestmark = pytest.mark.slow


def test_fsdp2_two_processes_with_external_engine(tmp_path):
    checkpoint = tmp_path / "tiny-moe"
    build_tiny_moe(seed=0).save_pretrained(checkpoint)
    # meta-device init: each rank reads only its shards of the converted checkpoint
    sharded = convert_checkpoint(checkpoint, tmp_path / "tiny-moe-dcp")
    run_dir = tmp_path / "run"
    with RolloutServer(
        build_tiny_moe(seed=0), engine=EngineConfig(max_batch_size=64, copy_model=False)
    ) as server:
        proc = run_python(
            tmp_path,
            "-m",
            "r3lightning.app.job.main",
            "experiment=fsdp_moe",
            "trainer=cpu_fsdp",
            f"model.path={checkpoint}",
            f"model.sharded_weights={sharded}",
            "rollout=skyrl",
            f"rollout.url={server.url}",
            "steps=2",
            "prompts_per_step=4",
            "task.response_length=4",
            "data.batch_size=16",  # per rank: one update per step, so step 1 measures only the engine mismatch
            "algorithm.optim.lr=0.02",
            "trainer.enable_progress_bar=false",
            f"hydra.run.dir={run_dir}",
            OMP_NUM_THREADS="1",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        weight_version = server.engine.weight_version
    history = read_csv(run_dir / "replay_r3" / "metrics.csv")
    assert [r["step"] for r in history] == [0.0, 1.0]
    # gathered from both ranks' shards: every MoE layer used the engine's experts
    agreements = [r[k] for r in history for k in agreement_keys(r)]
    assert len(agreements) == 6 and all(a == 1.0 for a in agreements)
    # the full (all-gathered) weights reached the engine before each rollout: steps 0 and 1 (none
    # follows the last step), as policy versions 0 and 1 (optimizer steps); step 1 is on-policy
    # again (bf16-sized mismatch)
    assert weight_version == 1
    assert history[1]["k3_kl"] < 1e-3
    assert (run_dir / "replay_r3" / "checkpoints" / "last.ckpt").exists()
    # the distributed checkpoint (a folder) is checked before a resume like a single file is
    from r3lightning.app.job.build import JobError
    from r3lightning.app.job.checkpoint import resume_checkpoint
    from r3lightning.app.job.main import compose_config
    from r3lightning.app.job.module import GRPOModule

    module = GRPOModule(build_tiny_moe(seed=0))
    last = run_dir / "replay_r3" / "checkpoints" / "last.ckpt"
    assert last.is_dir()
    # saved atomically: a link to the current folder, the previous step's folder deleted
    assert last.is_symlink()
    assert sorted(p.name for p in last.parent.iterdir()) == [os.readlink(last), "last.ckpt"]
    assert resume_checkpoint(compose_config(["steps=3"]), run_dir / "replay_r3", module) == str(last)
    with pytest.raises(JobError, match=r"^steps=1 is below the 2 steps this run has done"):
        resume_checkpoint(compose_config(["steps=1"]), run_dir / "replay_r3", module)
    (last / ".metadata").unlink()
    with pytest.raises(JobError, match=rf"^checkpoint {last} cannot be read \("):
        resume_checkpoint(compose_config(["steps=3"]), run_dir / "replay_r3", module)
