"""GRPO math, mismatch metrics, the toy task and the report, against plain-Python references."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.app.job.grpo import group_advantages, mismatch_metrics, policy_loss, token_logprobs
from r3lightning.app.job.report import format_table, plot_runs, read_csv, summarize, write_csv
from r3lightning.app.tasks.token_class import TokenClassTask


def _ref_advantages(rewards: list[float], group_size: int, normalize: bool) -> list[float]:
    out = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g : g + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [(r - mean) / (std + 1e-6) if normalize else r - mean for r in group]
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(2, 5),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_group_advantages_match_reference(groups, group_size, normalize, rnd):
    rewards = [rnd.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(groups * group_size)]
    got = group_advantages(torch.tensor(rewards), group_size, normalize_std=normalize)
    assert got.tolist() == pytest.approx(_ref_advantages(rewards, group_size, normalize), abs=1e-5)


def test_group_advantages_constant_group_is_zero_and_shape_checked():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5]), 3)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(torch.zeros(6), 4)


def test_token_logprobs_shift_against_loop():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    got = token_logprobs(logits, ids)
    for b in range(2):
        assert got[b, 0].item() == 0.0
        for t in range(1, 5):
            row = logits[b, t - 1].tolist()
            lse = math.log(sum(math.exp(x) for x in row))
            assert got[b, t].item() == pytest.approx(row[ids[b, t]] - lse, abs=1e-5)


def _ref_loss(lp, old, adv, mask, lo, hi):
    num, den, clipped_count = 0.0, 0.0, 0.0
    for b in range(len(lp)):
        for t in range(len(lp[b])):
            if mask[b][t] == 0:
                continue
            r = math.exp(lp[b][t] - old[b][t])
            a = adv[b]
            unclipped, clipped = r * a, min(max(r, 1 - lo), 1 + hi) * a
            num += -min(unclipped, clipped)
            clipped_count += clipped < unclipped
            den += 1
    return num / den, clipped_count / den


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_policy_loss_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(3, 6, generator=g) * 3
    old = lp + (torch.rand(3, 6, generator=g) - 0.5) * 1.5
    adv = torch.randn(3, generator=g)
    mask = (torch.rand(3, 6, generator=g) > 0.4).float()
    mask[0, -1] = 1.0
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    ref_loss, ref_clip = _ref_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(ref_clip, abs=1e-6)


def test_policy_loss_gradient_is_zero_outside_clip_and_masked():
    lp = torch.tensor([[0.0, -1.0, math.log(2.0)]], requires_grad=True)
    old = torch.zeros(1, 3)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, _ = policy_loss(lp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    # token 0 masked; token 1 ratio e^-1 < 0.8 with A > 0: unclipped branch is the min, live;
    # token 2 ratio 2 > 1.28 with A > 0: clipped, no gradient.
    assert lp.grad[0, 0].item() == 0.0
    assert lp.grad[0, 1].item() == pytest.approx(-math.exp(-1.0) / 2)
    assert lp.grad[0, 2].item() == 0.0


def test_mismatch_metrics_reference():
    rnd = random.Random(3)
    rollout = [[-rnd.random() * 4 for _ in range(5)] for _ in range(4)]
    trainer = [[x + rnd.choice([-1.0, -0.5, 0.0, 0.3, 0.9]) for x in row] for row in rollout]
    mask = [[float(rnd.random() > 0.3) for _ in range(5)] for _ in range(4)]
    k3s, outs, absd = [], [], []
    for b in range(4):
        for t in range(5):
            if mask[b][t]:
                log_r = trainer[b][t] - rollout[b][t]
                r = math.exp(log_r)
                k3s.append(r - 1 - log_r)
                outs.append(float(r < 0.5 or r > 2))
                absd.append(abs(log_r))
    m = mismatch_metrics(torch.tensor(trainer), torch.tensor(rollout), torch.tensor(mask))
    assert m["k3_kl"].item() == pytest.approx(sum(k3s) / len(k3s), rel=1e-5)
    assert m["ratio_out_of_band"].item() == pytest.approx(sum(outs) / len(outs), abs=1e-6)
    assert m["abs_logprob_diff"].item() == pytest.approx(sum(absd) / len(absd), rel=1e-5)
    assert sum(outs) > 0  # the draw includes shifts of -1.0 (ratio 0.37) on some masked token


def test_mismatch_metrics_zero_when_equal_and_empty_mask():
    lp = -torch.rand(2, 4)
    m = mismatch_metrics(lp, lp.clone(), torch.ones(2, 4))
    assert m["k3_kl"].item() == 0.0 and m["ratio_out_of_band"].item() == 0.0
    m = mismatch_metrics(lp, lp - 5, torch.zeros(2, 4))
    assert m["k3_kl"].item() == 0.0


def test_task_prompts_and_reward():
    task = TokenClassTask(vocab_size=96, num_classes=2, prompt_length=5, response_length=4)
    prompts = task.sample_prompts(50, torch.Generator().manual_seed(0))
    assert len(prompts) == 50 and all(len(p) == 5 for p in prompts)
    assert all(p[-1] in (4, 5) and all(6 <= t < 96 for t in p[:-1]) for p in prompts)
    assert {p[-1] for p in prompts} == {4, 5}
    even_prompt = [10, 11, 12, 13, 4]
    assert task.target_class(even_prompt) == 0
    assert task.reward(even_prompt, [8, 9, 10, 12]) == 0.75
    assert task.reward(even_prompt, [8, 10]) == 0.5  # short answers are not rewarded more
    assert task.reward([7, 5], [1, 3, 5, 7, 9]) == 1.0  # only response_length tokens count
    with pytest.raises(ValueError, match="instruction token in \\[4, 6\\)"):
        task.target_class([10, 11])
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2"):
        TokenClassTask(num_classes=1)


def _records(agreement: float, n: int = 5):
    return [
        {
            "step": float(i),
            "reward": 0.5 + 0.1 * i,
            "k3_kl": 1e-4 * (i + 1),
            "ratio_out_of_band": 0.01 * i,
            "used_agreement/layer_1": agreement,
            "used_agreement/layer_2": agreement - 0.02 * (agreement < 1),
            # the paired mismatch, measured on even steps only
            **(
                {
                    "mismatch/native_agreement": 0.9 + 0.01 * i,
                    "mismatch/k3_native": 4e-3 * (i + 1),
                    "mismatch/k3_replayed": 1e-4 * (i + 1),
                    "mismatch/outside_band_native": 0.02,
                    "mismatch/outside_band_replayed": 0.001,
                    "mismatch/policy_entropy": 2.0 - 0.25 * i,
                }
                if i % 2 == 0
                else {}
            ),
        }
        for i in range(n)
    ]


def test_report_csv_roundtrip_summary_table_and_plot(tmp_path):
    on, off = _records(1.0), _records(0.95)
    write_csv(tmp_path / "m.csv", on)
    assert read_csv(tmp_path / "m.csv") == on  # the odd steps' empty mismatch cells are dropped
    s = summarize(on, window=2)
    assert s["reward_start"] == pytest.approx(0.55) and s["reward_end"] == pytest.approx(0.85)
    assert s["agreement_min"] == 1.0
    assert summarize(off)["agreement_min"] == pytest.approx(0.93)
    # paired mismatch: means over the measured steps 0, 2, 4; step 0; the last measured steps
    assert s["k3_native"] == pytest.approx(4e-3 * (1 + 3 + 5) / 3)
    assert s["k3_replayed"] == pytest.approx(1e-4 * 3)
    assert s["k3_ratio"] == pytest.approx(40.0) and s["k3_ratio_step0"] == pytest.approx(40.0)
    assert s["native_agreement"] == pytest.approx(0.92) and s["native_agreement_step0"] == 0.9
    assert s["policy_entropy_step0"] == 2.0 and s["policy_entropy_end"] == pytest.approx((1.5 + 1.0) / 2)
    table = format_table({"replay=r3": on, "replay=off": off})
    lines = table.splitlines()
    assert lines[0].split()[0] == "run" and lines[2].startswith("replay=r3")
    assert "outside [0.5, 2] native" in lines[0]
    cells = lines[2].split()
    assert "92.00%" in cells and "1.20e-02" in cells and "3.00e-04" in cells and "40.0x" in cells
    assert "2.000%" in cells and "0.100%" in cells and "2.000 -> 1.500" in lines[2]
    step0 = lines[lines.index("step 0 (same weights and rollouts in every arm):") + 3].split()
    assert step0 == ["replay=r3", "4.00e-03", "1.00e-04", "40.0x", "2.000%", "0.100%"]
    assert "outside [0.25, 4] native" in format_table({"replay=r3": on}, ratio_band=4.0).splitlines()[0]
    bare = [{"step": 0.0, "reward": 0.5}]  # a run without the paired metrics (an external engine)
    assert "n/a" in format_table({"replay=off": bare}).splitlines()[2]
    plot_runs(tmp_path / "p.png", {"replay=r3": on, "replay=off": off, "bare": bare})
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_left_padded_batch_logprobs_equal_unpadded_forwards():
    """position_ids from the mask: a left-padded row scores its tokens exactly as alone."""
    from types import SimpleNamespace

    from r3lightning.app.job.module import GRPOModule
    from r3lightning.app.models.tiny import build_tiny_moe

    module = GRPOModule(build_tiny_moe(seed=3))
    short, long = [7, 9, 11, 13], [5, 6, 7, 8, 9, 10, 11]
    input_ids = torch.tensor([[0, 0, 0, *short], long])
    mask = input_ids != 0
    mask[1] = True
    with torch.no_grad():
        padded = module.batch_logprobs(SimpleNamespace(input_ids=input_ids, attention_mask=mask))
        for row, seq in enumerate((short, long)):
            ids = torch.tensor([seq])
            alone = token_logprobs(module.model(input_ids=ids).logits, ids)[0]
            # the first real token has no predecessor (its entry reads the padding; never a target)
            torch.testing.assert_close(padded[row, 1 - len(seq) :], alone[1:], rtol=1e-5, atol=1e-5)
