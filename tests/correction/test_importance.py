"""The four corrections against float64 references written here, padded and packed, ragged."""

from __future__ import annotations

import math

import pytest
import torch

from r3lightning.correction import (
    CorrectionConfig,
    correction_weights,
    geometric_mask,
    sequence_tis,
    token_mask,
    token_tis,
)
from r3lightning.packed import PackedTensor

LENGTHS = [5, 1, 8, 0, 3, 6]  # ragged, with an empty sequence
BIAS = [0.3, 0.0, 0.1, 0.0, -0.25, 0.15]  # per-sequence drift: sums and means cross caps and bands


def _sequences(seed: int = 0) -> tuple[list[list[float]], list[list[int]]]:
    """Log-ratios wide enough to cross every cap and band, and a loss mask with holes."""
    g = torch.Generator().manual_seed(seed)
    ratios = [
        (torch.randn(n, generator=g, dtype=torch.float64) * 0.6 + b).tolist()
        for n, b in zip(LENGTHS, BIAS, strict=True)
    ]
    masks = [[int(v) for v in (torch.rand(n, generator=g) > 0.25).tolist()] for n in LENGTHS]
    masks[2][0] = 0
    return ratios, masks


def ref_token_tis(x, m, c):
    return [
        [min(math.exp(v), c) if k else 0.0 for v, k in zip(xs, ms, strict=True)]
        for xs, ms in zip(x, m, strict=True)
    ]


def ref_sequence_tis(x, m, c):
    out = []
    for xs, ms in zip(x, m, strict=True):
        w = min(math.exp(sum(v for v, k in zip(xs, ms, strict=True) if k)), c)
        out.append([w if k else 0.0 for k in ms])
    return out


def ref_geometric_mask(x, m, lo, hi):
    out = []
    for xs, ms in zip(x, m, strict=True):
        n = sum(ms)
        ratio = math.exp(sum(v for v, k in zip(xs, ms, strict=True) if k) / n) if n else 1.0
        out.append([float(k and lo <= ratio <= hi) for k in ms])
    return out


def ref_token_mask(x, m, lo, hi):
    return [
        [float(k and lo <= math.exp(v) <= hi) for v, k in zip(xs, ms, strict=True)]
        for xs, ms in zip(x, m, strict=True)
    ]


CASES = [  # (function, reference, keywords: non-default on purpose, the defaults)
    (token_tis, ref_token_tis, {"threshold": 1.3}, {"threshold": 2.0}),
    (sequence_tis, ref_sequence_tis, {"threshold": 1.7}, {"threshold": 2.0}),
    (geometric_mask, ref_geometric_mask, {"lower": 0.8, "upper": 1.25}, {"lower": 0.5, "upper": 2.0}),
    (token_mask, ref_token_mask, {"lower": 0.7, "upper": 1.6}, {"lower": 0.5, "upper": 2.0}),
]
IDS = [case[0].__name__ for case in CASES]


def padded(rows, dtype=torch.float64, fill=float("nan")):
    """Left-padded ``[B, T]``; ``fill`` (NaN: garbage) where there is no token."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, width - len(r) :] = torch.tensor(r, dtype=torch.float64).to(dtype)
    return out


def packed(rows, dtype=torch.float64):
    return PackedTensor.from_segments([torch.tensor(r, dtype=torch.float64).to(dtype) for r in rows])


def _garbage_on_masked(x, m):
    """The same log-ratios with NaN / +-inf wherever the mask is 0: must not matter."""
    junk = [float("nan"), float("inf"), -float("inf")]
    return [
        [v if k else junk[(i + t) % 3] for t, (v, k) in enumerate(zip(xs, ms, strict=True))]
        for i, (xs, ms) in enumerate(zip(x, m, strict=True))
    ]


def _args(ref, kw):
    return (kw["threshold"],) if "threshold" in kw else (kw["lower"], kw["upper"])


@pytest.mark.parametrize("fn,ref,kw,defaults", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padded_matches_reference(fn, ref, kw, defaults, dtype):
    x, m = _sequences()
    expected = padded(ref(x, m, *_args(ref, kw)), fill=0.0)
    got = fn(padded(_garbage_on_masked(x, m), dtype), padded(m, torch.float32, fill=0.0), **kw)
    assert got.dtype == dtype and got.shape == expected.shape and not got.requires_grad
    tol = 1e-12 if dtype == torch.float64 else 2e-7
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
    # each setting is honoured: the defaults give another answer on these tokens
    assert not torch.equal(fn(padded(x, dtype, 0.0), padded(m, torch.float32, 0.0), **defaults), got)


@pytest.mark.parametrize("fn,ref,kw,defaults", CASES, ids=IDS)
@pytest.mark.parametrize("packed_mask", [True, False])
def test_packed_matches_reference_and_padded(fn, ref, kw, defaults, packed_mask):
    x, m = _sequences(1)
    log_ratio = packed(_garbage_on_masked(x, m))
    mask = packed(m, torch.bool)
    got = fn(log_ratio, mask if packed_mask else mask.values, **kw)
    assert isinstance(got, PackedTensor) and got.dtype == torch.float64
    assert torch.equal(got.cu_seqlens_host, log_ratio.cu_seqlens_host)
    expected = packed(ref(x, m, *_args(ref, kw)))
    torch.testing.assert_close(got.values, expected.values, rtol=1e-12, atol=1e-12)
    same = fn(padded(x), padded(m, fill=0), **kw)  # the padded path agrees token by token
    torch.testing.assert_close(PackedTensor.from_padded(same, LENGTHS).values, got.values)


@pytest.mark.parametrize("fn,ref,kw,defaults", CASES, ids=IDS)
def test_weights_are_detached_and_keep_bfloat16(fn, ref, kw, defaults):
    x, m = _sequences(2)
    log_ratio = padded(x, torch.bfloat16, 0.0).requires_grad_()
    got = fn(log_ratio * 1.0, padded(m, fill=0), **kw)
    assert got.dtype == torch.bfloat16 and not got.requires_grad and got.grad_fn is None
    assert (got[padded(m, fill=0) == 0] == 0).all()


def test_sequence_tis_caps_overflowing_sums_and_weighs_whole_sequences():
    log_ratio = torch.tensor([[400.0, 400.0, 1.0], [0.1, -0.3, 0.05]], dtype=torch.float32)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    got = sequence_tis(log_ratio, mask, threshold=3.0)  # exp(800) overflows float32 and float64
    assert got[0].tolist() == [3.0, 3.0, 0.0]
    assert got[1].tolist() == pytest.approx([math.exp(-0.15)] * 3, rel=1e-6)


def test_geometric_mask_uses_the_mean_not_the_sum_and_band_edges_are_kept():
    # sum 1.2 (ratio 3.3, outside [0.5, 2]) but mean 0.3 (ratio 1.35, inside): kept
    kept = geometric_mask(torch.tensor([[0.4, 0.4, 0.4]]), torch.ones(1, 3))
    assert kept.tolist() == [[1.0, 1.0, 1.0]]
    edge = torch.tensor([[math.log(0.5), math.log(2.0), 0.0]], dtype=torch.float64)
    assert token_mask(edge, torch.ones(1, 3), lower=0.5, upper=2.0).tolist() == [[1.0, 1.0, 1.0]]
    assert token_mask(edge, torch.ones(1, 3), lower=0.51, upper=1.99).tolist() == [[0.0, 0.0, 1.0]]


def test_correction_weights_dispatches_on_the_config():
    x, m = _sequences(3)
    log_ratio, mask = padded(x, fill=0.0), padded(m, fill=0)
    none = correction_weights(log_ratio, mask, CorrectionConfig())
    assert torch.equal(none, mask.double())
    cases = {
        "token_tis": token_tis(log_ratio, mask, threshold=1.5),
        "sequence_tis": sequence_tis(log_ratio, mask, threshold=1.5),
        "geometric_mask": geometric_mask(log_ratio, mask, lower=0.9, upper=1.1),
        "token_mask": token_mask(log_ratio, mask, lower=0.9, upper=1.1),
    }
    for mode, expected in cases.items():
        config = CorrectionConfig(mode=mode, threshold=1.5, lower=0.9, upper=1.1)
        assert torch.equal(correction_weights(log_ratio, mask, config), expected), mode


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"mode": "tis"},
            r"mode must be one of \['none', 'token_tis', 'sequence_tis', 'geometric_mask', 'token_mask'\], got 'tis'",
        ),
        ({"threshold": 0.0}, "threshold must be a number >= 1"),
        ({"threshold": "2"}, "threshold must be a number, got '2'"),
        (
            {"lower": 2.0, "upper": 1.0},
            r"0 <= lower <= 1 <= upper and lower < upper .*, got lower=2.0, upper=1.0",
        ),
        ({"lower": -0.1}, "0 <= lower <= 1 <= upper"),
        ({"upper": float("nan")}, "upper must be a number, got nan"),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CorrectionConfig(**kwargs)


def test_bad_inputs_are_clear_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"mask must have log_ratio's shape \(2, 3\) on cpu, got \(2, 4\)"):
        token_tis(x, torch.ones(2, 4))
    with pytest.raises(
        ValueError, match=r"log_ratio must be a padded \[B, T\] tensor or a PackedTensor, got \(6,\)"
    ):
        token_tis(torch.zeros(6), torch.ones(6))
    with pytest.raises(ValueError, match=r"floating-point tensor, got dtype torch\.int64"):
        token_mask(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))
    with pytest.raises(ValueError, match="threshold must be a number >= 1"):
        sequence_tis(x, torch.ones(2, 3), threshold=-1.0)
    with pytest.raises(ValueError, match="0 <= lower <= 1 <= upper and lower < upper"):
        geometric_mask(x, torch.ones(2, 3), lower=1.0, upper=1.0)
    a = PackedTensor.from_lengths(torch.zeros(5), [2, 3])
    with pytest.raises(ValueError, match="mask must be a PackedTensor with log_ratio's cu_seqlens"):
        token_tis(a, PackedTensor.from_lengths(torch.ones(5), [3, 2]))
    with pytest.raises(ValueError, match=r"per-token values \(row_shape \(\)\), got \(2,\)"):
        token_tis(PackedTensor.from_lengths(torch.zeros(5, 2), [2, 3]), torch.ones(5, 2))
