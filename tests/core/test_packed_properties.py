"""Property-based PackedTensor tests: random lengths (zeros included), dtypes and row shapes,
each operation checked against a plain per-segment numpy reference."""

from __future__ import annotations

import pickle

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning import PackedTensor

DTYPES = [torch.uint8, torch.int16, torch.int32, torch.int64, torch.float32, torch.bfloat16]
ROW_SHAPES = [(), (3,), (2, 4)]

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def packed_batches(draw, min_segments=0):
    """A PackedTensor plus its per-segment int64 numpy reference."""
    lengths = draw(st.lists(st.integers(0, 6), min_size=min_segments, max_size=7))
    dtype = draw(st.sampled_from(DTYPES))
    row_shape = draw(st.sampled_from(ROW_SHAPES))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    # Small integers are exact in every dtype above, bfloat16 included.
    refs = [rng.integers(0, 120, size=(n, *row_shape)) for n in lengths]
    values = torch.from_numpy(np.concatenate([np.zeros((0, *row_shape), np.int64), *refs])).to(dtype)
    return PackedTensor.from_lengths(values, lengths), refs


def to_np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.int64).numpy()


def check(pt: PackedTensor, refs: list[np.ndarray]) -> None:
    assert len(pt) == len(refs)
    assert pt.lengths.tolist() == [len(r) for r in refs]
    assert pt.cu_seqlens.dtype == torch.int32
    assert torch.equal(pt.cu_seqlens.cpu(), pt.cu_seqlens_host)
    for i, ref in enumerate(refs):
        np.testing.assert_array_equal(to_np(pt[i]), ref)


def padded_reference(refs, width, row_shape, pad, side):
    out = np.full((len(refs), width, *row_shape), pad, dtype=np.int64)
    for i, seg in enumerate(refs):
        n = len(seg)
        if n and side == "left":
            out[i, width - n :] = seg
        elif n:
            out[i, :n] = seg
    return out


@SETTINGS
@given(packed_batches(), st.sampled_from(["left", "right"]), st.integers(0, 3))
def test_padded_round_trip(batch, side, extra):
    pt, refs = batch
    check(pt, refs)
    width = pt.max_length + extra
    padded = pt.to_padded(max_len=width, pad=7, side=side)
    assert padded.dtype == pt.dtype
    np.testing.assert_array_equal(to_np(padded), padded_reference(refs, width, pt.row_shape, 7, side))
    assert PackedTensor.from_padded(padded, pt.lengths, side=side).equal(pt)


@SETTINGS
@given(packed_batches(), st.data())
def test_gather_and_slices(batch, data):
    pt, refs = batch
    count = len(refs)
    if count:
        picks = data.draw(st.lists(st.integers(-count, count - 1), max_size=9))
        check(pt[picks], [refs[i] for i in picks])
        check(pt[torch.tensor(picks, dtype=torch.int64)], [refs[i] for i in picks])
        mask = data.draw(st.lists(st.booleans(), min_size=count, max_size=count))
        check(pt[torch.tensor(mask)], [r for r, keep in zip(refs, mask, strict=True) if keep])
    start = data.draw(st.integers(-count - 2, count + 2))
    stop = data.draw(st.integers(-count - 2, count + 2))
    step = data.draw(st.sampled_from([None, 1, 2, 3, -1, -2]))
    check(pt[start:stop:step], refs[start:stop:step])


@SETTINGS
@given(packed_batches(), st.data())
def test_cat_of_splits_and_repeats(batch, data):
    pt, refs = batch
    count = len(refs)
    cut = data.draw(st.integers(0, count))
    assert PackedTensor.cat([pt[:cut], pt[cut:]]).equal(pt)
    times = data.draw(st.integers(0, 3))
    check(pt.repeat(times), refs * times)
    counts = data.draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    check(pt.repeat_interleave(counts), [r for r, c in zip(refs, counts, strict=True) for _ in range(c)])


@SETTINGS
@given(packed_batches(), st.sampled_from([2, 5]))
def test_pickle_and_dtype_round_trip(batch, protocol):
    pt, refs = batch
    back = pickle.loads(pickle.dumps(pt, protocol=protocol))
    assert back.equal(pt)
    check(back, refs)
    check(pt.to(dtype=torch.int64), refs)
    if pt.num_rows:
        view = pt[len(pt) - 1 :]
        assert pickle.loads(pickle.dumps(view)).equal(view)
