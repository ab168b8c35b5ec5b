"""Host-side index arithmetic for ragged batches (segments of varying length).

Everything here runs on small CPU tensors (per segment or per row int64 indices) so that the
device-side work it plans (an ``index_select``, an ``index_copy_``) needs no device->host sync.
Shared by ``PackedTensor``, ``RolloutBatch`` and anything else that maps packed rows onto padded
grids: batch-axis index normalisation and the raw-byte tensor form both pickle through are here too.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "INT32_MAX",
    "LengthsLike",
    "batch_index",
    "check_fill_value",
    "check_pad_row",
    "check_side",
    "host_int64",
    "host_lengths",
    "offsets_from_lengths",
    "padded_flat_index",
    "repeat_counts",
    "segment_ids_and_positions",
    "tensor_from_bytes",
    "tensor_to_bytes",
    "to_device_async",
]

INT32_MAX = 2**31 - 1

LengthsLike = Sequence[int] | Tensor | np.ndarray


def host_int64(data: LengthsLike, name: str) -> Tensor:
    """``data`` as a 1-D int64 CPU tensor; ``name`` goes into the error messages.

    Cost: a device tensor is copied to the host (one sync); a host int64 tensor is returned as is
    (no copy), other host data is converted once.
    Raises ``ValueError`` for non-1-D or non-integer input (bools and floats included).
    """
    if isinstance(data, Tensor):
        tensor = data.detach()
    elif isinstance(data, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(data))
    else:
        items = list(data)
        tensor = torch.as_tensor(items) if items else torch.empty(0, dtype=torch.int64)
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise ValueError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(device="cpu", dtype=torch.int64)


def host_lengths(data: LengthsLike, name: str) -> Tensor:
    """Non-negative lengths (or starts, counts) as a 1-D int64 CPU tensor, for :func:`host_int64`'s
    inputs except that a Python sequence must hold Python ints (no bools, floats or numpy scalars).

    Cost: a device tensor is copied to the host (one sync). Raises ``ValueError`` naming ``name``.
    """
    if not isinstance(data, (Tensor, np.ndarray)):
        items = list(data)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in items):
            raise ValueError(f"{name} must hold ints, got {items!r}")
        data = items
    lengths = host_int64(data, name)
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {lengths.tolist()}")
    return lengths


def offsets_from_lengths(lengths: Tensor, name: str = "lengths") -> Tensor:
    """Host int64 ``lengths [B]`` -> host int32 offsets ``[B + 1]`` (``cu_seqlens``).

    Raises ``ValueError`` for a negative length or a total beyond what int32 offsets address.
    """
    if lengths.numel() and int(lengths.min()) < 0:
        bad = int(torch.nonzero(lengths < 0)[0, 0])
        raise ValueError(f"{name} must be >= 0, got {name}[{bad}] = {int(lengths[bad])}")
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    if int(offsets[-1]) > INT32_MAX:
        raise ValueError(
            f"{name} sum to {int(offsets[-1])} rows, more than int32 offsets can address ({INT32_MAX})"
        )
    return offsets.to(torch.int32)


def repeat_counts(repeats: Any, count: int, *, unit: str) -> Tensor:
    """Host int64 ``[count]`` repeat counts from an int (every ``unit`` alike) or one int per unit.

    Floats and bools are rejected rather than truncated. Device-resident ``repeats`` are read back
    once (a sync). Raises ``ValueError`` naming ``repeats`` and the expected value.
    """
    if isinstance(repeats, (Tensor, np.ndarray)) and repeats.ndim == 0:
        repeats = repeats.item()
    if isinstance(repeats, (int, np.integer)) and not isinstance(repeats, (bool, np.bool_)):
        per_unit = torch.full((count,), int(repeats), dtype=torch.int64)
    elif isinstance(repeats, (Tensor, np.ndarray, list, tuple)):
        per_unit = host_int64(repeats, "repeats")
        if isinstance(repeats, (list, tuple)) and any(isinstance(r, bool) for r in repeats):
            raise ValueError(f"repeats must hold ints, got {list(repeats)!r}")
        if per_unit.numel() != count:
            raise ValueError(
                f"repeats must have one entry per {unit} ({count}), got {per_unit.numel()}; pass an int "
                f">= 0 or one count >= 0 per {unit} ({count})"
            )
    else:
        raise ValueError(
            f"repeats must be an int >= 0 or one count >= 0 per {unit} ({count}), got {repeats!r}"
        )
    if per_unit.numel() and int(per_unit.min()) < 0:
        raise ValueError(f"repeats must be >= 0, got {per_unit.tolist()}")
    return per_unit


def segment_ids_and_positions(lengths: Tensor) -> tuple[Tensor, Tensor]:
    """For host int64 ``lengths [B]``: the segment of every packed row and its position within
    that segment, both host int64 ``[sum(lengths)]``. O(rows) on the host."""
    total = int(lengths.sum())
    starts = torch.zeros_like(lengths)
    torch.cumsum(lengths[:-1], dim=0, out=starts[1:])
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=total)
    positions = torch.arange(total) - starts[segment]
    return segment, positions


def padded_flat_index(lengths: Tensor, width: int, side: str) -> Tensor:
    """Host int64 ``[sum(lengths)]``: where each packed row sits in a flattened ``[B, width]`` grid.

    ``side="left"`` puts segment ``i`` at the right end of its row (left padding), ``"right"``
    at the start. The caller checks ``width >= max(lengths)``.
    """
    check_side(side)
    segment, positions = segment_ids_and_positions(lengths)
    column = positions + (width - lengths[segment]) if side == "left" else positions
    return segment * width + column


def check_side(side: str) -> None:
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")


def check_fill_value(
    value: Any, dtype: torch.dtype, name: str = "pad", what: str = "dtype"
) -> int | float | bool:
    """``value`` as a Python scalar that ``dtype`` stores faithfully, else ``ValueError`` naming ``name``.

    Integer and bool dtypes must hold the value exactly (``torch.full`` would silently wrap -1 to 255
    in uint8, or truncate 0.5 to 0); floating dtypes only need to keep a finite value finite
    (rounding 0.1 to the nearest float32 is not an error).
    """
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        value = value.item()
    if not isinstance(value, (bool, int, float)):
        raise ValueError(f"{name} must be a real scalar, got {type(value).__name__}")
    try:
        stored = torch.tensor(value, dtype=dtype).item()
    except (RuntimeError, OverflowError):
        stored = None
    if dtype.is_floating_point or dtype.is_complex:
        faithful = stored is not None and (math.isfinite(abs(stored)) or not math.isfinite(value))
    else:
        faithful = stored is not None and stored == value
    if not faithful:
        raise ValueError(f"{name} {value!r} is not representable in the {what} {dtype}")
    return value


def check_pad_row(pad: Tensor, row_shape: tuple[int, ...], name: str = "pad") -> None:
    """``ValueError`` naming ``name`` unless the tensor ``pad`` broadcasts to exactly ``row_shape``."""
    try:
        fits = torch.broadcast_shapes(pad.shape, row_shape) == torch.Size(row_shape)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"{name} row of shape {tuple(pad.shape)} does not broadcast to row shape {row_shape}"
        )


def to_device_async(host: Tensor, device: torch.device) -> Tensor:
    """Host tensor -> ``device`` without blocking the host and never a device->host sync.

    Returns ``host`` itself for a CPU ``device``. A pageable ``host`` is first staged into page-locked
    memory from torch's caching host allocator (one host memcpy; small index maps and masks only):
    a ``non_blocking`` copy straight from pageable memory may make the driver synchronise. The
    staging block is fenced by the copy (the allocator records an event on the copy's stream and
    reuses the block only after it), so both ``host`` and the staging block may die right away.
    """
    if device.type == "cpu":
        return host
    if device.type == "cuda" and host.device.type == "cpu" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def batch_index(index: Any, count: int, *, owner: str, unit: str) -> int | slice | Tensor:
    """Normalise an index along the batch axis of a ``count``-long ``owner`` (e.g. a
    ``PackedTensor`` of segments, a ``RolloutBatch`` of rows).

    Returns an ``int`` in ``[0, count)`` for an integer (0-d tensors included), a step-1
    ``slice(start, stop)`` with ``0 <= start <= stop <= count`` for a step-1 slice, and host int64
    positions ``[n]`` in ``[0, count)`` for a strided slice, a list / tuple, an index tensor or
    array, or a bool mask of length ``count``. Device-resident indices are read back once (a sync).

    Raises ``TypeError`` for a bool scalar or an unsupported type, ``IndexError`` for positions
    out of range, a mask of the wrong length, non-integer entries or a non-1-D index; messages
    name ``owner`` and ``unit``.
    """
    if (
        isinstance(index, (Tensor, np.ndarray))
        and index.ndim == 0
        and index.dtype not in (torch.bool, np.bool_)
    ):
        index = int(index)
    if isinstance(index, (bool, np.bool_)):
        raise TypeError(f"a {owner} cannot be indexed by a bool scalar; use a mask of length B")
    if isinstance(index, (int, np.integer)):
        position = operator.index(index)
        if not -count <= position < count:
            raise IndexError(f"{unit} {position} is out of range for a {owner} of {count} {unit}s")
        return position % count
    if isinstance(index, slice):
        start, stop, step = index.indices(count)
        if step != 1:  # (torch.arange rejects empty ranges such as 1:0:2)
            return start + step * torch.arange(len(range(start, stop, step)), dtype=torch.int64)
        return slice(start, max(start, stop))
    if isinstance(index, Tensor):
        tensor = index.detach().cpu()
    elif isinstance(index, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(index))
    elif isinstance(index, (list, tuple)):
        tensor = torch.as_tensor(index) if index else torch.empty(0, dtype=torch.int64)
    else:
        raise TypeError(f"unsupported {owner} index of type {type(index).__name__}")
    if tensor.dim() != 1:
        raise IndexError(f"{owner} index must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.dtype == torch.bool:
        if tensor.numel() != count:
            raise IndexError(f"bool mask must have one entry per {unit} ({count}), got {tensor.numel()}")
        return torch.nonzero(tensor).flatten()
    if tensor.is_floating_point() or tensor.is_complex():
        raise IndexError(f"{owner} index must hold integers or bools, got {tensor.dtype}")
    tensor = tensor.to(torch.int64)
    if tensor.numel() and (int(tensor.min()) < -count or int(tensor.max()) >= count):
        bad = int(tensor[(tensor < -count) | (tensor >= count)][0])
        raise IndexError(f"{unit} {bad} is out of range for a {owner} of {count} {unit}s")
    return torch.where(tensor < 0, tensor + count, tensor)


def tensor_to_bytes(tensor: Tensor) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """``(raw uint8 bytes, dtype name, shape)`` of ``tensor``'s elements, for pickling.

    Raw bytes let every dtype (bfloat16, bool, float8) round-trip without numpy supporting it, and
    only the referenced elements travel (a view does not drag its storage along). Device tensors
    are copied to the host first (a sync).
    """
    host = tensor.detach().cpu().contiguous()
    # (an empty tensor may carry a zero stride, which a dtype view rejects)
    raw = host.reshape(-1).view(torch.uint8).numpy() if host.numel() else np.empty(0, np.uint8)
    return raw, str(host.dtype).removeprefix("torch."), tuple(host.shape)


def tensor_from_bytes(raw: np.ndarray, dtype_name: str, shape: tuple[int, ...]) -> Tensor:
    """Inverse of :func:`tensor_to_bytes`: a CPU tensor (sharing ``raw`` unless it is read-only)."""
    dtype = getattr(torch, dtype_name)
    if raw.size == 0:  # an empty array may carry a zero stride, which a dtype view rejects
        return torch.empty(shape, dtype=dtype)
    if not raw.flags.writeable:  # out-of-band pickle buffers may be read-only
        raw = raw.copy()
    return torch.from_numpy(raw).view(dtype).reshape(shape)
