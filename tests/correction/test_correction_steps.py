"""Corrections as steps (veto, K3 rejection, TIS lower clip, products of steps) and their per-step
metrics, against float64 references written here; nonsense settings refused in one line."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.correction import (
    CorrectionConfig,
    CorrectionMetrics,
    CorrectionStep,
    correction_weights,
    k3_mask,
    veto_mask,
)
from r3lightning.packed import PackedTensor


def _ref_step(step: dict, xs: list[float], ms: list[int]) -> list[float]:
    """One step's values on one sequence, from its formula in docs/concepts/corrections.md."""
    kind = step["kind"]
    loss = [v for v, k in zip(xs, ms, strict=True) if k]
    n = len(loss)
    if kind in ("token_tis", "sequence_tis"):
        cap, low = step.get("cap", 2.0), step.get("lower_clip") or 0.0
        if kind == "token_tis":
            return [min(max(math.exp(v), low), cap) if k else 0.0 for v, k in zip(xs, ms, strict=True)]
        w = min(max(math.exp(sum(loss)), low), cap)
        return [w if k else 0.0 for k in ms]
    if kind == "token_mask":
        lo, hi = step.get("lower", 0.5), step.get("upper", 2.0)
        return [float(bool(k) and lo <= math.exp(v) <= hi) for v, k in zip(xs, ms, strict=True)]
    if kind == "geometric_mask":
        ratio = math.exp(sum(loss) / n) if n else 1.0
        keep = step.get("lower", 0.5) <= ratio <= step.get("upper", 2.0)
    elif kind == "veto":
        keep = all(math.exp(v) >= step["floor"] for v in loss)
    else:  # k3_reject: mean of r - 1 - log r
        keep = (sum(math.expm1(v) - v for v in loss) / n if n else 0.0) <= step["max_k3"]
    return [float(bool(k) and keep) for k in ms]


def _ref_weights(steps: list[dict], x, m) -> list[list[float]]:
    out = []
    for xs, ms in zip(x, m, strict=True):
        w = [float(k) for k in ms]
        for step in steps:
            w = [a * b for a, b in zip(w, _ref_step(step, xs, ms), strict=True)]
        out.append(w)
    return out


def _batch(seed: int, lengths=(6, 1, 9, 0, 4, 7)):
    g = torch.Generator().manual_seed(seed)
    x, m = [], []
    for i, n in enumerate(lengths):
        drift = (i - 2.5) * 0.12
        x.append((torch.randn(n, generator=g, dtype=torch.float64) * 0.5 + drift).tolist())
        m.append([int(v) for v in (torch.rand(n, generator=g) > 0.2).tolist()])
    return x, m


def _padded(rows, dtype=torch.float64):
    width = max(len(r) for r in rows)
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, width - len(r) :] = torch.tensor(r, dtype=torch.float64).to(dtype)
    return out


def _packed(rows, dtype=torch.float64):
    return PackedTensor.from_segments([torch.tensor(r, dtype=torch.float64).to(dtype) for r in rows])


STEPS = [
    {"kind": "token_tis", "cap": 1.4, "lower_clip": 0.7},
    {"kind": "sequence_tis", "cap": 1.9, "lower_clip": 0.4},
    {"kind": "sequence_tis", "cap": 1.3},
    {"kind": "token_mask", "lower": 0.6, "upper": 1.5},
    {"kind": "geometric_mask", "lower": 0.85, "upper": 1.2},
    {"kind": "veto", "floor": 0.45},
    {"kind": "k3_reject", "max_k3": 0.09},
]


@pytest.mark.parametrize("step", STEPS, ids=[f"{s['kind']}-{i}" for i, s in enumerate(STEPS)])
@pytest.mark.parametrize("form", ["padded", "packed"])
def test_each_step_matches_its_float64_formula(step, form):
    x, m = _batch(0)
    expected = _ref_weights([step], x, m)
    config = CorrectionConfig(steps=[step])
    if form == "padded":
        got = correction_weights(_padded(x), _padded(m), config)
        torch.testing.assert_close(got, _padded(expected), rtol=1e-12, atol=1e-12)
    else:
        got = correction_weights(_packed(x), _packed(m, torch.bool), config)
        torch.testing.assert_close(got.values, _packed(expected).values, rtol=1e-12, atol=1e-12)
    values = got if form == "padded" else got.values
    ones = _padded(m) if form == "padded" else _packed(m)
    ones = ones if form == "padded" else ones.values
    assert (values != 0).any() and (values != ones).any()  # the step acts on these tokens


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from([None, 0, 1, 2]),  # the TIS step, if any
    st.sets(st.sampled_from([3, 4, 5, 6]), min_size=1),  # masks
)
def test_products_of_steps_match_the_reference(seed, tis, masks):
    x, m = _batch(seed)
    steps = ([STEPS[tis]] if tis is not None else []) + [STEPS[i] for i in sorted(masks)]
    got = correction_weights(_padded(x, torch.float32), _padded(m), CorrectionConfig(steps=steps))
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got.double(), _padded(_ref_weights(steps, x, m)), rtol=3e-7, atol=3e-7)


def test_veto_and_k3_drop_whole_sequences_and_ignore_masked_junk():
    x = torch.tensor([[0.0, -3.0, 0.1], [0.0, 0.1, -0.1], [0.5, -0.5, math.nan]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    assert veto_mask(x, m, floor=0.1).tolist() == [[0.0] * 3, [1.0] * 3, [1.0, 1.0, 0.0]]
    k3 = (math.expm1(0.5) - 0.5 + math.expm1(-0.5) + 0.5) / 2
    got = k3_mask(x, m, max_k3=k3 + 1e-12)
    assert got.tolist() == [[0.0] * 3, [1.0] * 3, [1.0, 1.0, 0.0]]
    assert k3_mask(x, m, max_k3=k3 - 1e-12)[2].tolist() == [0.0, 0.0, 0.0]


def test_veto_drops_a_sequence_with_an_undefined_ratio_on_a_loss_token():
    # the formula keeps a sequence only if every loss token has r_t >= floor: NaN is not >= floor
    x = torch.tensor([[0.0, math.nan, 0.1], [0.0, 0.1, -0.1]], dtype=torch.float64)
    m = torch.ones(2, 3)
    step = {"kind": "veto", "floor": 0.1}
    expected = [_ref_step(step, xs, ms) for xs, ms in zip(x.tolist(), m.tolist(), strict=True)]
    assert expected == [[0.0] * 3, [1.0] * 3]
    assert veto_mask(x, m, floor=0.1).tolist() == expected
    packed = veto_mask(PackedTensor.from_segments(list(x)), PackedTensor.from_segments(list(m)), floor=0.1)
    assert packed.values.tolist() == [*expected[0], *expected[1]]


def test_single_step_form_is_one_step_and_none_is_the_mask():
    x, m = _batch(3)
    lr, mask = _padded(x), _padded(m)
    legacy = CorrectionConfig(mode="sequence_tis", threshold=1.3)
    assert legacy.plan == (CorrectionStep("sequence_tis", cap=1.3),)
    assert torch.equal(
        correction_weights(lr, mask, legacy), correction_weights(lr, mask, CorrectionConfig(steps=[STEPS[2]]))
    )
    assert torch.equal(correction_weights(lr, mask, CorrectionConfig()), mask)
    assert not CorrectionConfig().active and CorrectionConfig(steps=[STEPS[5]]).active


def test_per_step_metrics_are_sums_over_micro_batches():
    steps = [STEPS[0], STEPS[3], STEPS[5]]
    config = CorrectionConfig(steps=steps)
    metrics = CorrectionMetrics(config)
    parts = [_batch(10), _batch(11, lengths=(3, 8, 5))]
    for x, m in parts:
        lr, mask = _padded(x), _padded(m)
        metrics.update(correction_weights(lr, mask, config), mask, lr)
    got = {k: v.item() for k, v in metrics.compute().items()}
    x = [row for part in parts for row in part[0]]
    m = [row for part in parts for row in part[1]]
    n = sum(map(sum, m))
    tis = [
        w
        for xs, ms in zip(x, m, strict=True)
        for w, k in zip(_ref_step(steps[0], xs, ms), ms, strict=True)
        if k
    ]
    combined = [
        w
        for row, ms in zip(_ref_weights(steps, x, m), m, strict=True)
        for w, k in zip(row, ms, strict=True)
        if k
    ]
    dropped = {
        s["kind"]: sum(
            1
            for xs, ms in zip(x, m, strict=True)
            for w, k in zip(_ref_step(s, xs, ms), ms, strict=True)
            if k and w == 0
        )
        for s in steps[1:]
    }
    expected = {
        "correction/loss_tokens": n,
        "correction/weight_mean": sum(combined) / n,
        "correction/weight_max": max(combined),
        "correction/ess": sum(combined) ** 2 / (n * sum(w * w for w in combined)),
        "correction/truncated_fraction": sum(w == 1.4 for w in combined) / n,
        "correction/masked_fraction": sum(w == 0 for w in combined) / n,
        "correction/token_tis/weight_mean": sum(tis) / n,
        "correction/token_tis/truncated_fraction": sum(w == 1.4 for w in tis) / n,
        "correction/token_tis/lower_clipped_fraction": sum(w == 0.7 for w in tis) / n,
        "correction/token_mask/masked_fraction": dropped["token_mask"] / n,
        "correction/veto/masked_fraction": dropped["veto"] / n,
    }
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    for key in ("token_tis/truncated_fraction", "token_tis/lower_clipped_fraction", "veto/masked_fraction"):
        assert 0 < got[f"correction/{key}"] < 1, key  # each counter is exercised


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"steps": [{"kind": "token_tis", "cap": 0.9}]}, "steps[0].cap must be a number >= 1"),
        (
            {"steps": [{"kind": "token_mask", "lower": 1.2, "upper": 1.1}]},
            "steps[0].lower and upper must satisfy",
        ),
        ({"steps": [{"kind": "geometric_mask", "lower": 1.0, "upper": 1.0}]}, "non-empty band"),
        ({"steps": [{"kind": "token_mask", "lower": 1.1, "upper": 2.0}]}, "holding ratio 1"),
        ({"steps": [{"kind": "veto"}]}, "steps[0].floor must be set for a veto step"),
        ({"steps": [{"kind": "veto", "floor": 1.5}]}, "steps[0].floor must be a number in (0, 1)"),
        ({"steps": [{"kind": "k3_reject", "max_k3": 0}]}, "steps[0].max_k3 must be a finite number > 0"),
        (
            {"steps": [{"kind": "token_tis", "lower_clip": 2}]},
            "steps[0].lower_clip must be null or a number in (0, 1]",
        ),
        (
            {"steps": [{"kind": "token_tis", "floor": 0.1}]},
            "steps[0].floor is not a setting of a token_tis step",
        ),
        ({"steps": [{"kind": "tis"}]}, "steps[0].kind must be one of ['token_tis', 'sequence_tis'"),
        ({"steps": [{"kind": "token_tis"}, {"kind": "sequence_tis"}]}, "at most one TIS weight"),
        (
            {"steps": [{"kind": "veto", "floor": 0.1}, {"kind": "veto", "floor": 0.2}]},
            "each kind once, got 'veto' 2",
        ),
        ({"mode": "token_tis", "steps": [{"kind": "veto", "floor": 0.1}]}, "mode and steps are two forms"),
        ({"threshold": 0.5, "mode": "token_tis"}, "threshold must be a number >= 1"),
        ({"steps": "token_tis"}, "steps must be a list of steps"),
    ],
)
def test_nonsense_is_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError) as info:
        CorrectionConfig(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
