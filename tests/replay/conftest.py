"""Session fixtures of the route pipeline tests: one set of rollouts from the embedded server, the
trainer's copy of the served weights, the buffer and the whole batch."""

import pytest
import torch
from route_reference import SEED, SPECS, VOCAB, E, Rollouts, collect_rollouts

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.data.batch import RolloutBatch
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.datamodule import R3DataModule


@pytest.fixture(scope="session")
def rollouts() -> Rollouts:
    return collect_rollouts()


@pytest.fixture(scope="session")
def model() -> torch.nn.Module:
    """The trainer's fp32 copy of the weights the server samples with (bf16 values, fp32 math)."""
    return build_tiny_moe(seed=SEED)


@pytest.fixture(scope="session")
def buffer(rollouts: Rollouts) -> ReplayBuffer:
    buffer = ReplayBuffer(vocab_size=VOCAB, num_experts=E)
    buffer.extend(rollouts.trajectories)
    return buffer


@pytest.fixture(scope="session")
def full_batch(buffer: ReplayBuffer) -> RolloutBatch:
    datamodule = R3DataModule(
        buffer, batch_size=len(SPECS), shuffle=False, collate_threads=1, pin_memory=False
    )
    (batch,) = list(datamodule.train_dataloader())
    return batch
