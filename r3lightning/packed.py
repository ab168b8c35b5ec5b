"""``PackedTensor``: a ragged batch stored as one dense buffer plus int32 offsets.

A batch of ``B`` variable-length segments (one per trajectory) is stored as

    values      [sum(lengths), *row_shape]   every real row, segment after segment
    cu_seqlens  [B + 1] int32                offsets on ``values``' device (what varlen kernels take)

with a CPU copy of the offsets (``cu_seqlens_host``) carried alongside. Every operation plans
its work from the host copy, so none of them reads offsets back from an accelerator: slicing,
gathering, padding and moving a GPU ``PackedTensor`` never synchronise with the device, except
where the *caller* hands in device-resident indices, lengths or offsets (documented per method).

Segment views (``pt[i]``, ``pt[a:b]``) alias ``values``; every reordering operation (gathers,
``cat``, ``repeat``, ``repeat_interleave``, ``to_padded``) returns new storage.
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from r3lightning.ragged import (
    INT32_MAX,
    LengthsLike,
    batch_index,
    check_fill_value,
    check_pad_row,
    check_side,
    host_int64,
    offsets_from_lengths,
    padded_flat_index,
    repeat_counts,
    segment_ids_and_positions,
    tensor_from_bytes,
    tensor_to_bytes,
    to_device_async,
)

__all__ = ["PackedTensor"]

# Index types accepted by ``PackedTensor.__getitem__``.
IndexLike = int | slice | Sequence[int] | Sequence[bool] | Tensor | np.ndarray


class PackedTensor:
    """Ragged batch: ``values [sum(len), *row_shape]`` plus int32 ``cu_seqlens [B + 1]``.

    Args:
        values: ``[rows, *row_shape]``, any dtype and device.
        cu_seqlens: int32 ``[B + 1]`` on ``values``' device, starting at 0, non-decreasing and
            ending at ``rows``. Segment ``i`` is ``values[cu_seqlens[i]:cu_seqlens[i + 1]]``.
        cu_seqlens_host: optional CPU int32 copy of ``cu_seqlens``. When ``cu_seqlens`` lives on an
            accelerator and this is not given, validation copies it to the host once (a sync);
            passing it avoids that sync, and it is then trusted to equal ``cu_seqlens``.

    Pickling sends only the referenced rows and the host offsets as raw bytes (any dtype,
    bfloat16 included) and restores the original device; pickling device values copies them to
    the host first (a sync).

    Raises:
        ValueError: naming the offending field and what was expected.
    """

    values: Tensor  # [rows, *row_shape]
    cu_seqlens: Tensor  # [B + 1] int32, on values.device
    cu_seqlens_host: Tensor  # [B + 1] int32, CPU

    __hash__ = None  # type: ignore[assignment]  # mutable tensors, value equality

    def __init__(self, values: Tensor, cu_seqlens: Tensor, *, cu_seqlens_host: Tensor | None = None) -> None:
        _check_values(values)
        if not isinstance(cu_seqlens, Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype != torch.int32:
            raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
            raise ValueError(
                f"cu_seqlens must be 1-D with B + 1 >= 1 entries, got shape {tuple(cu_seqlens.shape)}"
            )
        if cu_seqlens.device != values.device:
            raise ValueError(f"cu_seqlens must be on values' device {values.device}, got {cu_seqlens.device}")
        rows = values.shape[0]
        if rows > INT32_MAX:
            raise ValueError(f"values has {rows} rows, more than int32 cu_seqlens can address ({INT32_MAX})")
        if cu_seqlens_host is None:
            host = cu_seqlens.detach().cpu()  # the one sync, only for device offsets given by a user
        else:
            host = cu_seqlens_host
            if host.device.type != "cpu" or host.dtype != torch.int32 or host.shape != cu_seqlens.shape:
                raise ValueError(
                    f"cu_seqlens_host must be a CPU int32 tensor of shape {tuple(cu_seqlens.shape)}, got "
                    f"{host.dtype} {tuple(host.shape)} on {host.device}"
                )
        if int(host[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(host[0])}")
        steps = host[1:] - host[:-1]
        if steps.numel() and int(steps.min()) < 0:
            bad = int(torch.nonzero(steps < 0)[0, 0])
            raise ValueError(
                f"cu_seqlens must be non-decreasing, got cu_seqlens[{bad}] = {int(host[bad])} > "
                f"cu_seqlens[{bad + 1}] = {int(host[bad + 1])}"
            )
        if int(host[-1]) != rows:
            raise ValueError(f"cu_seqlens must end at the {rows} rows of values, got {int(host[-1])}")
        self.values = values
        self.cu_seqlens = cu_seqlens
        self.cu_seqlens_host = host

    @classmethod
    def _trusted(
        cls, values: Tensor, cu_seqlens_host: Tensor, cu_seqlens: Tensor | None = None
    ) -> PackedTensor:
        """Build from offsets this module computed itself: no validation, no sync."""
        out = cls.__new__(cls)
        out.values = values
        out.cu_seqlens = to_device_async(cu_seqlens_host, values.device) if cu_seqlens is None else cu_seqlens
        out.cu_seqlens_host = cu_seqlens_host
        return out

    # ----------------------------------------------------------------------------- factories

    @classmethod
    def from_lengths(cls, values: Tensor, lengths: LengthsLike) -> PackedTensor:
        """Pack ``values [sum(lengths), *row]`` as consecutive segments of ``lengths [B]``.

        ``values`` is kept as is (no copy). Device-resident ``lengths`` are read back once (a sync).
        """
        _check_values(values)
        offsets = offsets_from_lengths(host_int64(lengths, "lengths"))
        if int(offsets[-1]) != values.shape[0]:
            raise ValueError(f"lengths sum to {int(offsets[-1])} but values has {values.shape[0]} rows")
        return cls._trusted(values, offsets)

    @classmethod
    def from_segments(cls, segments: Sequence[Tensor | np.ndarray]) -> PackedTensor:
        """Concatenate segments ``[n_i, *row_shape]`` (tensors or ndarrays) into new storage.

        All segments must share ``row_shape``, dtype and device. One pass over the segment list
        (unavoidable: it is a Python list); the copy itself is a single ``torch.cat``.
        """
        if len(segments) == 0:
            raise ValueError(
                "from_segments needs at least one segment to infer row_shape and dtype; use "
                "PackedTensor.empty(row_shape, dtype=..., device=...) for a batch of zero segments"
            )
        if all(isinstance(s, np.ndarray) for s in segments):
            arrays = [np.asarray(s) for s in segments]
            _check_segment_schema([(a.shape, a.dtype, "cpu") for a in arrays])
            lengths = torch.tensor([a.shape[0] for a in arrays], dtype=torch.int64)
            offsets = offsets_from_lengths(lengths, "segment lengths")
            return cls._trusted(torch.from_numpy(np.concatenate(arrays, axis=0)), offsets)
        tensors = []
        with warnings.catch_warnings():
            # Read-only arrays (e.g. decoded from bytes) are only read by the concatenation below.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            for s in segments:
                if isinstance(s, np.ndarray):
                    tensors.append(torch.from_numpy(np.ascontiguousarray(s)))
                elif isinstance(s, Tensor):
                    tensors.append(s)
                else:
                    raise TypeError(f"segments must be tensors or ndarrays, got {type(s).__name__}")
        _check_segment_schema([(t.shape, t.dtype, t.device) for t in tensors])
        lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
        offsets = offsets_from_lengths(lengths, "segment lengths")
        return cls._trusted(torch.cat(tensors, dim=0), offsets)

    @classmethod
    def from_padded(cls, padded: Tensor, lengths: LengthsLike, side: str = "left") -> PackedTensor:
        """Gather the real rows of ``padded [B, S, *row]`` into new storage.

        With ``side="left"`` segment ``i`` is ``padded[i, S - lengths[i]:]``; with ``"right"``,
        ``padded[i, :lengths[i]]``. One ``index_select`` of the real rows; device-resident
        ``lengths`` are read back once (a sync).
        """
        check_side(side)
        if not isinstance(padded, Tensor) or padded.dim() < 2:
            shape = tuple(padded.shape) if isinstance(padded, Tensor) else type(padded).__name__
            raise ValueError(f"padded must be a tensor [B, S, *row_shape], got {shape}")
        batch, width = padded.shape[0], padded.shape[1]
        host_lengths = host_int64(lengths, "lengths")
        if host_lengths.numel() != batch:
            raise ValueError(
                f"lengths must have one entry per row of padded ({batch}), got {host_lengths.numel()}"
            )
        offsets = offsets_from_lengths(host_lengths)
        if batch and int(host_lengths.max()) > width:
            bad = int(torch.argmax(host_lengths))
            raise ValueError(f"lengths[{bad}] = {int(host_lengths[bad])} exceeds the padded width {width}")
        flat = padded_flat_index(host_lengths, width, side)
        values = padded.flatten(0, 1).index_select(0, to_device_async(flat, padded.device))
        return cls._trusted(values, offsets)

    @classmethod
    def empty(
        cls,
        row_shape: Sequence[int] = (),
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> PackedTensor:
        """A batch of zero segments with the given row schema."""
        row_shape = tuple(row_shape)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in row_shape):
            raise ValueError(f"row_shape must hold ints >= 0, got {row_shape}")
        values = torch.empty((0, *row_shape), dtype=dtype, device=device)
        return cls._trusted(values, torch.zeros(1, dtype=torch.int32))

    @staticmethod
    def cat(parts: Sequence[PackedTensor]) -> PackedTensor:
        """Concatenate the segments of ``parts`` (same row_shape, dtype, device) into new storage."""
        parts = list(parts)
        if not parts:
            raise ValueError(
                "cat needs at least one PackedTensor to infer row_shape, dtype and device; use "
                "PackedTensor.empty(row_shape, dtype=..., device=...) for a batch of zero segments"
            )
        for i, p in enumerate(parts):
            if not isinstance(p, PackedTensor):
                raise TypeError(f"cat takes PackedTensors, got {type(p).__name__} at position {i}")
        first = parts[0]
        for i, p in enumerate(parts[1:], start=1):
            if (p.row_shape, p.dtype, p.device) != (first.row_shape, first.dtype, first.device):
                raise ValueError(
                    f"cat needs equal row_shape, dtype and device; part 0 has {first.row_shape} "
                    f"{first.dtype} {first.device}, part {i} has {p.row_shape} {p.dtype} {p.device}"
                )
        lengths = torch.cat([p.lengths for p in parts])
        offsets = offsets_from_lengths(lengths, "cat lengths")
        return PackedTensor._trusted(torch.cat([p.values for p in parts], dim=0), offsets)

    # ---------------------------------------------------------------------------- properties

    @property
    def lengths(self) -> Tensor:
        """Host int64 ``[B]`` segment lengths (computed from the host offsets, no sync)."""
        host = self.cu_seqlens_host
        return (host[1:] - host[:-1]).to(torch.int64)

    @property
    def num_rows(self) -> int:
        return self.values.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def max_length(self) -> int:
        """Longest segment (0 for an empty batch); host only."""
        return int(self.lengths.max()) if len(self) else 0

    def __len__(self) -> int:
        return self.cu_seqlens_host.numel() - 1

    def segment_ids(self) -> Tensor:
        """Host int64 ``[rows]``: the segment each row belongs to."""
        return segment_ids_and_positions(self.lengths)[0]

    def segment_positions(self) -> Tensor:
        """Host int64 ``[rows]``: each row's position within its segment."""
        return segment_ids_and_positions(self.lengths)[1]

    # ------------------------------------------------------------------------------ indexing

    def __getitem__(self, index: IndexLike) -> Tensor | PackedTensor:
        """``int`` -> segment view ``[len_i, *row]``; step-1 slice -> ``PackedTensor`` view;
        strided slice, list, index tensor/array or bool mask -> gathered ``PackedTensor`` copy.

        Device-resident index tensors and masks are read back once (a sync).
        """
        if isinstance(index, tuple):
            raise TypeError(
                "a PackedTensor is indexed along segments only; index the segment's tensor for rows"
            )
        picked = batch_index(index, len(self), owner="PackedTensor", unit="segment")
        host = self.cu_seqlens_host
        if isinstance(picked, int):
            return self.values[int(host[picked]) : int(host[picked + 1])]
        if isinstance(picked, slice):
            start, stop = picked.start, picked.stop
            first, last = int(host[start]), int(host[stop])
            cu_host = host[start : stop + 1] - first
            # the device offsets by the same ops on every device (a tiny kernel, no sync), so the
            # CPU runs the path a GPU takes
            cu = self.cu_seqlens[start : stop + 1] - first
            return PackedTensor._trusted(self.values[first:last], cu_host, cu)
        return self._gather(picked)

    def _gather(self, segments: Tensor) -> PackedTensor:
        """New ``PackedTensor`` of the given host segment indices, one ``index_select``."""
        lengths = self.lengths[segments]
        offsets = offsets_from_lengths(lengths, "gathered lengths")
        segment, positions = segment_ids_and_positions(lengths)
        starts = self.cu_seqlens_host[:-1].to(torch.int64)[segments]
        rows = starts[segment] + positions  # [gathered rows] source row of each output row
        values = self.values.index_select(0, to_device_async(rows, self.device))
        return PackedTensor._trusted(values, offsets)

    def __iter__(self) -> Iterator[Tensor]:
        """Segment views, in order."""
        return iter(self.values.split(self.lengths.tolist(), dim=0))

    # ---------------------------------------------------------------------- reordering ops

    def repeat(self, repeats: int) -> PackedTensor:
        """The whole batch ``repeats`` times (like ``list * repeats``), new storage."""
        repeats = operator.index(repeats)
        if repeats < 0:
            raise ValueError(f"repeats must be >= 0, got {repeats}")
        values = self.values.repeat(repeats, *([1] * (self.values.dim() - 1)))
        return PackedTensor._trusted(
            values, offsets_from_lengths(self.lengths.repeat(repeats), "repeated lengths")
        )

    def repeat_interleave(self, repeats: int | LengthsLike) -> PackedTensor:
        """Each segment ``repeats`` times in place (``[a, a, b, b]``); ``repeats`` is an int or one
        count per segment. New storage. Device-resident ``repeats`` are read back once (a sync)."""
        per_segment = repeat_counts(repeats, len(self), unit="segment")
        return self._gather(torch.repeat_interleave(torch.arange(len(self)), per_segment))

    def to_padded(
        self, max_len: int | None = None, pad: float | bool | Tensor = 0, side: str = "left"
    ) -> Tensor:
        """Dense ``[B, max_len, *row_shape]`` copy, real rows at the right (``"left"`` padding) or
        left end (``"right"``), every other position ``pad`` (a scalar the dtype holds exactly, or
        a row broadcastable to ``row_shape``). One fill and one ``index_copy_``; no sync."""
        check_side(side)
        lengths = self.lengths
        longest = self.max_length
        width = longest if max_len is None else operator.index(max_len)
        if width < longest:
            raise ValueError(f"max_len = {width} is shorter than the longest segment ({longest})")
        shape = (len(self), width, *self.row_shape)
        if isinstance(pad, Tensor):
            check_pad_row(pad, self.row_shape)
            out = pad.to(device=self.device, dtype=self.dtype).expand(shape).clone()
        else:
            out = torch.full(shape, check_fill_value(pad, self.dtype), dtype=self.dtype, device=self.device)
        flat = padded_flat_index(lengths, width, side)
        out.view(-1, *self.row_shape).index_copy_(0, to_device_async(flat, self.device), self.values)
        return out

    # ------------------------------------------------------------------- device and memory

    def to(
        self,
        device: torch.device | str | int | torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> PackedTensor:
        """Move values to ``device`` and/or cast them to ``dtype``; offsets stay int32.

        ``non_blocking`` applies to the values (asynchronous from pinned memory, as for tensors).
        Offsets come from the host copy, so moving to the CPU reads nothing back from the device.
        Returns ``self`` when nothing changes. A dtype as first argument is taken as ``dtype``.
        Lightning's ``move_data_to_device`` calls ``.to(device)`` on non-tensor objects without
        ``non_blocking``; batch classes that want asynchronous copies pass it themselves.
        """
        if isinstance(device, torch.dtype):
            device, dtype = None, device
        values = self.values.to(device=device, dtype=dtype, non_blocking=non_blocking)
        if values is self.values:
            return self
        if values.device == self.device:
            return PackedTensor._trusted(values, self.cu_seqlens_host, self.cu_seqlens)
        # The host offsets may live in a reusable (pinned) collation buffer that is rewritten once
        # the source batch is released; the moved batch gets its own copy (B + 1 ints).
        return PackedTensor._trusted(values, self.cu_seqlens_host.clone())

    def cpu(self) -> PackedTensor:
        return self.to("cpu")

    def pin_memory(self) -> PackedTensor:
        """Page-locked copy of values and offsets (``self`` when already pinned); CPU only.

        Called by ``torch.utils.data`` DataLoader pinning for a PackedTensor anywhere in a batch.
        """
        if self.device.type != "cpu":
            raise ValueError(f"pin_memory needs CPU values, got device {self.device}")
        if self.is_pinned():
            return self
        host = self.cu_seqlens_host if self.cu_seqlens_host.is_pinned() else self.cu_seqlens_host.pin_memory()
        return PackedTensor._trusted(self.values.pin_memory(), host, host)

    def is_pinned(self) -> bool:
        return self.values.is_pinned() and self.cu_seqlens_host.is_pinned()

    def contiguous(self) -> PackedTensor:
        """``self`` when values are contiguous, else a contiguous copy."""
        if self.values.is_contiguous():
            return self
        return PackedTensor._trusted(self.values.contiguous(), self.cu_seqlens_host, self.cu_seqlens)

    def clone(self) -> PackedTensor:
        """Copy owning exactly its rows (a view's clone drops the rest of the source storage)."""
        return PackedTensor._trusted(self.values.clone(), self.cu_seqlens_host.clone())

    # ------------------------------------------------------------------- equality, pickling

    def equal(self, other: object) -> bool:
        """Same segments, row schema, dtype, device and values (a device sync for GPU values)."""
        if not isinstance(other, PackedTensor):
            return False
        return (
            self.row_shape == other.row_shape
            and self.dtype == other.dtype
            and self.device == other.device
            and torch.equal(self.cu_seqlens_host, other.cu_seqlens_host)
            and torch.equal(self.values, other.values)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedTensor):
            return NotImplemented
        return self.equal(other)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        raw, dtype_name, shape = tensor_to_bytes(self.values)
        return _rebuild, (raw, dtype_name, shape, self.cu_seqlens_host.numpy(), str(self.device))

    def __copy__(self) -> PackedTensor:
        return PackedTensor._trusted(self.values, self.cu_seqlens_host, self.cu_seqlens)

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedTensor:
        return PackedTensor._trusted(
            copy.deepcopy(self.values, memo),
            self.cu_seqlens_host.clone(),
            copy.deepcopy(self.cu_seqlens, memo),
        )

    def __repr__(self) -> str:
        lengths = self.lengths.tolist()
        if len(lengths) > 8:
            shown = ", ".join(map(str, lengths[:4])) + ", ..., " + ", ".join(map(str, lengths[-2:]))
        else:
            shown = ", ".join(map(str, lengths))
        return (
            f"PackedTensor(segments={len(self)}, rows={self.num_rows}, row_shape={self.row_shape}, "
            f"dtype={self.dtype}, device={self.device}, lengths=[{shown}])"
        )


def _rebuild(
    raw: np.ndarray, dtype_name: str, shape: tuple[int, ...], offsets: np.ndarray, device: str
) -> PackedTensor:
    host = torch.from_numpy(np.array(offsets, dtype=np.int32))
    return PackedTensor._trusted(tensor_from_bytes(raw, dtype_name, shape), host).to(device)


def _check_values(values: Any) -> None:
    if not isinstance(values, Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 0:
        raise ValueError("values must have a row axis [rows, *row_shape], got a 0-d tensor")


def _check_segment_schema(schemas: list[tuple[Any, Any, Any]]) -> None:
    shape0, dtype0, device0 = schemas[0]
    for i, (shape, dtype, device) in enumerate(schemas):
        if len(shape) == 0:
            raise ValueError(f"segment {i} is 0-d; segments must be [n_i, *row_shape]")
        if tuple(shape[1:]) != tuple(shape0[1:]) or dtype != dtype0 or str(device) != str(device0):
            raise ValueError(
                f"segments must share row_shape, dtype and device; segment 0 has {tuple(shape0[1:])} "
                f"{dtype0} {device0}, segment {i} has {tuple(shape[1:])} {dtype} {device}"
            )
