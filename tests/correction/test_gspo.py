"""GSPO (``algorithm.loss: gspo``): value, gradient and clip fraction against a float64 reference
written here from the formula, with and without correction weights; its config and job arms."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.app.job.grpo import GRPOConfig, gspo_loss
from r3lightning.app.job.main import arms, compose_config


def _batch(seed: int, rows: int = 4, width: int = 7):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    old = logprobs + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, width, generator=g) < 0.7).double()
    mask[0] = 0.0  # a sequence without loss tokens: not counted
    weights = torch.rand(rows, width, generator=g, dtype=torch.float64) * 2
    return logprobs, old, adv, mask, weights


def _reference(lp, old, adv, mask, weights, lo, hi):
    """float64 loss, d loss / d lp and clip fraction, from the sequence-level formula.

    s_i = exp(sum_t m_t (lp_t - old_t) / n_i); term_i = -min(s_i A_i, clip(s_i) A_i); token t of
    sequence i carries w_t / n_i of term_i; the unclipped branch's gradient through lp_t is
    -A_i s_i / n_i (each token's share of d s_i), the clipped branch's is 0 outside the band.
    """
    rows, width = len(lp), len(lp[0])
    grad = [[0.0] * width for _ in range(rows)]
    total, sequences, clipped = 0.0, 0, 0
    terms = []
    for b in range(rows):
        tokens = [t for t in range(width) if mask[b][t] != 0]
        if not tokens:
            terms.append(None)
            continue
        n = len(tokens)
        s = math.exp(sum(lp[b][t] - old[b][t] for t in tokens) / n)
        a = adv[b]
        unclipped, clip = s * a, min(max(s, 1 - lo), 1 + hi) * a
        took_clip = clip < unclipped
        mean_w = sum(weights[b][t] for t in tokens) / n
        total += -min(unclipped, clip) * mean_w
        sequences += 1
        clipped += took_clip
        terms.append((tokens, n, s, a, took_clip))
    for b, entry in enumerate(terms):
        if entry is None:
            continue
        tokens, n, s, a, took_clip = entry
        for t in tokens:
            grad[b][t] = 0.0 if took_clip else -a * s * weights[b][t] / n / sequences
    return total / max(sequences, 1), grad, clipped / max(sequences, 1)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.booleans(), st.sampled_from([(0.2, 0.28), (3e-4, 4e-4), (0.05, 0.05)]))
def test_gspo_value_gradient_and_clip_fraction_match_float64_reference(seed, weighted, clip):
    logprobs, old, adv, mask, weights = _batch(seed)
    if not weighted:
        weights = torch.ones_like(weights)
    lp = logprobs.clone().requires_grad_(True)
    w = weights if weighted else None
    loss, stats = gspo_loss(lp, old, adv, mask, clip_low=clip[0], clip_high=clip[1], weights=w)
    loss.backward()
    ref_loss, ref_grad, ref_clip = _reference(
        logprobs.tolist(), old.tolist(), adv.tolist(), mask.tolist(), weights.tolist(), *clip
    )
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-14)
    assert lp.grad.tolist() == [pytest.approx(row, rel=1e-10, abs=1e-14) for row in ref_grad]
    assert stats["sequence_clip_fraction"].item() == pytest.approx(ref_clip, abs=1e-15)


def test_gspo_float32_matches_the_float64_reference_and_masks_junk():
    logprobs, old, adv, mask, _ = _batch(7)
    junk_lp = torch.where(mask != 0, logprobs, torch.nan).float().requires_grad_(True)
    junk_old = torch.where(mask != 0, old, torch.inf).float()
    loss, _ = gspo_loss(junk_lp, junk_old, adv.float(), mask.float())
    loss.backward()
    ref_loss, ref_grad, _ = _reference(
        logprobs.tolist(), old.tolist(), adv.tolist(), mask.tolist(), torch.ones_like(old).tolist(), 0.2, 0.28
    )
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
    assert torch.allclose(junk_lp.grad.double(), torch.tensor(ref_grad, dtype=torch.float64), atol=1e-6)


def test_gspo_differs_from_the_token_loss_and_clips_whole_sequences():
    # one sequence, two tokens with ratios e^{+0.5} and e^{-0.5}: the token loss clips the first
    # token (A > 0), GSPO's sequence ratio is exactly 1 and clips nothing
    lp = torch.tensor([[0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    loss, stats = gspo_loss(lp, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 2))
    loss.backward()
    assert loss.item() == pytest.approx(-1.0, abs=1e-15) and stats["sequence_clip_fraction"].item() == 0.0
    assert lp.grad.tolist() == [[pytest.approx(-0.5, abs=1e-15), pytest.approx(-0.5, abs=1e-15)]]
    # shift both up: s = e^{0.5} > 1.28 with A > 0, every token of the sequence gets no gradient
    lp2 = (lp.detach() + 0.5).requires_grad_(True)
    loss2, stats2 = gspo_loss(lp2, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 2))
    loss2.backward()
    assert stats2["sequence_clip_fraction"].item() == 1.0 and not lp2.grad.any()
    assert loss2.item() == pytest.approx(-1.28, abs=1e-15)


def test_all_masked_batch_is_a_finite_zero():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = gspo_loss(lp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and stats["sequence_clip_fraction"].item() == 0.0 and not lp.grad.any()


def test_loss_setting_is_checked_and_reaches_the_job():
    assert GRPOConfig().loss == "grpo"  # the token loss stays the default
    with pytest.raises(ValueError, match=r"loss must be one of \['grpo', 'gspo'\], got 'ppo'"):
        GRPOConfig(loss="ppo")
    cfg = compose_config(["experiment=compare_gspo"])
    got = {name: (c.replay.mode, c.algorithm.loss) for name, c in arms(cfg).items()}
    assert got == {"gspo": ("off", "gspo"), "gspo+r3": ("r3", "gspo")}
    assert cfg.rollout.server.simulated_disagreement == 0.1 and cfg.seeds == 3


def test_the_job_builds_its_module_with_the_settings_objects():
    # Hydra's instantiate hands dataclass arguments over as configs: the module gets them back
    from r3lightning.app.job.build import instantiate_node
    from r3lightning.app.job.module import OptimConfig
    from r3lightning.app.models.tiny import build_tiny_moe
    from r3lightning.correction import CorrectionConfig

    grpo = GRPOConfig(loss="gspo", correction=CorrectionConfig(steps=[{"kind": "veto", "floor": 0.1}]))
    extra = {"model": build_tiny_moe(), "grpo": grpo, "optim": OptimConfig()}
    module = instantiate_node(compose_config().module, "module", **extra)
    assert module.grpo == grpo and module.grpo.correction.active
