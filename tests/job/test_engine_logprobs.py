"""An engine that answers ``logprobs: null``: its tokens carry NaN, never 0.0 (probability 1), and
the GRPO module refuses a batch whose loss needs the engine's logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from r3lightning.app.job.grpo import GRPOConfig
from r3lightning.app.job.module import GRPOModule
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.correction import CorrectionConfig
from r3lightning.data.collate import collate_trajectories
from r3lightning.rollout.episode import Episode
from r3lightning.rollout.trajectory import Trajectory


def test_an_episode_stores_nan_for_sampled_tokens_without_engine_logprobs():
    episode = Episode([1, 2])
    episode.extend([5, 6], 1.0, None)  # the engine answered logprobs: null
    episode.extend([7], 0.0, None)  # an observation: no engine sampled it
    episode.extend([8], 1.0, [-0.25])
    assert episode.logprobs[:2] == pytest.approx([math.nan, math.nan], nan_ok=True)
    assert episode.logprobs[2:] == [0.0, -0.25]
    trajectory = episode.trajectory(advantage=1.0)
    assert trajectory.rollout_logprobs.isnan().tolist() == [True, True, False, False]


def _batch(logprobs: list[float], loss_mask: list[float]):
    trajectory = Trajectory([3, 4], [5, 6, 7], loss_mask=loss_mask, rollout_logprobs=logprobs, advantage=1.0)
    other = Trajectory([3], [9, 10], rollout_logprobs=[-0.5, -1.5], advantage=-1.0)
    return collate_trajectories([trajectory, other])


@pytest.fixture(scope="module")
def model():
    return build_tiny_moe(seed=0)


@pytest.mark.parametrize(
    ("recompute", "correction"), [(False, "none"), (False, "token_tis"), (True, "sequence_tis")]
)
def test_the_module_refuses_missing_engine_logprobs_on_loss_tokens_when_the_loss_needs_them(
    model, recompute, correction
):
    grpo = GRPOConfig(correction=CorrectionConfig(mode=correction))
    module = GRPOModule(model, grpo, recompute_old_logprobs=recompute)
    batch = _batch([-0.1, math.nan, math.nan], [1.0, 1.0, 0.0])
    with pytest.raises(
        ValueError, match=r"^rollout_logprobs: 1 loss tokens of this batch have no engine logprob"
    ):
        module.on_before_batch_transfer(batch, 0)


def test_the_module_takes_missing_logprobs_where_nothing_reads_them(model):
    # NaN only where the loss mask is 0: nothing reads them; they leave the batch as 0
    module = GRPOModule(model, GRPOConfig())
    batch = module.on_before_batch_transfer(_batch([-0.1, -0.2, math.nan], [1.0, 1.0, 0.0]), 0)
    assert not batch.rollout_logprobs.isnan().any() and module._engine_logprobs
    # r2 without a correction: the old-policy logprobs are the trainer's; the engine-mismatch
    # metrics, which need the engine's, are left out for this batch
    module = GRPOModule(model, GRPOConfig(), recompute_old_logprobs=True)
    batch = module.on_before_batch_transfer(_batch([math.nan] * 3, [1.0, 1.0, 1.0]), 0)
    assert not batch.rollout_logprobs.isnan().any() and not module._engine_logprobs
    assert module.measure_mismatch(batch) == {}
    expected = torch.tensor([[0.0] * 5, [0.0, 0.0, 0.0, -0.5, -1.5]])  # [B, S]: the engine's where given
    assert torch.equal(batch.rollout_logprobs, expected)
