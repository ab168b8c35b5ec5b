"""The GRPO module's ``correction/*`` metrics belong to one RL step (one epoch of the job): a
second step reports its own tokens, never the sum with the first's."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from r3lightning.app.job.grpo import GRPOConfig
from r3lightning.app.job.module import GRPOModule, OptimConfig
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.correction import CorrectionConfig
from r3lightning.data.collate import collate_trajectories
from r3lightning.rollout.trajectory import Trajectory


def _batch(response_lengths: list[int]):
    trajectories = [
        Trajectory([5, 6, 7], list(range(10, 10 + n)), rollout_logprobs=[-1.0] * n, advantage=1.0)
        for n in response_lengths
    ]
    return collate_trajectories(trajectories)


class StepPerEpoch(GRPOModule):
    """One batch per epoch, as the job trains one rollout batch per RL step."""

    def __init__(self, batches, **kwargs):
        super().__init__(**kwargs)
        self.batches = batches

    def train_dataloader(self):
        return DataLoader([self.batches[self.current_epoch]], batch_size=None, collate_fn=lambda b: b)


class EpochMetrics(pl.Callback):
    def __init__(self):
        self.seen: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        metrics = trainer.callback_metrics
        self.seen.append({k: float(v) for k, v in metrics.items() if k.startswith("correction/")})


def test_correction_metrics_restart_every_step():
    sizes = [[3, 4], [2]]  # 7 loss tokens at step 0, 2 at step 1
    config = GRPOConfig(correction=CorrectionConfig(mode="token_tis", threshold=2.0))
    module = StepPerEpoch(
        [_batch(s) for s in sizes], model=build_tiny_moe(seed=0), grpo=config, optim=OptimConfig(lr=0.0)
    )
    recorder = EpochMetrics()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        reload_dataloaders_every_n_epochs=1,
        callbacks=[recorder],
    )
    trainer.fit(module)
    assert [m["correction/loss_tokens"] for m in recorder.seen] == [7.0, 2.0]
    for metrics in recorder.seen:  # each step's own weights: a mean and max of weights in (0, 2]
        assert 0.0 < metrics["correction/weight_mean"] <= metrics["correction/weight_max"] <= 2.0
    assert torch.is_tensor(trainer.callback_metrics["correction/ess"])
