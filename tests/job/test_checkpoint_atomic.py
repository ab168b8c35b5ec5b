"""A kill at any point of a checkpoint save leaves the old or the new ``last.ckpt`` whole.

A real interpreter saves through :class:`AtomicCheckpointIO`, pauses at one point of the save, and
is killed with SIGKILL there; ``$TMPDIR`` points at another directory, as on clusters where it is
another filesystem and a move from it is a copy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from python_process import REPO

from r3lightning.app.job.checkpoint import AtomicCheckpointIO, RunCheckpoint, resume_checkpoint
from r3lightning.app.job.main import compose_config

_SAVER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from r3lightning.app.job.checkpoint import AtomicCheckpointIO

    target, phase = sys.argv[1], sys.argv[2]
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1, "w": torch.full((4096,), 1.0)}, target)  # the old checkpoint


    def pause():
        print("paused", flush=True)
        time.sleep(600)


    real_save, real_replace = torch.save, os.replace
    if phase == "write":  # half of the new bytes are in the file when the kill comes

        def torch_save(obj, f):
            real_save(obj, f)
            f.flush()
            f.truncate(f.tell() // 2)
            pause()

        torch.save = torch_save
    elif phase == "before_replace":
        os.replace = lambda *args: pause()
    elif phase == "after_replace":

        def replace(*args):
            real_replace(*args)
            pause()

        os.replace = replace
    io.save_checkpoint({"step": 2, "w": torch.full((4096,), 2.0)}, target)
    """
)


@pytest.mark.parametrize(("phase", "step"), [("write", 1), ("before_replace", 1), ("after_replace", 2)])
def test_a_kill_mid_save_leaves_a_whole_checkpoint_and_the_next_save_no_temp_file(tmp_path, phase, step):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    other_tmp = tmp_path / "elsewhere"
    other_tmp.mkdir()
    target = ckpt_dir / "last.ckpt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(other_tmp)}
    with subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(target), phase], stdout=subprocess.PIPE, text=True, env=env
    ) as saver:
        try:
            assert saver.stdout.readline() == "paused\n"
            saver.send_signal(signal.SIGKILL)
        finally:
            saver.kill()
            saver.wait(timeout=60)
    assert saver.returncode == -signal.SIGKILL
    saved = torch.load(target, weights_only=True)  # whole: it loads, with one step's values
    assert saved["step"] == step
    assert torch.equal(saved["w"], torch.full((4096,), float(step)))
    assert list(other_tmp.iterdir()) == []  # nothing was written in $TMPDIR
    leftovers = sorted(p.name for p in ckpt_dir.iterdir() if p != target)
    assert leftovers == ([] if phase == "after_replace" else [f".last.ckpt.tmp-{saver.pid}"])
    # the next start removes what the kill left; so does the next save
    assert resume_checkpoint(compose_config(["resume=false"]), tmp_path, module=None) is None
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt"]
    (ckpt_dir / f".last.ckpt.tmp-{saver.pid}").write_bytes(b"half")
    AtomicCheckpointIO().save_checkpoint({"step": 3}, target)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt"]
    assert torch.load(target, weights_only=True) == {"step": 3}


def test_a_failed_save_removes_its_temp_file_and_keeps_the_old_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, target)
    with pytest.raises(Exception, match=r"pickle|Can.t"):
        AtomicCheckpointIO().save_checkpoint({"step": 2, "bad": lambda: None}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert torch.load(target, weights_only=True) == {"step": 1}
    with pytest.raises(TypeError, match="AtomicCheckpointIO takes no storage_options"):
        AtomicCheckpointIO().save_checkpoint({"step": 2}, target, storage_options={"x": 1})


def test_the_job_checkpoint_saves_through_the_atomic_io_unless_the_user_gave_one(tmp_path):
    import lightning.pytorch as pl
    from lightning.fabric.plugins import TorchCheckpointIO

    class Mine(TorchCheckpointIO):
        pass

    cfg = compose_config([])
    for plugins, expected in (([], AtomicCheckpointIO), ([Mine()], Mine)):
        callback = RunCheckpoint(tmp_path, cfg)
        trainer = pl.Trainer(
            callbacks=[callback], plugins=plugins, logger=False, enable_progress_bar=False, accelerator="cpu"
        )
        callback.setup(trainer, None, "fit")
        assert type(trainer.strategy.checkpoint_io) is expected
