"""Corrections in the GRPO loss (detached weights, masked tokens, empty batches) and the
``correction/*`` metrics as exact ratios of sums over micro-batches and gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
from gloo_ranks import run_ranks

from r3lightning.app.job.grpo import policy_loss
from r3lightning.correction import CorrectionConfig, CorrectionMetrics, correction_weights, geometric_mask
from r3lightning.packed import PackedTensor


def _batch(seed: int, rows: int = 3, width: int = 6):
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(rows, width, generator=g) * 3).requires_grad_()
    rollout = logprobs.detach() + torch.randn(rows, width, generator=g) * 0.5
    mask = (torch.rand(rows, width, generator=g) > 0.3).float()
    return logprobs, rollout, torch.randn(rows, generator=g), mask


def test_weights_scale_each_token_term_and_carry_no_gradient():
    logprobs, rollout, adv, mask = _batch(0)
    log_ratio = logprobs - rollout  # not detached by the caller: the correction detaches
    weights = correction_weights(log_ratio, mask, CorrectionConfig(mode="token_tis", threshold=1.2))
    assert not weights.requires_grad
    loss, _ = policy_loss(logprobs, rollout, adv, mask, clip_low=0.2, clip_high=0.28, weights=weights)
    loss.backward()
    # reference: the weights are constants, d/dlogp of -w * min(r A, clip(r) A) / n
    lp, old, m = logprobs.detach().double(), rollout.double(), mask.double()
    n = m.sum().item()
    value, grad = 0.0, torch.zeros_like(lp)
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not m[b, t]:
                continue
            r, a = math.exp(lp[b, t] - old[b, t]), adv[b].item()
            w = min(r, 1.2)
            clipped = min(max(r, 0.8), 1.28) * a
            value += -w * min(r * a, clipped) / n
            grad[b, t] = -w * r * a / n if r * a <= clipped else 0.0
    assert loss.item() == pytest.approx(value, rel=1e-5)
    torch.testing.assert_close(logprobs.grad.double(), grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["none", "token_tis", "sequence_tis", "geometric_mask", "token_mask"])
def test_masked_tokens_contribute_exactly_zero_to_loss_and_gradient(mode):
    logprobs, rollout, adv, mask = _batch(1)
    config = CorrectionConfig(mode=mode, threshold=1.5, lower=0.6, upper=1.8)

    def run(lp_values, old_values):
        lp = lp_values.clone().requires_grad_()
        weights = correction_weights(lp.detach() - old_values, mask, config)
        loss, _ = policy_loss(lp, old_values, adv, mask, weights=weights)
        loss.backward()
        return loss, lp.grad

    clean_loss, clean_grad = run(logprobs.detach(), rollout)
    off = mask == 0
    junk_lp = logprobs.detach().masked_fill(off, float("inf"))
    junk_old = rollout.masked_fill(off, float("nan"))
    loss, grad = run(junk_lp, junk_old)
    assert torch.isfinite(loss) and loss.item() == clean_loss.item()
    assert torch.equal(grad, clean_grad) and (grad[off] == 0).all()


def test_all_masked_batch_gives_a_finite_zero_loss_and_says_so():
    logprobs, rollout, adv, _ = _batch(2)
    empty = torch.zeros_like(rollout)
    config = CorrectionConfig(mode="token_tis")
    weights = correction_weights(logprobs.detach() - rollout, empty, config)
    loss, _ = policy_loss(logprobs, rollout, adv, empty, weights=weights)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logprobs.grad, torch.zeros_like(logprobs))
    metrics = CorrectionMetrics(config)
    metrics.update(weights, empty)
    got = {k: v.item() for k, v in metrics.compute().items()}
    assert got == {
        "correction/weight_mean": 0.0,
        "correction/weight_max": 0.0,
        "correction/ess": 0.0,
        "correction/truncated_fraction": 0.0,
        "correction/masked_fraction": 0.0,
        "correction/loss_tokens": 0.0,
    }
    # every sequence dropped by the mask: zero loss, and masked_fraction says all of them
    logprobs.grad = None
    mask = torch.ones_like(rollout)
    keep = geometric_mask(torch.full_like(rollout, 3.0), mask)
    loss, _ = policy_loss(logprobs, rollout, adv, mask, weights=keep)
    loss.backward()
    assert loss.item() == 0.0 and not logprobs.grad.any()
    metrics = CorrectionMetrics(CorrectionConfig(mode="geometric_mask"))
    metrics.update(keep, mask)
    assert metrics.compute()["correction/masked_fraction"].item() == 1.0


def _reference(parts: list[tuple[list[float], list[int]]], mode: str, threshold: float) -> dict[str, float]:
    """Sums over every token of every part, in Python floats, then the ratios."""
    w = [v for weights, mask in parts for v, k in zip(weights, mask, strict=True) if k]
    n = len(w)
    return {
        "correction/weight_mean": sum(w) / n,
        "correction/weight_max": max(w),
        "correction/ess": sum(w) ** 2 / (n * sum(v * v for v in w)),
        "correction/truncated_fraction": sum(v >= threshold for v in w) / n if "tis" in mode else 0.0,
        "correction/masked_fraction": sum(v == 0 for v in w) / n if "mask" in mode else 0.0,
        "correction/loss_tokens": float(n),
    }


def _micro_batches(seed: int, mode: str):
    """Two micro-batches of different sizes (padded, then packed) and their weights under ``mode``."""
    config = CorrectionConfig(mode=mode, threshold=1.5, lower=0.75, upper=1.5)  # exact in float32
    g = torch.Generator().manual_seed(seed)
    log_ratio_a, log_ratio_b = torch.randn(4, 7, generator=g) * 0.4, torch.randn(6, generator=g) * 0.4 + 0.1
    mask_a, mask_b = _batch(seed, rows=4, width=7)[3], _batch(seed + 1, rows=2, width=3)[3]
    a = correction_weights(log_ratio_a, mask_a, config)
    packed_b = PackedTensor.from_lengths(log_ratio_b, [2, 0, 4])
    packed_mask = PackedTensor.from_lengths(mask_b.reshape(-1), [2, 0, 4])
    b = correction_weights(packed_b, packed_mask, config)
    parts = [
        (a.reshape(-1).tolist(), mask_a.reshape(-1).tolist()),
        (b.values.tolist(), mask_b.reshape(-1).tolist()),
    ]
    return config, [(a, mask_a), (b, packed_mask)], parts


@pytest.mark.parametrize("mode", ["token_tis", "sequence_tis", "geometric_mask", "token_mask", "none"])
def test_metrics_are_ratios_of_sums_over_micro_batches(mode):
    config, batches, parts = _micro_batches(3, mode)
    metrics = CorrectionMetrics(config)
    for weights, mask in batches:
        metrics.update(weights, mask)
    got = {k: v.item() for k, v in metrics.compute().items()}
    expected = _reference(parts, mode, config.threshold)
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-12)
    if mode != "none":  # neither cap nor band is idle on these tokens
        assert 0 < got["correction/ess"] < 1
        assert 0 < got[f"correction/{'truncated' if 'tis' in mode else 'masked'}_fraction"] < 1
    if mode in ("token_tis", "token_mask"):
        # a mean of the two micro-batches' ratios would differ: the sizes differ
        singles = [_reference([p], mode, config.threshold) for p in parts]
        key = "correction/weight_mean"
        assert (singles[0][key] + singles[1][key]) / 2 != pytest.approx(got[key], rel=1e-4)
    metrics.reset()
    assert metrics.compute()["correction/loss_tokens"].item() == 0.0


def _rank(rank: int, mode: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # the launcher sets torchrun's environment on 127.0.0.1
    config, batches, parts = _micro_batches(3, mode)
    metrics = CorrectionMetrics(config)
    metrics.update(*batches[rank])  # each rank holds one of the two micro-batches
    got = {k: v.item() for k, v in metrics.compute(sync_dist=True).items()}
    assert got == pytest.approx(_reference(parts, mode, config.threshold), rel=1e-6, abs=1e-12)
    local = {k: v.item() for k, v in metrics.compute().items()}  # no sync: this rank's own
    assert local == pytest.approx(_reference([parts[rank]], mode, config.threshold), rel=1e-6, abs=1e-12)


@pytest.mark.slow
def test_metrics_sum_over_two_gloo_ranks():
    run_ranks(_rank, "token_tis")
