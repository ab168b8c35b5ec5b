"""A 2-rank FSDP2 run (Lightning's ``ModelParallelStrategy`` on gloo) that saves a folder checkpoint
through the job's `RunCheckpoint` once per epoch, and can pause rank 0 at one point of its last
save so that a test kills every rank there.

``python -c "import folder_saves; folder_saves.main()" EPOCHS PHASE RUN_DIR [RUN_DIR ...]``

Every run dir is trained (in turn, in one process group) up to ``EPOCHS`` epochs of one step,
resuming from its ``checkpoints/last.ckpt`` through the job's `resume_checkpoint`; rank 0 writes
``started.json`` (the first step's weight value and global step) into each. With a ``PHASE`` other
than ``none``, rank 0 prints ``paused`` at that point of the last save and sleeps.

The weights move by exactly one per step, whatever the CPU: the loss is the sum of ``ones @ W``,
so every gradient entry is 1 on both ranks (their mean is 1) and SGD with ``lr=1`` subtracts 1.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

START = 10.0  # every weight entry before the first step
SHAPE = (8, 16)
PHASES = ("none", "half_written", "before_meta", "before_link", "after_link", "removing_old")

_armed = False  # True during the last epoch: its save is the one paused


class Weights(nn.Module):
    """One ``(8, 16)`` weight, FSDP2-sharded across the ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full(SHAPE, START))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight  # [1, 8] @ [8, 16] -> [1, 16]


def _module(run_dir: Path, epochs: int):
    import lightning.pytorch as pl
    from torch.distributed.fsdp import fully_shard

    class Steps(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Weights()

        def configure_model(self) -> None:
            fully_shard(self.inner, mesh=self.device_mesh["data_parallel"])

        def on_train_start(self) -> None:
            value = self.inner.weight.full_tensor()  # collective: every rank calls it
            if self.global_rank == 0:
                started = {"value": value.unique().tolist(), "global_step": self.trainer.global_step}
                (run_dir / "started.json").write_text(json.dumps(started))

        def on_train_epoch_start(self) -> None:
            global _armed
            _armed = self.current_epoch == epochs - 1

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.inner(torch.ones(1, SHAPE[0])).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1.0)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(1, 1), batch_size=1)

    return Steps()


def _pause() -> None:
    print("paused", flush=True)
    time.sleep(600)


def _arm(phase: str) -> None:
    """Patch the step of a save that ``phase`` names so that rank 0 pauses there on the last save."""
    import lightning.pytorch.strategies.model_parallel as model_parallel

    real_dcp_save = model_parallel._distributed_checkpoint_save
    real_replace = os.replace
    real_rmtree = shutil.rmtree

    def dcp_save(state, path):
        real_dcp_save(state, path)  # every rank's shards and the .metadata are written
        if _armed and phase == "half_written":  # as if the kill came while the files were written
            for file in Path(path).iterdir():
                with file.open("r+b") as f:
                    f.truncate(file.stat().st_size // 2)
        if _armed:
            _pause()

    def replace(src, dst):
        if _armed and Path(dst).name == "last.ckpt" and phase == "before_link":
            _pause()
        real_replace(src, dst)
        if _armed and Path(dst).name == "last.ckpt" and phase == "after_link":
            _pause()

    def rmtree(path, *args, **kwargs):
        if _armed:  # the replaced checkpoint is partly deleted
            next(p for p in Path(path).iterdir() if p.is_file()).unlink()
            _pause()
        real_rmtree(path, *args, **kwargs)

    if phase in ("half_written", "before_meta"):
        model_parallel._distributed_checkpoint_save = dcp_save
    elif phase in ("before_link", "after_link"):
        os.replace = replace
    elif phase == "removing_old":
        shutil.rmtree = rmtree


def _rank(rank: int, epochs: int, phase: str, run_dirs: list[str]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from omegaconf import OmegaConf

    from r3lightning.app.job.checkpoint import RunCheckpoint, resume_checkpoint

    torch.set_num_threads(1)
    if rank == 0 and phase != "none":
        _arm(phase)
    cfg = OmegaConf.create({"task": {}, "reward": {}, "model": {}, "resume": True, "steps": epochs})
    for run_dir in map(Path, run_dirs):
        module = _module(run_dir, epochs)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            max_epochs=epochs,
            callbacks=[RunCheckpoint(run_dir, cfg)],
            default_root_dir=run_dir,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, ckpt_path=resume_checkpoint(cfg, run_dir, module))


def main() -> None:
    """The command line in the module docstring."""
    from gloo_ranks import run_ranks

    epochs = int(sys.argv[1])
    phase = sys.argv[2]
    if phase not in PHASES:
        raise SystemExit(f"PHASE must be one of {PHASES}, got {phase!r}")
    run_ranks(_rank, epochs, phase, sys.argv[3:])
