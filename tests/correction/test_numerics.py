"""Extreme inputs stay finite and mean what they say: overflowing ratios in the policy loss, NaN and
opposite infinite log-ratios in the IS weights, caps a dtype cannot hold, rewards past float32, k3
at large log-ratios. References are written out by hand in float64."""

from __future__ import annotations

import math

import pytest
import torch

from r3lightning.app.job.grpo import group_advantages, mismatch_metrics, policy_loss
from r3lightning.correction import CorrectionConfig
from r3lightning.correction.importance import k3_terms, sequence_tis, token_tis
from r3lightning.rollout.prompts import score_value
from r3lightning.rollout.trajectory import Trajectory

INF, NAN = math.inf, math.nan


def test_an_overflowing_ratio_on_a_zero_advantage_token_leaves_the_loss_and_gradient_finite():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    new = torch.tensor([[-1.2, 98.0, -2.5], [-0.9, -1.1, -1.0]], requires_grad=True)  # 100 nats: exp = inf
    advantages = torch.tensor([0.0, 1.0])
    mask = torch.ones(2, 3)
    loss, stats = policy_loss(new, old, advantages, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    # row 0 has a zero advantage: its terms are 0 whatever the ratio; row 1 by hand (ratios in the clip)
    ratio = torch.exp(torch.tensor([0.1, -0.1, 0.0], dtype=torch.float64))
    assert loss.item() == pytest.approx(-float(ratio.sum()) / 6, rel=1e-6)
    assert torch.equal(new.grad[0], torch.zeros(3))
    assert stats["clip_fraction"].item() == 0.0


def test_an_overflowing_ratio_with_a_positive_advantage_is_the_clipped_term():
    old = torch.tensor([[-200.0, -1.0]])
    new = torch.tensor([[-1.0, -1.0]], requires_grad=True)  # log-ratio 199: beyond float64's exp too
    loss, stats = policy_loss(new, old, torch.tensor([2.0]), torch.ones(1, 2), clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-(1.28 * 2.0 + 1.0 * 2.0) / 2)
    assert torch.equal(new.grad[0, 0], torch.tensor(0.0)) and new.grad[0, 1] < 0  # clipped: no gradient
    assert stats["clip_fraction"].item() == 0.5


def test_token_tis_gives_a_nan_log_ratio_weight_zero_and_leaves_the_others():
    log_ratio = torch.tensor([[0.1, NAN, -0.2], [NAN, INF, -INF]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    weights = token_tis(log_ratio, mask, threshold=2.0)
    expected = torch.tensor([[math.exp(0.1), 0.0, math.exp(-0.2)], [0.0, 2.0, 0.0]])
    torch.testing.assert_close(weights, expected)


def test_sequence_tis_drops_a_sequence_whose_log_ratio_sum_is_undefined():
    log_ratio = torch.tensor([[INF, -INF, 0.1], [0.2, NAN, 0.0], [0.1, 0.2, NAN], [INF, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    weights = sequence_tis(log_ratio, mask, threshold=3.0)
    # +inf with -inf, and a NaN on a loss token: undefined, dropped; a NaN off the mask is unread
    expected = torch.tensor([[0.0] * 3, [0.0] * 3, [math.exp(0.3), math.exp(0.3), 0.0], [3.0] * 3])
    torch.testing.assert_close(weights, expected)


@pytest.mark.parametrize("threshold", [INF, -INF, NAN])
def test_a_cap_that_is_not_finite_is_refused(threshold):
    with pytest.raises(ValueError, match=r"threshold must be (a number >= 1 and finite|a number)"):
        CorrectionConfig(mode="token_tis", threshold=threshold)
    with pytest.raises(ValueError, match=r"threshold must be (a number >= 1 and finite|a number)"):
        token_tis(torch.zeros(1, 2), torch.ones(1, 2), threshold=threshold)


@pytest.mark.parametrize("fn", [token_tis, sequence_tis])
def test_a_cap_beyond_the_inputs_dtype_is_refused(fn):
    log_ratio = torch.full((1, 2), 20.0, dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"^threshold must be <= 65504, the largest torch.float16 value, got 100000"
    ):
        fn(log_ratio, torch.ones(1, 2, dtype=torch.float16), threshold=1e5)
    weights = fn(log_ratio, torch.ones(1, 2, dtype=torch.float16), threshold=65504.0)
    assert weights.dtype == torch.float16 and torch.equal(
        weights, torch.full((1, 2), 65504.0, dtype=torch.float16)
    )
    fn(log_ratio.float(), torch.ones(1, 2), threshold=1e5)  # float32 holds it


def test_rewards_past_float32_are_refused_and_advantages_are_computed_in_float64():
    with pytest.raises(
        ValueError, match=r"reward_fn must return a number within float32 range .* for g0, got 1e\+39"
    ):
        score_value(1e39, "g0")
    with pytest.raises(ValueError, match=r"float32 range"):
        score_value({"score": -1e39}, "g0")
    assert score_value(3e38, "g0") == 3e38
    rewards = torch.tensor([3e38, -3e38, 1e38, 0.0], dtype=torch.float64)
    mean = 0.25e38
    centred = [r - mean for r in (3e38, -3e38, 1e38, 0.0)]
    std = math.sqrt(sum(c * c for c in centred) / 3)
    advantages = group_advantages(rewards, 4)
    assert advantages.dtype == torch.float64 and torch.isfinite(advantages).all()
    torch.testing.assert_close(
        advantages, torch.tensor([c / (std + 1e-6) for c in centred], dtype=torch.float64)
    )
    assert group_advantages(torch.tensor([3e38, -3e38]), 2).dtype == torch.float32  # float32 in, out
    with pytest.raises(ValueError, match=r"^Trajectory.advantage must be within float32 range"):
        Trajectory([1], [2], advantage=5e38)


def test_k3_is_finite_at_large_log_ratios_and_exact_below_the_saturation():
    x = torch.tensor([-1e4, -50.0, 1e-4, 50.0, 700.0, 1e4, INF], dtype=torch.float64)
    k3 = k3_terms(x)
    assert torch.isfinite(k3).all()
    assert k3[1].item() == pytest.approx(math.expm1(-50.0) + 50.0)
    assert k3[2].item() == pytest.approx(math.expm1(1e-4) - 1e-4, rel=1e-12)
    assert k3[3].item() == pytest.approx(math.expm1(50.0) - 50.0)
    assert k3[4].item() == k3[5].item() == k3[6].item() > 1e260  # saturated
    out = mismatch_metrics(torch.tensor([[0.0, 0.0]]), torch.tensor([[-900.0, -1.0]]), torch.ones(1, 2))
    assert math.isfinite(out["k3_kl"].item())
