"""Host-side index arithmetic for ragged batches (segments of varying length).

Everything here runs on small CPU tensors (per segment or per row int64 indices) so that the
device-side work it plans (an ``index_select``, an ``index_copy_``) needs no device->host sync.
Shared by ``PackedTensor`` and by anything else that maps packed rows onto padded grids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "INT32_MAX",
    "LengthsLike",
    "check_side",
    "host_int64",
    "offsets_from_lengths",
    "padded_flat_index",
    "segment_ids_and_positions",
    "to_device_async",
]

INT32_MAX = 2**31 - 1

LengthsLike = Sequence[int] | Tensor | np.ndarray


def host_int64(data: LengthsLike, name: str) -> Tensor:
    """``data`` as a 1-D int64 CPU tensor; ``name`` goes into the error messages.

    Cost: a device tensor is copied to the host (one sync); host data is converted in place.
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


def to_device_async(host: Tensor, device: torch.device) -> Tensor:
    """Host tensor -> ``device`` without blocking the host and never a device->host sync.

    Returns ``host`` itself for a CPU ``device``.
    """
    if device.type == "cpu":
        return host
    # Asynchronous host->device copies are stream-ordered before any kernel reading them, and
    # pageable sources are staged before the call returns, so the host tensor may die right away.
    return host.to(device, non_blocking=True)
