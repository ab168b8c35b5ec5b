"""Shared helpers of the data-module tests: tagged trajectories, a recording model, a CPU trainer."""

from pathlib import Path

import lightning.pytorch as pl
import torch

from r3lightning.data.batch import RolloutBatch
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.packed import PackedTensor
from r3lightning.rollout.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[2]


def tagged(tag, rows=None):
    """Trajectory identified by its first prompt token; routes cover every forwarded token."""
    prompt, response = [tag, 1 + tag % 3], [2, 3][: tag % 3]
    n = len(prompt) + len(response)
    routes = torch.arange((n - 1) * 4).reshape(n - 1, 2, 2) % 8 if rows is None else rows
    return Trajectory(prompt, response, reward=float(tag % 5), routed_experts=routes)


def filled(count, first=100, **kwargs):
    buffer = ReplayBuffer(num_experts=8, **kwargs)
    buffer.extend([tagged(first + i) for i in range(count)])
    return buffer


def row_tags(batch):
    """First real token of every row (the trajectory's tag); placeholders (pad id 0) -> None."""
    seq, _ = batch.lengths_host()
    tags = [int(batch.input_ids[i, batch.width - int(seq[i])]) for i in range(len(batch))]
    return [t or None for t in tags]


class Recorder(pl.LightningModule):
    """Checks what the model sees and keeps every training batch."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen = []
        self.example_input_array = torch.zeros(2, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        assert isinstance(batch, RolloutBatch)
        assert isinstance(batch.routed_experts, PackedTensor)
        assert batch.routed_experts.device == self.device and batch.input_ids.device == self.device
        self.seen.append(batch)
        return self.layer(batch.loss_mask.sum(1, keepdim=True)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(**kwargs):
    defaults = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**defaults, **kwargs})


def flat(lists):
    return [x for inner in lists for x in inner]


def tags_of(batches):
    return [row_tags(b) for b in batches]


# ---------------------------------------------------------------------------- sharding
