"""PackedTensor on devices and in batches: dtype and device moves without reading device offsets,
pinning, equality, pickling, and Lightning / DataLoader batch moving."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch
from packed_reference import LENGTHS, ROW_SHAPE, as_np, assert_segments, make_segments, ref_padded
from runif import run_if
from torch.utils.data._utils.pin_memory import pin_memory as dataloader_pin_memory

from r3lightning import PackedTensor

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


@run_if(cuda=True)
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


@run_if(cuda=True)
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
