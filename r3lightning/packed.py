"""``PackedTensor``: a ragged batch as one dense buffer plus int32 offsets, whose CPU copy plans
every operation: no method syncs with the device unless handed device-resident indices, lengths or
offsets (said per method). Views (``pt[i]``, ``pt[a:b]``) alias ``values``; reorderings copy."""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from r3lightning.padded import padded_from_rows, rows_from_padded
from r3lightning.ragged import (
    LengthsLike,
    batch_index,
    check_rows,
    check_same_rows,
    checked_offsets,
    host_int64,
    offsets_from_lengths,
    repeat_counts,
    segment_ids_and_positions,
    tensor_from_bytes,
    tensor_to_bytes,
    to_device_async,
)

IndexLike = int | slice | Sequence[int] | Sequence[bool] | Tensor | np.ndarray
_EMPTY = "use PackedTensor.empty(row_shape, dtype=..., device=...) for a batch of zero segments"


class PackedTensor:
    """Ragged batch: the rows of ``B`` segments back to back, with their offsets.

    Segment ``i`` is ``values[cu_seqlens[i]:cu_seqlens[i + 1]]``. Pickling sends the referenced
    rows as raw bytes (device values: a sync) and keeps the device. `from_segments` and
    `from_lengths` build one from its pieces.

    Args:
        values: ``[sum(lengths), *row_shape]``, any dtype and device.
        cu_seqlens: int32 ``[B + 1]`` on ``values``' device, from 0 to ``len(values)``,
            non-decreasing.
        cu_seqlens_host: A CPU copy of ``cu_seqlens`` trusted to equal it: spares the check its one
            device-to-host copy (a sync for device offsets).

    Raises:
        ValueError, TypeError: Offsets of the wrong dtype, device, shape or order.
    """

    values: Tensor  # [rows, *row_shape]
    cu_seqlens: Tensor  # [B + 1] int32, on values.device
    cu_seqlens_host: Tensor  # [B + 1] int32, CPU

    __hash__ = None  # type: ignore[assignment]  # mutable tensors, value equality: unhashable

    def __init__(self, values: Tensor, cu_seqlens: Tensor, *, cu_seqlens_host: Tensor | None = None) -> None:
        self.cu_seqlens_host = checked_offsets(values, cu_seqlens, cu_seqlens_host)
        self.values = values
        self.cu_seqlens = cu_seqlens

    @classmethod
    def _trusted(cls, values: Tensor, host: Tensor, cu_seqlens: Tensor | None = None) -> PackedTensor:
        """Build from offsets this module computed itself: no validation, no sync."""
        out = cls.__new__(cls)
        out.values = values
        out.cu_seqlens = to_device_async(host, values.device) if cu_seqlens is None else cu_seqlens
        out.cu_seqlens_host = host
        return out

    @classmethod
    def from_lengths(cls, values: Tensor, lengths: LengthsLike) -> PackedTensor:
        """``values`` (no copy) as consecutive segments of the given lengths; offsets built on the host.

        Args:
            values: ``[sum(lengths), *row_shape]``, any dtype and device.
            lengths: ``[B]`` counts >= 0; device lengths cost a sync.

        Raises:
            ValueError: ``lengths`` not 1-D integers >= 0, or not summing to ``values.shape[0]``.
        """
        check_rows(values)
        offsets = offsets_from_lengths(host_int64(lengths, "lengths"))
        if int(offsets[-1]) != values.shape[0]:
            raise ValueError(f"lengths sum to {int(offsets[-1])} but values has {values.shape[0]} rows")
        return cls._trusted(values, offsets)

    @classmethod
    def from_segments(cls, segments: Sequence[Tensor | np.ndarray]) -> PackedTensor:
        """Segments joined by one ``torch.cat`` into new storage on their device; no sync.

        Args:
            segments: ``[n_i, *row_shape]`` tensors or ndarrays (at least one), of one row schema.

        Raises:
            ValueError: No segments (use `empty`), a 0-d segment, or differing row schemas.
            TypeError: A segment that is neither a tensor nor an ndarray.
        """
        if len(segments) == 0:
            raise ValueError(f"from_segments needs a segment to infer row_shape and dtype; {_EMPTY}")
        bad = next((s for s in segments if not isinstance(s, (Tensor, np.ndarray))), None)
        if bad is not None:
            raise TypeError(f"segments must be tensors or ndarrays, got {type(bad).__name__}")
        with warnings.catch_warnings():  # read-only arrays are only read by the cat
            warnings.filterwarnings("ignore", message=".*not writable.*")
            parts = [
                torch.from_numpy(np.ascontiguousarray(s)) if isinstance(s, np.ndarray) else s
                for s in segments
            ]
        bad = next((i for i, t in enumerate(parts) if t.dim() == 0), None)
        if bad is not None:
            raise ValueError(f"segment {bad} is 0-d; segments must be [n_i, *row_shape]")
        check_same_rows([(tuple(t.shape[1:]), t.dtype, t.device) for t in parts], "segment")
        lengths = torch.tensor([t.shape[0] for t in parts], dtype=torch.int64)
        return cls._trusted(torch.cat(parts), offsets_from_lengths(lengths, "segment lengths"))

    @classmethod
    def from_padded(cls, padded: Tensor, lengths: LengthsLike, side: str = "left") -> PackedTensor:
        """The real rows of a padded batch, gathered by one ``index_select`` into new storage.

        Args:
            padded: ``[B, S, *row_shape]``.
            lengths: ``[B]`` real rows per batch row, each ``<= S``; device lengths cost a sync.
            side: ``"left"`` takes ``padded[i, S - lengths[i]:]``, ``"right"`` ``padded[i, :lengths[i]]``.

        Raises:
            ValueError: ``padded`` below 2-D, not ``B`` lengths, a length over ``S``, or a bad ``side``.
        """
        values, offsets = rows_from_padded(padded, lengths, side)
        return cls._trusted(values, offsets)

    @classmethod
    def empty(
        cls,
        row_shape: Sequence[int] = (),
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> PackedTensor:
        """A batch of zero segments: ``values [0, *row_shape]``, ``cu_seqlens = [0]``.

        Args:
            row_shape: The shape of one row (ints >= 0).
            dtype, device: The values' dtype and device (default device: torch's).

        Raises:
            ValueError: A ``row_shape`` entry that is not an int >= 0.
        """
        row_shape = tuple(row_shape)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in row_shape):
            raise ValueError(f"row_shape must hold ints >= 0, got {row_shape}")
        values = torch.empty((0, *row_shape), dtype=dtype, device=device)
        return cls._trusted(values, torch.zeros(1, dtype=torch.int32))

    @staticmethod
    def cat(parts: Sequence[PackedTensor]) -> PackedTensor:
        """The segments of all ``parts`` in order, in new storage (one ``torch.cat``, no sync).

        Args:
            parts: At least one `PackedTensor`; all share row shape, dtype and device.

        Raises:
            ValueError: No parts (use `empty`) or differing row schemas.
            TypeError: A part that is not a `PackedTensor`.
        """
        parts = list(parts)
        if not parts:
            raise ValueError(f"cat needs a PackedTensor to infer row_shape, dtype and device; {_EMPTY}")
        i = next((i for i, p in enumerate(parts) if not isinstance(p, PackedTensor)), None)
        if i is not None:
            raise TypeError(f"cat takes PackedTensors, got {type(parts[i]).__name__} at position {i}")
        check_same_rows([(p.row_shape, p.dtype, p.device) for p in parts], "part")
        offsets = offsets_from_lengths(torch.cat([p.lengths for p in parts]), "cat lengths")
        return PackedTensor._trusted(torch.cat([p.values for p in parts], dim=0), offsets)

    @property
    def lengths(self) -> Tensor:
        """Host int64 ``[B]`` (from the host offsets, no sync)."""
        return self.cu_seqlens_host.diff().to(torch.int64)

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
        """Host int64 ``[rows]``: each row's segment."""
        return segment_ids_and_positions(self.lengths)[0]

    def segment_positions(self) -> Tensor:
        """Host int64 ``[rows]``: each row's position within its segment."""
        return segment_ids_and_positions(self.lengths)[1]

    def __getitem__(self, index: IndexLike) -> Tensor | PackedTensor:
        """``int``: segment view ``[len_i, *row]``; step-1 slice: ``PackedTensor`` view; anything
        else (strided slice, indices, bool mask): gathered copy (device indices: a sync)."""
        if isinstance(index, tuple):
            raise TypeError("a PackedTensor is indexed along segments only; index a segment for rows")
        picked = batch_index(index, len(self), owner="PackedTensor", unit="segment")
        host = self.cu_seqlens_host
        if isinstance(picked, int):
            return self.values[int(host[picked]) : int(host[picked + 1])]
        if isinstance(picked, slice):
            start = picked.start
            stop = picked.stop
            first = int(host[start])
            last = int(host[stop])
            # the same tiny kernel on every device (no sync): the CPU runs the path a GPU takes
            cu = self.cu_seqlens[start : stop + 1] - first
            return PackedTensor._trusted(self.values[first:last], host[start : stop + 1] - first, cu)
        return self._gather(picked)

    def _gather(self, segments: Tensor) -> PackedTensor:
        """New ``PackedTensor`` of the given host segment indices, one ``index_select``."""
        lengths = self.lengths[segments]
        segment, positions = segment_ids_and_positions(lengths)
        starts = self.cu_seqlens_host[:-1].to(torch.int64)[segments]
        rows = starts[segment] + positions  # [gathered rows] source row of each output row
        values = self.values.index_select(0, to_device_async(rows, self.device))
        return PackedTensor._trusted(values, offsets_from_lengths(lengths, "gathered lengths"))

    def __iter__(self) -> Iterator[Tensor]:
        """Segment views, in order."""
        return iter(self.values.split(self.lengths.tolist(), dim=0))

    def repeat(self, repeats: int) -> PackedTensor:
        """The whole batch ``repeats`` times (like ``list * repeats``), one gather into new storage.

        Args:
            repeats: How many copies, >= 0.

        Raises:
            ValueError: ``repeats < 0``.
        """
        repeats = operator.index(repeats)
        if repeats < 0:
            raise ValueError(f"repeats must be >= 0, got {repeats}")
        return self._gather(torch.arange(len(self)).repeat(repeats))

    def repeat_interleave(self, repeats: int | LengthsLike) -> PackedTensor:
        """Each segment repeated in place (``[a, a, b, b]``), one gather into new storage.

        Args:
            repeats: An int >= 0, or one count >= 0 per segment (device counts: a sync); floats and
                bools are refused, not truncated.

        Raises:
            ValueError: A negative count or a count list of the wrong length.
        """
        per_segment = repeat_counts(repeats, len(self), unit="segment")
        return self._gather(torch.repeat_interleave(torch.arange(len(self)), per_segment))

    def to_padded(
        self, max_len: int | None = None, pad: float | bool | Tensor = 0, side: str = "left"
    ) -> Tensor:
        """Dense ``[B, max_len, *row_shape]`` copy: one fill and one ``index_copy_``, no sync.

        Args:
            max_len: Width of the result (default: the longest segment).
            pad: A scalar the dtype stores faithfully, or a tensor broadcasting to one row.
            side: ``"left"`` puts the real rows at the right end of each row (the RL convention),
                ``"right"`` at the start.

        Raises:
            ValueError: ``max_len`` below the longest segment, a bad ``pad``, or a bad ``side``.
        """
        return padded_from_rows(self.values, self.lengths, max_len, pad, side)

    def to(
        self,
        device: torch.device | str | int | torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> PackedTensor:
        """Values moved and/or cast as by ``Tensor.to`` (``self`` when nothing changes); int32 offsets
        reach a new device from the host copy, no sync.

        Args:
            device: Target device, or a dtype for ``.to(dtype)``.
            dtype: Target dtype of the values.
            non_blocking: Passed to ``Tensor.to`` (asynchronous from pinned memory).
        """
        if isinstance(device, torch.dtype):
            dtype = device  # .to(dtype) alone
            device = None
        values = self.values.to(device=device, dtype=dtype, non_blocking=non_blocking)
        if values is self.values:
            return self
        if values.device == self.device:
            return PackedTensor._trusted(values, self.cu_seqlens_host, self.cu_seqlens)
        # the host offsets may sit in a reused pinned collation buffer: the moved batch owns a copy
        return PackedTensor._trusted(values, self.cu_seqlens_host.clone())

    def cpu(self) -> PackedTensor:
        return self.to("cpu")

    def pin_memory(self) -> PackedTensor:
        """Page-locked copy of CPU values and offsets (``self`` when pinned), for the DataLoader."""
        if self.device.type != "cpu":
            raise ValueError(f"pin_memory needs CPU values, got device {self.device}")
        if self.is_pinned():
            return self
        host = self.cu_seqlens_host.pin_memory()  # (itself when already pinned)
        return PackedTensor._trusted(self.values.pin_memory(), host, host)

    def is_pinned(self) -> bool:
        return self.values.is_pinned() and self.cu_seqlens_host.is_pinned()

    def contiguous(self) -> PackedTensor:
        """``self`` when values are contiguous, else a contiguous copy."""
        if self.values.is_contiguous():
            return self
        return PackedTensor._trusted(self.values.contiguous(), self.cu_seqlens_host, self.cu_seqlens)

    def clone(self) -> PackedTensor:
        """A copy owning exactly its rows (a view's clone leaves the source storage behind)."""
        return PackedTensor._trusted(self.values.clone(), self.cu_seqlens_host.clone())

    def equal(self, other: object) -> bool:
        """Same row shape, dtype, device, offsets and values (device values: a sync).

        Args:
            other: Any object (only a `PackedTensor` can be equal).
        """
        return (
            isinstance(other, PackedTensor)
            and (self.row_shape, self.dtype, self.device) == (other.row_shape, other.dtype, other.device)
            and torch.equal(self.cu_seqlens_host, other.cu_seqlens_host)
            and torch.equal(self.values, other.values)
        )

    def __eq__(self, other: object) -> bool:
        return self.equal(other) if isinstance(other, PackedTensor) else NotImplemented

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        raw, dtype_name, shape = tensor_to_bytes(self.values)
        return _rebuild, (raw, dtype_name, shape, self.cu_seqlens_host.numpy(), str(self.device))

    def __copy__(self) -> PackedTensor:
        return PackedTensor._trusted(self.values, self.cu_seqlens_host, self.cu_seqlens)

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedTensor:
        values = copy.deepcopy(self.values, memo)
        cu_seqlens = copy.deepcopy(self.cu_seqlens, memo)
        return PackedTensor._trusted(values, self.cu_seqlens_host.clone(), cu_seqlens)

    def __repr__(self) -> str:
        lengths = [str(n) for n in self.lengths.tolist()]
        shown = ", ".join(lengths if len(lengths) <= 8 else [*lengths[:4], "...", *lengths[-2:]])
        return (
            f"PackedTensor(segments={len(self)}, rows={self.num_rows}, row_shape={self.row_shape}, "
            f"dtype={self.dtype}, device={self.device}, lengths=[{shown}])"
        )


def _rebuild(
    raw: np.ndarray, dtype_name: str, shape: tuple[int, ...], offsets: np.ndarray, device: str
) -> PackedTensor:
    host = torch.from_numpy(np.array(offsets, dtype=np.int32))
    return PackedTensor._trusted(tensor_from_bytes(raw, dtype_name, shape), host).to(device)
