"""A kill at any point of an FSDP2 folder checkpoint's save leaves the old or the new checkpoint whole
and resumable, and the next save leaves nothing else behind.

Two gloo ranks save through the job's `RunCheckpoint` (tests/support/folder_saves.py); rank 0 pauses
at one point of the second save and every process of the run is killed with SIGKILL there. The
weights move by exactly one per step, so the values name the step a checkpoint holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from folder_saves import SHAPE, START, Weights
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from omegaconf import OmegaConf
from python_process import REPO
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from r3lightning.app.job.checkpoint import (
    publish_folder,
    remove_stale_temps,
    resume_checkpoint,
    saves_a_folder,
)

# phase of the second save at which the kill comes -> the step the surviving checkpoint holds
KILLS = {
    "half_written": 1,  # the new folder's files are half written
    "before_meta": 1,  # every shard is written, Lightning's meta.pt is not
    "before_link": 1,  # the new folder is whole, last.ckpt still names the old one
    "after_link": 2,  # last.ckpt names the new folder, the old one is still there
    "removing_old": 2,  # the old folder is partly deleted
}


def _run(epochs: int, phase: str, *run_dirs: Path, log: Path) -> subprocess.Popen:
    support = REPO / "tests" / "support"
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import folder_saves; folder_saves.main()",
            str(epochs),
            phase,
            *map(str, run_dirs),
        ],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{support}", "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # its own process group: the kill reaches every rank
    )


def _kill_when_paused(proc: subprocess.Popen, log: Path) -> None:
    try:
        for line in proc.stdout:
            if line == "paused\n":
                os.killpg(proc.pid, signal.SIGKILL)
                break
        else:
            raise AssertionError(f"the run ended without pausing:\n{log.read_text()[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # every rank, also if the test failed
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


class _Model(nn.Module):
    """The unsharded twin of the run's module, for `resume_checkpoint`'s shape check."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Weights()


def _config(steps: int):
    return OmegaConf.create({"resume": True, "steps": steps})


def _saved_step(checkpoint: Path, scratch: Path) -> int:
    """The step ``checkpoint`` holds: Lightning's ``meta.pt`` and the weights agree on it."""
    step = torch.load(checkpoint / "meta.pt", weights_only=False)["global_step"]
    dcp_to_torch_save(checkpoint, scratch)  # reads every rank's shards
    weight = torch.load(scratch, weights_only=True)["state_dict"]["inner.weight"]
    assert torch.equal(weight, torch.full(SHAPE, START - step))
    return step


def _entries(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_kill_at_any_point_of_a_folder_save_leaves_a_whole_resumable_checkpoint(tmp_path):
    run_dirs = {phase: tmp_path / phase for phase in KILLS}
    for phase, run_dir in run_dirs.items():
        run_dir.mkdir()
        _kill_when_paused(_run(2, phase, run_dir, log=tmp_path / f"{phase}.log"), tmp_path / f"{phase}.log")
    for phase, step in KILLS.items():
        last = run_dirs[phase] / "checkpoints" / "last.ckpt"
        # the job's resume check reads it (and deletes what the kill left)
        assert resume_checkpoint(_config(3), run_dirs[phase], _Model()) == str(last), phase
        assert _saved_step(last, tmp_path / f"{phase}.pt") == step, phase
        assert _entries(run_dirs[phase]) == [os.readlink(last), "last.ckpt"], phase
    # every one resumes through Lightning from the step it holds; its next save leaves only itself
    log = tmp_path / "resume.log"
    resumed = _run(3, "none", *run_dirs.values(), log=log)
    resumed.stdout.read()
    assert resumed.wait(timeout=600) == 0, log.read_text()[-3000:]
    for phase, step in KILLS.items():
        started = json.loads((run_dirs[phase] / "started.json").read_text())
        assert started == {"value": [START - step], "global_step": step}, phase
        last = run_dirs[phase] / "checkpoints" / "last.ckpt"
        assert _saved_step(last, tmp_path / f"{phase}.pt") == 3, phase
        assert _entries(run_dirs[phase]) == [os.readlink(last), "last.ckpt"], phase


def _folder(path: Path, value: str) -> Path:
    path.mkdir()
    (path / "meta.pt").write_text(value)
    return path


def test_publishing_repoints_the_link_and_deletes_the_replaced_and_stale_folders(tmp_path):
    last = tmp_path / "last.ckpt"
    publish_folder(last, _folder(tmp_path / ".last.ckpt.v-1", "one"))
    assert os.readlink(last) == ".last.ckpt.v-1"
    _folder(tmp_path / ".last.ckpt.v-half", "half")  # a save a kill interrupted
    (tmp_path / ".last.ckpt.tmp-99").symlink_to(".last.ckpt.v-half")  # a link a kill left
    publish_folder(last, _folder(tmp_path / ".last.ckpt.v-2", "two"))
    assert (last / "meta.pt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.ckpt.v-2", "last.ckpt"]


def test_a_folder_saved_before_links_is_replaced_and_a_kill_in_between_keeps_it(tmp_path):
    last = _folder(tmp_path / "last.ckpt", "real folder")
    publish_folder(last, _folder(tmp_path / ".last.ckpt.v-1", "one"))
    assert last.is_symlink() and (last / "meta.pt").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.ckpt.v-1", "last.ckpt"]
    # killed after the real folder was moved aside, before the link: the next start links it back
    last.unlink()
    _folder(tmp_path / ".last.ckpt.v-moved", "real folder")
    remove_stale_temps(tmp_path)
    assert (last / "meta.pt").read_text() == "real folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.ckpt.v-moved", "last.ckpt"]
    # without a link, no folder is the checkpoint: they are what killed first saves left
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _folder(fresh / ".last.ckpt.v-1", "half")
    remove_stale_temps(fresh)
    assert list(fresh.iterdir()) == []


def test_only_strategies_that_save_folders_get_the_folder_swap():
    assert saves_a_folder(ModelParallelStrategy())
    assert not saves_a_folder(ModelParallelStrategy(save_distributed_checkpoint=False))
    assert not saves_a_folder(DDPStrategy())
