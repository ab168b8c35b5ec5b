"""PackedTensor construction, indexing, reordering and validation: exact values against simple numpy
references, views vs copies, error messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from packed_reference import LENGTHS, ROW_SHAPE, as_np, assert_segments, make_segments, ref_padded

from r3lightning import PackedTensor

# ----------------------------------------------------------------------------- construction


def test_constructor_and_properties(packed):
    pt, refs = packed
    direct = PackedTensor(pt.values, torch.tensor([0, 3, 3, 8, 9, 9, 13], dtype=torch.int32))
    assert direct.equal(pt)
    assert len(pt) == 6 and pt.num_rows == 13 and pt.row_shape == ROW_SHAPE
    assert pt.dtype == torch.int16 and pt.device == torch.device("cpu")
    assert pt.lengths.dtype == torch.int64 and pt.lengths.tolist() == LENGTHS
    assert pt.max_length == 5
    assert pt.segment_ids().tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 3, 5, 5, 5, 5]
    assert pt.segment_positions().tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 1, 2, 3]
    assert_segments(pt, refs)


def test_from_lengths_keeps_storage_and_accepts_all_length_types():
    values = torch.arange(12).reshape(6, 2)
    for lengths in ([2, 0, 4], np.array([2, 0, 4]), torch.tensor([2, 0, 4], dtype=torch.int32)):
        pt = PackedTensor.from_lengths(values, lengths)
        assert pt.values.data_ptr() == values.data_ptr()
        assert pt.lengths.tolist() == [2, 0, 4]
        assert pt[2].tolist() == [[4, 5], [6, 7], [8, 9], [10, 11]]


def test_from_segments_numpy_and_mixed_and_read_only():
    _, refs = make_segments([2, 0, 3], dtype=torch.int32)
    arrays = [r.astype(np.int32) for r in refs]
    read_only = np.frombuffer(arrays[2].tobytes(), dtype=np.int32).reshape(arrays[2].shape)
    pt_np = PackedTensor.from_segments([arrays[0], arrays[1], read_only])
    pt_mixed = PackedTensor.from_segments([torch.from_numpy(arrays[0]), arrays[1], read_only])
    for pt in (pt_np, pt_mixed):
        assert pt.dtype == torch.int32
        assert_segments(pt, refs)


def test_from_segments_copies(packed):
    segments, _ = make_segments([2])
    pt = PackedTensor.from_segments(segments)
    pt.values.fill_(7)
    assert not torch.equal(segments[0], pt.values)


@pytest.mark.parametrize("side", ["left", "right"])
def test_to_padded_matches_reference(packed, side):
    pt, refs = packed
    np.testing.assert_array_equal(as_np(pt.to_padded(side=side)), ref_padded(refs, 5, ROW_SHAPE, 0, side))
    np.testing.assert_array_equal(
        as_np(pt.to_padded(max_len=8, pad=-3, side=side)), ref_padded(refs, 8, ROW_SHAPE, -3, side)
    )
    row = torch.arange(6, dtype=torch.int16).reshape(ROW_SHAPE)
    padded = pt.to_padded(max_len=6, pad=row, side=side)
    expected = ref_padded(refs, 6, ROW_SHAPE, 0, side)
    mask = np.zeros((len(refs), 6), dtype=bool)
    for i, r in enumerate(refs):
        if side == "left":
            mask[i, 6 - len(r) :] = True
        else:
            mask[i, : len(r)] = True
    expected[~mask] = row.numpy()
    np.testing.assert_array_equal(as_np(padded), expected)


@pytest.mark.parametrize("side", ["left", "right"])
def test_from_padded_round_trip(packed, side):
    pt, refs = packed
    padded = torch.from_numpy(ref_padded(refs, 7, ROW_SHAPE, 99, side)).to(torch.int16)
    back = PackedTensor.from_padded(padded, [len(r) for r in refs], side=side)
    assert back.equal(pt)
    assert back.values.untyped_storage().data_ptr() != padded.untyped_storage().data_ptr()


def test_empty_and_zero_segments():
    empty = PackedTensor.empty((4, 2), dtype=torch.uint8)
    assert len(empty) == 0 and empty.num_rows == 0 and empty.row_shape == (4, 2)
    assert empty.to_padded().shape == (0, 0, 4, 2)
    assert empty.lengths.tolist() == [] and empty.max_length == 0
    assert empty.repeat(3).equal(empty)
    assert list(empty) == []
    all_empty = PackedTensor.from_lengths(torch.empty(0, 4, 2, dtype=torch.uint8), [0, 0, 0])
    assert len(all_empty) == 3 and all_empty.to_padded(max_len=2).shape == (3, 2, 4, 2)
    assert all_empty[1].shape == (0, 4, 2)
    assert PackedTensor.cat([empty, all_empty, empty]).equal(all_empty)
    assert PackedTensor.from_padded(torch.zeros(0, 5, 4, 2, dtype=torch.uint8), []).equal(empty)


# ----------------------------------------------------------------------------- indexing


def test_int_index_is_a_view(packed):
    pt, refs = packed
    np.testing.assert_array_equal(as_np(pt[-1]), refs[-1])
    seg = pt[2]
    assert seg.data_ptr() == pt.values[3].data_ptr()
    seg[0, 0, 0] = 1234
    assert int(pt.values[3, 0, 0]) == 1234
    assert pt[np.int64(3)].shape == (1, *ROW_SHAPE) and pt[torch.tensor(3)].shape == (1, *ROW_SHAPE)


def test_contiguous_slice_is_a_view(packed):
    pt, refs = packed
    view = pt[2:5]
    assert_segments(view, refs[2:5])
    assert view.values.data_ptr() == pt.values[3].data_ptr()
    assert_segments(pt[:0], [])
    assert_segments(pt[4:2], [])
    assert_segments(pt[-2:], refs[-2:])
    assert_segments(pt[::1], refs)
    view.values[-1] = -1
    assert (pt[3] == -1).all()


@pytest.mark.parametrize(
    "index",
    [
        slice(None, None, 2),
        slice(None, None, -1),
        [5, 0, 0, -1, 2],
        [],
        np.array([1, 3, 5]),
        torch.tensor([4, 2], dtype=torch.int32),
        [True, False, True, True, False, True],
        torch.tensor([False, True, True, False, False, True]),
        np.array([True] * 6),
    ],
    ids=[
        "step2",
        "reversed",
        "list",
        "empty-list",
        "ndarray",
        "tensor",
        "mask-list",
        "mask-tensor",
        "mask-np",
    ],
)
def test_gathers_match_reference_and_copy(packed, index):
    pt, refs = packed
    if isinstance(index, slice):
        picked = list(range(len(refs)))[index]
    else:
        arr = np.asarray(index.numpy() if isinstance(index, torch.Tensor) else index)
        picked = np.nonzero(arr)[0].tolist() if arr.dtype == bool else [int(i) % len(refs) for i in arr]
    gathered = pt[index]
    assert_segments(gathered, [refs[i] for i in picked])
    if gathered.num_rows:
        assert gathered.values.untyped_storage().data_ptr() != pt.values.untyped_storage().data_ptr()
        before = pt.values.clone()
        gathered.values.fill_(-5)
        assert torch.equal(pt.values, before)


def test_iteration_yields_segment_views(packed):
    pt, refs = packed
    segments = list(pt)
    assert len(segments) == len(refs)
    for seg, ref in zip(segments, refs, strict=True):
        np.testing.assert_array_equal(as_np(seg), ref)
    assert segments[0].data_ptr() == pt.values.data_ptr()


# --------------------------------------------------------------------------- reordering ops


def test_cat_repeat_repeat_interleave(packed):
    pt, refs = packed
    other, other_refs = make_segments([2, 6], seed=1)
    joined = PackedTensor.cat([pt, PackedTensor.from_segments(other), pt[1:3]])
    assert_segments(joined, refs + other_refs + refs[1:3])
    assert_segments(pt.repeat(2), refs + refs)
    assert_segments(pt.repeat(0), [])
    assert_segments(pt.repeat_interleave(2), [r for r in refs for _ in range(2)])
    assert pt.repeat_interleave(torch.tensor(2)).equal(pt.repeat_interleave(2))
    counts = [1, 0, 3, 2, 1, 0]
    assert_segments(
        pt.repeat_interleave(counts), [r for r, c in zip(refs, counts, strict=True) for _ in range(c)]
    )
    assert_segments(
        pt.repeat_interleave(torch.tensor(counts)),
        [r for r, c in zip(refs, counts, strict=True) for _ in range(c)],
    )
    for out in (joined, pt.repeat(1), pt.repeat_interleave(1)):
        assert out.values.untyped_storage().data_ptr() != pt.values.untyped_storage().data_ptr()


# ------------------------------------------------------------------------------- validation


def test_constructor_validation_errors():
    values = torch.zeros(5, 2)
    with pytest.raises(TypeError, match=r"values must be a torch\.Tensor"):
        PackedTensor(np.zeros(5), torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"cu_seqlens must be a torch\.Tensor"):
        PackedTensor(values, [0, 5])
    with pytest.raises(ValueError, match="0-d"):
        PackedTensor(torch.tensor(1.0), torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens must be int32, got torch\.int64"):
        PackedTensor(values, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-D .* got shape \(1, 2\)"):
        PackedTensor(values, torch.tensor([[0, 5]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-D .* got shape \(0,\)"):
        PackedTensor(values, torch.tensor([], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, got 1"):
        PackedTensor(values, torch.tensor([1, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"non-decreasing, got cu_seqlens\[1\] = 4 > cu_seqlens\[2\] = 3"):
        PackedTensor(values, torch.tensor([0, 4, 3, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="must end at the 5 rows of values, got 4"):
        PackedTensor(values, torch.tensor([0, 2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be on values' device meta, got cpu"):
        PackedTensor(torch.zeros(5, device="meta"), torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_host must be a CPU int32 tensor"):
        PackedTensor(values, torch.tensor([0, 5], dtype=torch.int32), cu_seqlens_host=torch.tensor([0, 5]))
    huge = torch.zeros(1, dtype=torch.uint8).expand(2**31)  # 2**31 rows, one byte of memory
    with pytest.raises(ValueError, match="more than int32 cu_seqlens can address"):
        PackedTensor(huge, torch.tensor([0, 0], dtype=torch.int32))


def test_factory_validation_errors():
    with pytest.raises(ValueError, match="lengths sum to 4 but values has 5 rows"):
        PackedTensor.from_lengths(torch.zeros(5), [1, 3])
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got lengths\[1\] = -1"):
        PackedTensor.from_lengths(torch.zeros(5), [6, -1])
    with pytest.raises(ValueError, match=r"lengths must hold integers, got dtype torch\.float32"):
        PackedTensor.from_lengths(torch.zeros(5), [2.0, 3.0])
    with pytest.raises(ValueError, match=r"lengths must be 1-D, got shape \(1, 2\)"):
        PackedTensor.from_lengths(torch.zeros(5), [[2, 3]])
    with pytest.raises(ValueError, match="0-d"):
        PackedTensor.from_lengths(torch.tensor(3), [])
    with pytest.raises(ValueError, match="more than int32 offsets can address"):
        PackedTensor.from_lengths(torch.zeros(1).expand(2**31), [2**31 - 1, 1])
    with pytest.raises(ValueError, match=r"PackedTensor.empty\(row_shape"):
        PackedTensor.from_segments([])
    with pytest.raises(ValueError, match=r"segment 0 has \(3,\) torch.float32 cpu, segment 1 has \(4,\)"):
        PackedTensor.from_segments([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(
        ValueError, match=r"segment 0 has \(3,\) torch.float32 cpu, segment 1 has \(3,\) torch.int64 cpu"
    ):
        PackedTensor.from_segments([np.zeros((2, 3), np.float32), np.zeros((1, 3), np.int64)])
    with pytest.raises(ValueError, match="segment 0 is 0-d"):
        PackedTensor.from_segments([torch.tensor(1.0)])
    with pytest.raises(TypeError, match="segments must be tensors or ndarrays, got list"):
        PackedTensor.from_segments([torch.zeros(1), [1.0]])
    with pytest.raises(ValueError, match=r"lengths\[1\] = 6 exceeds the padded width 5"):
        PackedTensor.from_padded(torch.zeros(2, 5), [5, 6])
    with pytest.raises(ValueError, match=r"one entry per row of padded \(2\), got 3"):
        PackedTensor.from_padded(torch.zeros(2, 5), [1, 1, 1])
    with pytest.raises(ValueError, match=r"padded must be a tensor \[B, S, \*row_shape\], got \(5,\)"):
        PackedTensor.from_padded(torch.zeros(5), [5])
    with pytest.raises(ValueError, match="side must be 'left' or 'right', got 'middle'"):
        PackedTensor.from_padded(torch.zeros(2, 5), [1, 1], side="middle")


def test_op_validation_errors(packed):
    pt, _ = packed
    with pytest.raises(ValueError, match=r"PackedTensor.empty\(row_shape"):
        PackedTensor.cat([])
    with pytest.raises(
        ValueError, match=r"part 0 has \(2, 3\) torch.int16 cpu, part 1 has \(2, 3\) torch.int32 cpu"
    ):
        PackedTensor.cat([pt, pt.to(torch.int32)])
    with pytest.raises(TypeError, match="cat takes PackedTensors, got Tensor at position 1"):
        PackedTensor.cat([pt, pt.values])
    with pytest.raises(ValueError, match=r"max_len = 4 is shorter than the longest segment \(5\)"):
        pt.to_padded(max_len=4)
    with pytest.raises(ValueError, match="side must be 'left' or 'right'"):
        pt.to_padded(side="both")
    with pytest.raises(ValueError, match="repeats must be >= 0, got -1"):
        pt.repeat(-1)
    with pytest.raises(ValueError, match=r"repeats must have one entry per segment \(6\), got 2"):
        pt.repeat_interleave([1, 2])
    with pytest.raises(ValueError, match="repeats must be >= 0"):
        pt.repeat_interleave([1, 1, 1, 1, 1, -1])
    with pytest.raises(ValueError, match="pin_memory needs CPU values, got device meta"):
        pt.to("meta").pin_memory()


def test_index_errors(packed):
    pt, _ = packed
    with pytest.raises(IndexError, match="segment 6 is out of range for a PackedTensor of 6 segments"):
        pt[6]
    with pytest.raises(IndexError, match="segment -7 is out of range"):
        pt[-7]
    with pytest.raises(IndexError, match="segment 9 is out of range"):
        pt[[0, 9]]
    with pytest.raises(IndexError, match=r"bool mask must have one entry per segment \(6\), got 2"):
        pt[torch.tensor([True, False])]
    with pytest.raises(IndexError, match=r"must hold integers or bools, got torch\.float32"):
        pt[torch.tensor([0.0])]
    with pytest.raises(IndexError, match=r"must be 1-D, got shape \(1, 1\)"):
        pt[torch.tensor([[0]])]
    with pytest.raises(TypeError, match="bool scalar"):
        pt[True]
    with pytest.raises(IndexError, match=r"must hold integers or bools, got torch\.float32"):
        pt[[0.5]]
    with pytest.raises(TypeError, match="indexed along segments only"):
        pt[0, 1]
    with pytest.raises(TypeError, match="unsupported PackedTensor index of type str"):
        pt["a"]


def test_to_padded_rejects_pads_the_values_cannot_hold(packed):
    pt, refs = packed
    np.testing.assert_array_equal(as_np(pt.to_padded(pad=-1)), ref_padded(refs, 5, ROW_SHAPE, -1, "left"))
    for bad in (70000, 0.5, float("nan")):  # int16 values: wrapped or truncated, never silently
        with pytest.raises(ValueError, match=r"is not representable in the dtype torch\.int16"):
            pt.to_padded(pad=bad)
    small = pt.to(torch.uint8)
    with pytest.raises(ValueError, match=r"pad -1 is not representable in the dtype torch\.uint8"):
        small.to_padded(pad=-1)
    with pytest.raises(ValueError, match=r"pad row of shape \(4,\) does not broadcast to row shape \(2, 3\)"):
        pt.to_padded(pad=torch.zeros(4))
    row = torch.tensor([7, 8, 9])  # broadcasts over the row's first axis
    got = pt.to_padded(pad=row, side="right")
    for i, n in enumerate(LENGTHS):
        np.testing.assert_array_equal(as_np(got[i, :n]), refs[i])
        assert (got[i, n:] == row.to(torch.int16)).all()


def test_repeat_interleave_rejects_non_integer_counts(packed):
    pt, _ = packed
    for bad in (1.5, True, [1.0] * 6, [True, 1, 1, 1, 1, 1], torch.tensor(2.0)):
        with pytest.raises(ValueError, match="repeats must"):
            pt.repeat_interleave(bad)
    assert pt.repeat_interleave(torch.tensor(2)).lengths.tolist() == [n for n in LENGTHS for _ in range(2)]


def test_empty_rejects_a_bad_row_shape():
    with pytest.raises(ValueError, match=r"row_shape must hold ints >= 0, got \(4, -1\)"):
        PackedTensor.empty((4, -1))
    with pytest.raises(ValueError, match=r"row_shape must hold ints >= 0, got \(2\.0,\)"):
        PackedTensor.empty((2.0,))
    assert PackedTensor.empty(torch.Size([3])).row_shape == (3,)
