"""Host index maths and checks for ragged batches (``PackedTensor``, ``RolloutBatch``, alignment),
on small CPU int64 tensors, so the device work they plan never reads anything back."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

INT32_MAX = 2**31 - 1

LengthsLike = Sequence[int] | Tensor | np.ndarray


def _as_tensor(data: Any) -> Tensor:
    """A tensor, an ndarray or a sequence as a tensor (shared where possible; ``[]`` is int64)."""
    if isinstance(data, Tensor):
        return data.detach()
    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(data))
    return torch.as_tensor(data) if len(data) else torch.empty(0, dtype=torch.int64)


def host_int64(data: LengthsLike, name: str) -> Tensor:
    """``data`` as a 1-D int64 CPU tensor.

    Args:
        data: A sequence, tensor or ndarray of integers; device data costs a sync.
        name: The argument's name, for the error.

    Returns:
        Host int64 ``[n]`` (shares memory with a CPU int64 input).

    Raises:
        ValueError: ``data`` not 1-D, or holding bools, floats or complex numbers.
    """
    tensor = _as_tensor(data if isinstance(data, (Tensor, np.ndarray)) else list(data))
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise ValueError(f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor.to(device="cpu", dtype=torch.int64)


def host_lengths(data: LengthsLike, name: str) -> Tensor:
    """`host_int64` of counts >= 0: host int64 ``[B]``.

    Args:
        data: Python ints (bools refused), a tensor or an ndarray; device data costs a sync.
        name: The argument's name, for the error.

    Raises:
        ValueError: Non-integers or a negative count.
    """
    if not isinstance(data, (Tensor, np.ndarray)):
        data = list(data)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in data):
            raise ValueError(f"{name} must hold ints, got {data!r}")
    lengths = host_int64(data, name)
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {lengths.tolist()}")
    return lengths


def offsets_from_lengths(lengths: Tensor, name: str = "lengths") -> Tensor:
    """Segment lengths as offsets, ``cu_seqlens[i + 1] = lengths[:i + 1].sum()``.

    Args:
        lengths: Host int64 ``[B]``, each >= 0.
        name: The argument's name, for the error.

    Returns:
        Host int32 ``cu_seqlens [B + 1]``, from 0.

    Raises:
        ValueError: A negative length, or a total over ``INT32_MAX`` rows.
    """
    if lengths.numel() and int(lengths.min()) < 0:
        bad = int(torch.nonzero(lengths < 0)[0, 0])
        raise ValueError(f"{name} must be >= 0, got {name}[{bad}] = {int(lengths[bad])}")
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))  # [B + 1] int64
    total = int(offsets[-1])
    if total > INT32_MAX:
        raise ValueError(f"{name} sum to {total} rows, more than int32 offsets can address ({INT32_MAX})")
    return offsets.to(torch.int32)


def check_rows(values: Any) -> None:
    """Refuses ``values`` that is not a tensor ``[rows, *row_shape]``.

    Args:
        values: The value to check.

    Raises:
        TypeError: Not a tensor.
        ValueError: A 0-d tensor.
    """
    if not isinstance(values, Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 0:
        raise ValueError("values must have a row axis [rows, *row_shape], got a 0-d tensor")


def checked_offsets(values: Tensor, cu_seqlens: Tensor, host: Tensor | None) -> Tensor:
    """Checks ``cu_seqlens`` against ``values``: int32, 1-D, from 0, non-decreasing, ending at ``rows``.

    Args:
        values: ``[rows, *row_shape]``.
        cu_seqlens: int32 ``[B + 1]`` on ``values``' device.
        host: A CPU int32 copy of ``cu_seqlens`` trusted to equal it, or None to copy it from the
            device (a sync for device offsets).

    Returns:
        The host copy ``[B + 1]``.

    Raises:
        TypeError: ``values`` or ``cu_seqlens`` not a tensor.
        ValueError: Any other broken property, named in the message.
    """
    check_rows(values)
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"cu_seqlens must be 1-D [B + 1 >= 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != values.device:
        raise ValueError(f"cu_seqlens must be on values' device {values.device}, got {cu_seqlens.device}")
    rows = values.shape[0]
    if rows > INT32_MAX:
        raise ValueError(f"values has {rows} rows, more than int32 cu_seqlens can address ({INT32_MAX})")
    host = cu_seqlens.detach().cpu() if host is None else host
    if host.device.type != "cpu" or host.dtype != torch.int32 or host.shape != cu_seqlens.shape:
        raise ValueError(
            f"cu_seqlens_host must be a CPU int32 tensor of shape {tuple(cu_seqlens.shape)}, got "
            f"{host.dtype} {tuple(host.shape)} on {host.device}"
        )
    if int(host[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(host[0])}")
    drops = torch.nonzero(host.diff() < 0)
    if drops.numel():
        bad = int(drops[0, 0])
        raise ValueError(
            f"cu_seqlens must be non-decreasing, got cu_seqlens[{bad}] = {int(host[bad])} > "
            f"cu_seqlens[{bad + 1}] = {int(host[bad + 1])}"
        )
    if int(host[-1]) != rows:
        raise ValueError(f"cu_seqlens must end at the {rows} rows of values, got {int(host[-1])}")
    return host


def check_same_rows(schemas: list[tuple[tuple[int, ...], torch.dtype, torch.device]], unit: str) -> None:
    """Refuses parts of a join whose row schemas differ from the first's.

    Args:
        schemas: ``(row_shape, dtype, device)`` per part.
        unit: What a part is called in the error (``"segment"``, ``"part"``).

    Raises:
        ValueError: The first differing part, with both schemas.
    """
    for i, schema in enumerate(schemas):
        if schema != schemas[0]:
            first, other = (" ".join(map(str, s)) for s in (schemas[0], schema))
            raise ValueError(
                f"{unit}s must share row_shape, dtype, device; {unit} 0 has {first}, {unit} {i} has {other}"
            )


def repeat_counts(repeats: Any, count: int, *, unit: str) -> Tensor:
    """Per-unit repeat counts; floats and bools are refused, not truncated.

    Args:
        repeats: An int >= 0 for every unit, or one count >= 0 per unit (device counts: a sync).
        count: The number of units.
        unit: What a unit is called in the error.

    Returns:
        Host int64 ``[count]``.

    Raises:
        ValueError: A negative count, a non-integer, or not ``count`` entries.
    """
    if isinstance(repeats, (Tensor, np.ndarray)) and repeats.ndim == 0:
        repeats = repeats.item()
    if isinstance(repeats, (int, np.integer)) and not isinstance(repeats, (bool, np.bool_)):
        repeats = torch.full((count,), int(repeats), dtype=torch.int64)
    elif not isinstance(repeats, (Tensor, np.ndarray, list, tuple)):
        raise ValueError(
            f"repeats must be an int >= 0 or one count >= 0 per {unit} ({count}), got {repeats!r}"
        )
    per_unit = host_lengths(repeats, "repeats")
    if per_unit.numel() != count:
        raise ValueError(
            f"repeats must have one entry per {unit} ({count}), got {per_unit.numel()}; pass an int "
            f">= 0 or one count >= 0 per {unit} ({count})"
        )
    return per_unit


def segment_ids_and_positions(lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Each packed row's segment and its position within it: host int64 ``[sum(lengths)]`` each.

    Args:
        lengths: Host int64 ``[B]``.
    """
    total = int(lengths.sum())
    starts = lengths.cumsum(0) - lengths
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=total)
    return segment, torch.arange(total) - starts[segment]


def check_side(side: str) -> None:
    """Refuses a padding side other than ``"left"`` or ``"right"``.

    Args:
        side: The value to check.

    Raises:
        ValueError: Any other value.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")


def check_fill_value(
    value: Any, dtype: torch.dtype, name: str = "pad", what: str = "dtype"
) -> int | float | bool:
    """``value`` as a Python scalar that ``dtype`` stores faithfully: exactly for integer and bool
    dtypes (``torch.full`` would wrap -1 to 255 in uint8), finite staying finite for floating ones.

    Args:
        value: A Python or numpy real scalar.
        dtype: The dtype it will be stored in.
        name, what: How the value and ``dtype`` are called in the error.

    Returns:
        ``value`` as a Python ``bool``, ``int`` or ``float``.

    Raises:
        ValueError: Not a real scalar, or not representable in ``dtype``.
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
    """Refuses a pad row that does not broadcast to exactly ``row_shape``.

    Args:
        pad: The pad tensor.
        row_shape: The shape of one row.
        name: The argument's name, for the error.

    Raises:
        ValueError: ``pad`` does not broadcast, or broadcasts to a larger shape.
    """
    try:
        fits = torch.broadcast_shapes(pad.shape, row_shape) == torch.Size(row_shape)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"{name} row of shape {tuple(pad.shape)} does not broadcast to row shape {row_shape}"
        )


def to_device_async(host: Tensor, device: torch.device) -> Tensor:
    """Host tensor to ``device`` without a sync. A ``non_blocking`` copy from pageable memory may
    sync, so pageable CUDA sources are staged through torch's pinned caching allocator first.

    Args:
        host: A CPU tensor.
        device: The target device.

    Returns:
        ``host`` itself for the CPU, else the device copy (in flight on the current stream).
    """
    if device.type == "cpu":
        return host
    if device.type == "cuda" and host.device.type == "cpu" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def batch_index(index: Any, count: int, *, owner: str, unit: str) -> int | slice | Tensor:
    """Normalises an index along a batch's leading axis.

    Args:
        index: An int, a slice, a sequence or tensor of ints, or a bool mask of length ``count``;
            device indices cost a sync.
        count: The batch's length.
        owner: The batch's class name, for errors.
        unit: What one element is called, for errors.

    Returns:
        An int in ``[0, count)``, a step-1 ``slice(start, stop >= start)``, or host int64 positions
        ``[n]`` (negative ones wrapped).

    Raises:
        TypeError: A bool scalar or an unsupported index type.
        IndexError: Out of range, not 1-D, a mask of the wrong length, or non-integer values.
    """
    if isinstance(index, (Tensor, np.ndarray)) and index.ndim == 0:
        index = index.item()  # a bool stays a bool, refused below
    if isinstance(index, (bool, np.bool_)):
        raise TypeError(f"a {owner} cannot be indexed by a bool scalar; use a mask of length B")
    if isinstance(index, (int, np.integer)):
        position = operator.index(index)
        if not -count <= position < count:
            raise IndexError(f"{unit} {position} is out of range for a {owner} of {count} {unit}s")
        return position % count
    if isinstance(index, slice):
        start, stop, step = index.indices(count)
        if step != 1:  # (torch.arange refuses empty ranges such as 1:0:2)
            return start + step * torch.arange(len(range(start, stop, step)), dtype=torch.int64)
        return slice(start, max(start, stop))
    if not isinstance(index, (Tensor, np.ndarray, list, tuple)):
        raise TypeError(f"unsupported {owner} index of type {type(index).__name__}")
    tensor = _as_tensor(index).cpu()
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
    """``(raw uint8 C-order bytes, dtype name, shape)`` of a tensor, to pickle any dtype (numpy has
    no bfloat16).

    Args:
        tensor: Any tensor; device tensors cost a copy to the host (a sync).
    """
    host = tensor.detach().cpu().contiguous()
    # (an empty tensor may carry a zero stride, which a dtype view refuses)
    raw = host.reshape(-1).view(torch.uint8).numpy() if host.numel() else np.empty(0, np.uint8)
    return raw, str(host.dtype).removeprefix("torch."), tuple(host.shape)


def tensor_from_bytes(raw: np.ndarray, dtype_name: str, shape: tuple[int, ...]) -> Tensor:
    """Inverse of `tensor_to_bytes`.

    Args:
        raw: uint8 ndarray; shared unless read-only (then copied).
        dtype_name, shape: The dtype's name (``"bfloat16"``) and the shape.

    Returns:
        A CPU tensor.
    """
    dtype = getattr(torch, dtype_name)
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    if not raw.flags.writeable:  # out-of-band pickle buffers may be read-only
        raw = raw.copy()
    return torch.from_numpy(raw).view(dtype).reshape(shape)
