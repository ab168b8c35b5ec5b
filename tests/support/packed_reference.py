"""Random packed segments and deliberately simple numpy references for the PackedTensor tests."""

from __future__ import annotations

import numpy as np
import torch

from r3lightning import PackedTensor

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
