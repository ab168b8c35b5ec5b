"""PackedTensor: exact values against simple numpy references, views vs copies, validation errors,
pickling, and Lightning / DataLoader batch moving."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory as dataloader_pin_memory

from r3lightning import PackedTensor
from r3lightning.ragged import (
    batch_index,
    host_int64,
    host_lengths,
    offsets_from_lengths,
    padded_flat_index,
    segment_ids_and_positions,
    tensor_from_bytes,
    tensor_to_bytes,
    to_device_async,
)

ROW_SHAPE = (2, 3)


def make_segments(lengths, row_shape=ROW_SHAPE, dtype=torch.int16, seed=0):
    """Random segments as torch tensors plus their int64 numpy references."""
    rng = np.random.default_rng(seed)
    refs = [rng.integers(0, 100, size=(n, *row_shape)) for n in lengths]
    return [torch.from_numpy(r).to(dtype) for r in refs], refs


def ref_padded(refs, width, row_shape, pad, side):
    """Deliberately simple padded reference: one segment at a time."""
    out = np.full((len(refs), width, *row_shape), pad, dtype=np.int64)
    for i, seg in enumerate(refs):
        if len(seg):
            if side == "left":
                out[i, width - len(seg) :] = seg
            else:
                out[i, : len(seg)] = seg
    return out


def as_np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.int64).numpy()


def assert_segments(pt: PackedTensor, refs) -> None:
    assert len(pt) == len(refs)
    assert pt.lengths.tolist() == [len(r) for r in refs]
    for i, ref in enumerate(refs):
        np.testing.assert_array_equal(as_np(pt[i]), ref)
    expected_cu = np.concatenate([[0], np.cumsum([len(r) for r in refs])]).astype(np.int32)
    np.testing.assert_array_equal(pt.cu_seqlens.numpy(), expected_cu)
    np.testing.assert_array_equal(pt.cu_seqlens_host.numpy(), expected_cu)
    assert pt.cu_seqlens.dtype == torch.int32 and pt.cu_seqlens_host.dtype == torch.int32


LENGTHS = [3, 0, 5, 1, 0, 4]


@pytest.fixture
def packed():
    segments, refs = make_segments(LENGTHS)
    return PackedTensor.from_segments(segments), refs


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


def test_ragged_batch_index_lengths_and_bytes_helpers():
    assert batch_index(-2, 6, owner="X", unit="row") == 4
    assert batch_index(slice(5, 1), 6, owner="X", unit="row") == slice(5, 5)
    assert batch_index(slice(4, 1, 2), 6, owner="X", unit="row").tolist() == []
    assert batch_index(slice(5, None, -2), 6, owner="X", unit="row").tolist() == [5, 3, 1]
    assert batch_index((1, -1), 6, owner="X", unit="row").tolist() == [1, 5]
    assert batch_index(np.array([True, False, True]), 3, owner="X", unit="row").tolist() == [0, 2]
    with pytest.raises(IndexError, match=r"row 3 is out of range for a X of 3 rows"):
        batch_index(torch.tensor([0, 3]), 3, owner="X", unit="row")
    with pytest.raises(TypeError, match="unsupported X index of type str"):
        batch_index("0", 3, owner="X", unit="row")

    assert host_lengths(np.array([2, 0], dtype=np.uint8), "n").tolist() == [2, 0]
    with pytest.raises(ValueError, match=r"n must hold ints, got \[1, True\]"):
        host_lengths([1, True], "n")
    with pytest.raises(ValueError, match=r"n must be >= 0, got \[1, -1\]"):
        host_lengths(torch.tensor([1, -1]), "n")

    for tensor in (torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16), torch.empty(0, 3, dtype=torch.int64)):
        raw, dtype_name, shape = tensor_to_bytes(tensor)
        raw.flags.writeable = False  # as an out-of-band pickle buffer may be
        back = tensor_from_bytes(raw, dtype_name, shape)
        assert back.dtype == tensor.dtype and torch.equal(back, tensor)


def test_ragged_index_helpers():
    lengths = torch.tensor([2, 0, 3])
    assert offsets_from_lengths(lengths).tolist() == [0, 2, 2, 5]
    assert offsets_from_lengths(lengths).dtype == torch.int32
    segment, position = segment_ids_and_positions(lengths)
    assert segment.tolist() == [0, 0, 2, 2, 2] and position.tolist() == [0, 1, 0, 1, 2]
    # [3, 4] grid: left padding puts each segment at the right end of its row
    assert padded_flat_index(lengths, 4, "left").tolist() == [2, 3, 9, 10, 11]
    assert padded_flat_index(lengths, 4, "right").tolist() == [0, 1, 8, 9, 10]
    assert host_int64(np.array([1, 2], dtype=np.uint8), "n").dtype == torch.int64
    assert host_int64([], "n").shape == (0,)
    host = torch.arange(3)
    assert to_device_async(host, torch.device("cpu")) is host
    assert to_device_async(host, torch.device("meta")).device.type == "meta"
    with pytest.raises(ValueError, match=r"counts must be >= 0, got counts\[0\] = -2"):
        offsets_from_lengths(torch.tensor([-2]), "counts")
    with pytest.raises(ValueError, match=r"n must hold integers, got dtype torch\.bool"):
        host_int64(torch.tensor([True]), "n")


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


# ---------------------------------------------------------------------- device and memory


def test_to_dtype_keeps_int32_offsets_and_returns_self_when_unchanged(packed):
    pt, refs = packed
    assert pt.to() is pt and pt.to("cpu") is pt and pt.to(dtype=torch.int16) is pt
    wide = pt.to(dtype=torch.int64)
    assert wide.dtype == torch.int64 and wide.cu_seqlens.dtype == torch.int32
    assert_segments(wide, refs)
    as_float = pt.to(torch.float32)
    assert as_float.dtype == torch.float32 and as_float.lengths.tolist() == LENGTHS


def test_ops_never_read_device_offsets():
    """On the meta device tensors hold no data, so any read of device offsets would fail:
    these ops succeed because they plan everything from ``cu_seqlens_host``."""
    segments, _ = make_segments([3, 0, 2, 4])
    meta = PackedTensor.from_segments(segments).to("meta", non_blocking=True)
    assert meta.device.type == "meta" and meta.cu_seqlens.device.type == "meta"
    assert meta.cu_seqlens_host.device.type == "cpu"
    assert meta[3].shape == (4, *ROW_SHAPE)
    assert meta[1:3].lengths.tolist() == [0, 2] and meta[1:3].cu_seqlens.device.type == "meta"
    assert meta[[3, 0]].lengths.tolist() == [4, 3] and meta[::2].num_rows == 5
    assert meta.repeat(2).lengths.tolist() == [3, 0, 2, 4] * 2
    assert meta.repeat_interleave([0, 1, 2, 1]).num_rows == 8
    assert PackedTensor.cat([meta, meta[2:]]).num_rows == 15
    assert meta.to_padded(max_len=6).shape == (4, 6, *ROW_SHAPE)
    assert PackedTensor.from_padded(torch.empty(4, 5, *ROW_SHAPE, device="meta"), [1, 2, 3, 4]).num_rows == 10
    assert meta.to(dtype=torch.int64).dtype == torch.int64 and "device=meta" in repr(meta)
    assert PackedTensor(meta.values, meta.cu_seqlens, cu_seqlens_host=meta.cu_seqlens_host).num_rows == 9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ops_never_synchronise():
    segments, refs = make_segments([3, 0, 2, 4])
    pinned = PackedTensor.from_segments(segments).pin_memory()
    torch.cuda.set_sync_debug_mode("error")  # any device->host sync raises
    try:
        gpu = pinned.to("cuda", non_blocking=True)
        view, gathered = gpu[1:3], gpu[[3, 0]]
        padded = gpu.to_padded(max_len=6, pad=-1)
        outs = [gpu[::2], gpu.repeat(2), gpu.repeat_interleave(2), PackedTensor.cat([gpu, view])]
        back = PackedTensor.from_padded(padded, gpu.lengths)
        wide = gpu.to(dtype=torch.int64)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert gpu.cu_seqlens.device.type == "cuda"
    assert_segments(view.cpu(), refs[1:3])
    assert_segments(gathered.cpu(), [refs[3], refs[0]])
    np.testing.assert_array_equal(as_np(padded.cpu()), ref_padded(refs, 6, ROW_SHAPE, -1, "left"))
    expected = [refs[::2], refs + refs, [r for r in refs for _ in range(2)], refs + refs[1:3]]
    for out, want in zip(outs, expected, strict=True):
        assert_segments(out.cpu(), want)
    assert_segments(back.cpu(), refs)
    assert_segments(wide.cpu(), refs)


def test_moved_batch_owns_its_host_offsets():
    source = PackedTensor.from_lengths(torch.arange(6), [2, 4])
    moved = source.to("meta")
    source.cu_seqlens_host[1] = 3  # a pooled collation buffer rewritten for the next batch
    assert moved.lengths.tolist() == [2, 4]


def test_contiguous_and_clone(packed):
    pt, _ = packed
    assert pt.contiguous() is pt
    strided = PackedTensor.from_lengths(torch.arange(20).reshape(2, 10).t(), [4, 6])
    assert not strided.values.is_contiguous()
    dense = strided.contiguous()
    assert dense.values.is_contiguous() and dense.equal(strided)
    clone = pt[2:3].clone()
    assert clone.equal(pt[2:3])
    assert clone.values.untyped_storage().nbytes() == 5 * 6 * 2


def test_equality(packed):
    pt, _ = packed
    same = PackedTensor.from_lengths(pt.values.clone(), LENGTHS)
    assert (pt == same) is True and pt.equal(same)
    assert (pt == PackedTensor.from_lengths(pt.values, [3, 0, 5, 1, 1, 3])) is False
    assert (pt == pt.to(torch.int32)) is False
    changed = same.clone()
    changed.values[0, 0, 0] += 1
    assert pt != changed
    assert pt != "not packed" and not pt.equal(pt.values)
    with pytest.raises(TypeError, match="unhashable"):
        hash(pt)


def test_repr():
    pt = PackedTensor.from_lengths(torch.zeros(6, 48, 8, dtype=torch.int16), [1, 0, 2, 3])
    assert repr(pt) == (
        "PackedTensor(segments=4, rows=6, row_shape=(48, 8), dtype=torch.int16, device=cpu, lengths=[1, 0, 2, 3])"
    )
    long = PackedTensor.from_lengths(torch.zeros(55), list(range(11)))
    assert "lengths=[0, 1, 2, 3, ..., 9, 10]" in repr(long) and "segments=11" in repr(long)


# ---------------------------------------------------------------------------------- pickling


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int16, torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.bool]
)
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_pickle_round_trip(dtype, protocol):
    segments, _ = make_segments([2, 0, 3], dtype=dtype)
    pt = PackedTensor.from_segments(segments)
    back = pickle.loads(pickle.dumps(pt, protocol=protocol))
    assert back.equal(pt) and back.dtype == dtype and back.cu_seqlens.dtype == torch.int32
    assert torch.equal(back.cu_seqlens, back.cu_seqlens_host)


def test_pickle_out_of_band_buffers_and_views_are_compact(packed):
    pt, _ = packed
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(pt, protocol=5, buffer_callback=buffers.append)
    back = pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in buffers])
    assert back.equal(pt)
    back.values.add_(1)  # the rebuilt values own writable memory
    big = PackedTensor.from_lengths(torch.zeros(10_000, 8, dtype=torch.int16), [5000, 5000])
    assert len(pickle.dumps(big[1:])) < 5000 * 16 + 1000  # only the view's rows travel
    assert len(pickle.dumps(big[[1]])) < 5000 * 16 + 1000


def test_copy_and_deepcopy(packed):
    pt, _ = packed
    shallow = copy.copy(pt)
    assert shallow.values is pt.values and shallow.equal(pt)
    deep = copy.deepcopy(pt)
    assert deep.equal(pt) and deep.values.data_ptr() != pt.values.data_ptr()


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
    with pytest.raises(ValueError, match=r"segment 0 has \(3,\) float32 cpu, segment 1 has \(3,\) int64 cpu"):
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


# ------------------------------------------------------------------- Lightning and DataLoader


@dataclasses.dataclass
class _Batch:
    input_ids: torch.Tensor
    routes: PackedTensor


def test_lightning_move_data_to_device_moves_nested_packed():
    from lightning.fabric.utilities.apply_func import move_data_to_device

    segments, _ = make_segments([2, 3])
    pt = PackedTensor.from_segments(segments)
    batch = {"ids": torch.zeros(2, 4), "nested": [{"routes": pt}], "obj": _Batch(torch.zeros(2, 4), pt)}
    moved = move_data_to_device(batch, torch.device("meta"))
    for routes in (moved["nested"][0]["routes"], moved["obj"].routes):
        assert isinstance(routes, PackedTensor)
        assert routes.device.type == "meta" and routes.cu_seqlens.device.type == "meta"
        assert routes.lengths.tolist() == [2, 3]
    assert moved["obj"].input_ids.device.type == "meta"
    assert move_data_to_device(batch, "cpu")["nested"][0]["routes"] is pt  # already there: untouched


def test_lightning_trainer_transfers_packed_batch(tmp_path):
    import lightning.pytorch as pl

    segments, refs = make_segments([2, 0, 3], dtype=torch.int32)
    seen: list[object] = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            seen.append(batch)
            return self.layer(batch.input_ids).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    batch = _Batch(torch.ones(3, 4), PackedTensor.from_segments(segments))
    loader = torch.utils.data.DataLoader([batch], batch_size=None, collate_fn=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Module(), loader)
    (got,) = seen
    assert isinstance(got.routes, PackedTensor)
    assert_segments(got.routes, refs)


def test_dataloader_pinning_dispatches_to_packed_pin_memory():
    segments, refs = make_segments([2, 3])
    batch = {"routes": PackedTensor.from_segments(segments), "ids": torch.zeros(2)}
    if torch.cuda.is_available():
        pinned = dataloader_pin_memory(batch)
        assert pinned["routes"].is_pinned() and pinned["routes"].cu_seqlens_host.is_pinned()
        assert_segments(pinned["routes"], refs)
        loader = torch.utils.data.DataLoader([0], collate_fn=lambda _: batch, pin_memory=True)
        assert next(iter(loader))["routes"].is_pinned()
        return
    # Without an accelerator torch refuses to pin; the refusal must come from inside
    # PackedTensor.pin_memory, which proves DataLoader pinning dispatches to it.
    assert not batch["routes"].is_pinned()
    with pytest.raises(RuntimeError, match="accelerator") as excinfo:
        dataloader_pin_memory({"routes": batch["routes"]})
    frames = [(entry.path.name, entry.name) for entry in excinfo.traceback]
    assert ("packed.py", "pin_memory") in frames


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


def test_device_side_offsets_of_views_and_gathers_follow_the_gpu_code_path_on_the_cpu():
    """The device ``cu_seqlens`` (not only the host copy) of every derived PackedTensor equals
    offsets computed by hand; on the CPU the same ops run as on a GPU (a separate device tensor)."""
    lengths = [3, 0, 2, 4, 1]
    values = torch.arange(sum(lengths) * 2).reshape(-1, 2)
    host = torch.tensor([0, 3, 3, 5, 9, 10], dtype=torch.int32)
    packed = PackedTensor(values, host.clone(), cu_seqlens_host=host)  # device offsets: own storage

    def offsets(picked):
        out = [0]
        for i in picked:
            out.append(out[-1] + lengths[i])
        return out

    cases = {
        "view 1:4": (packed[1:4], [1, 2, 3]),
        "view 3:": (packed[3:], [3, 4]),
        "view of a view": (packed[1:5][1:3], [2, 3]),
        "strided": (packed[::2], [0, 2, 4]),
        "list": (packed[[4, 0, 3]], [4, 0, 3]),
        "mask": (packed[torch.tensor([True, False, False, True, True])], [0, 3, 4]),
        "repeat_interleave": (packed[2:4].repeat_interleave(2), [2, 2, 3, 3]),
        "repeat": (packed[3:5].repeat(2), [3, 4, 3, 4]),
        "cat": (PackedTensor.cat([packed[3:], packed[:1]]), [3, 4, 0]),
        "dtype": (packed[1:4].to(dtype=torch.int16), [1, 2, 3]),
    }
    for name, (out, picked) in cases.items():
        expected = torch.tensor(offsets(picked), dtype=torch.int32)
        assert out.cu_seqlens.dtype == torch.int32, name
        assert torch.equal(out.cu_seqlens, expected), (name, out.cu_seqlens.tolist(), expected.tolist())
        assert torch.equal(out.cu_seqlens_host, expected), name
        rows = torch.cat([values[int(host[i]) : int(host[i + 1])] for i in picked])
        assert torch.equal(out.values.long(), rows), name
    # a view's device offsets come from the device offsets, as on a GPU
    view = packed[1:4]
    assert view.cu_seqlens.data_ptr() != view.cu_seqlens_host.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pageable_host_maps_are_staged_and_fenced_on_the_way_to_the_gpu():
    from r3lightning.ragged import to_device_async

    device = torch.device("cuda")
    host = torch.arange(1 << 16)
    torch.cuda._sleep(50_000_000)  # the copy queues behind ~tens of ms of GPU work
    moved = to_device_async(host, device)
    expected = host.clone()
    host.fill_(-1)  # the caller may reuse its pageable map right away
    for _ in range(8):  # staging blocks handed out meanwhile must not be the one in flight
        to_device_async(torch.full((1 << 16,), 7), device)
    assert torch.equal(moved.cpu(), expected)
