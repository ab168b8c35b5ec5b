"""Padded ``[B, S, *row_shape]`` batches: packed rows to and from them (the row placement is
planned on the host from the lengths, so each direction is one device gather or scatter and never
a sync), and the rotary positions of a left-padded batch."""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from r3lightning.ragged import (
    LengthsLike,
    check_fill_value,
    check_pad_row,
    check_side,
    host_int64,
    offsets_from_lengths,
    segment_ids_and_positions,
    to_device_async,
)


def padded_flat_index(lengths: Tensor, width: int, side: str) -> Tensor:
    """Each packed row's index in a flattened ``[B, width]`` grid.

    Args:
        lengths: Host int64 ``[B]``, each ``<= width`` (checked by the caller).
        width: The grid's row width ``S``.
        side: ``"left"``: rows end at column ``S - 1``; ``"right"``: rows start at column 0
            (checked by the caller).

    Returns:
        Host int64 ``[sum(lengths)]``.
    """
    segment, positions = segment_ids_and_positions(lengths)
    column = positions + (width - lengths[segment]) if side == "left" else positions
    return segment * width + column


def rows_from_padded(padded: Tensor, lengths: LengthsLike, side: str) -> tuple[Tensor, Tensor]:
    """The real rows of a padded batch, gathered by one ``index_select`` into new storage.

    Args:
        padded: ``[B, S, *row_shape]``.
        lengths: ``[B]`` real rows per batch row, each ``<= S``; device lengths cost a sync.
        side: ``"left"`` takes ``padded[i, S - lengths[i]:]``, ``"right"`` ``padded[i, :lengths[i]]``.

    Returns:
        ``(values, cu_seqlens_host)``: ``[sum(lengths), *row_shape]`` on ``padded``'s device, and
        host int32 ``[B + 1]``.

    Raises:
        ValueError: ``padded`` below 2-D, not ``B`` lengths, a length over ``S``, or a bad ``side``.
    """
    check_side(side)
    if not isinstance(padded, Tensor) or padded.dim() < 2:
        shape = tuple(padded.shape) if isinstance(padded, Tensor) else type(padded).__name__
        raise ValueError(f"padded must be a tensor [B, S, *row_shape], got {shape}")
    batch = padded.shape[0]
    width = padded.shape[1]
    counts = host_int64(lengths, "lengths")
    if counts.numel() != batch:
        raise ValueError(f"lengths must have one entry per row of padded ({batch}), got {counts.numel()}")
    offsets = offsets_from_lengths(counts)
    if batch and int(counts.max()) > width:
        bad = int(torch.argmax(counts))
        raise ValueError(f"lengths[{bad}] = {int(counts[bad])} exceeds the padded width {width}")
    flat = to_device_async(padded_flat_index(counts, width, side), padded.device)
    return padded.flatten(0, 1).index_select(0, flat), offsets


def padded_from_rows(
    values: Tensor, lengths: Tensor, max_len: int | None, pad: float | bool | Tensor, side: str
) -> Tensor:
    """Packed rows spread into a padded batch: one fill and one ``index_copy_``, no sync.

    Args:
        values: ``[sum(lengths), *row_shape]``.
        lengths: Host int64 ``[B]``.
        max_len: Width ``S`` of the result (None: the longest segment).
        pad: A scalar the dtype stores faithfully, or a tensor broadcasting to one row.
        side: ``"left"`` puts the real rows at the right end of each row (the RL convention),
            ``"right"`` at the start.

    Returns:
        ``[B, S, *row_shape]`` in ``values``' dtype and device.

    Raises:
        ValueError: ``max_len`` below the longest segment, a bad ``pad``, or a bad ``side``.
    """
    check_side(side)
    row_shape = tuple(values.shape[1:])
    longest = int(lengths.max()) if lengths.numel() else 0
    width = longest if max_len is None else operator.index(max_len)
    if width < longest:
        raise ValueError(f"max_len = {width} is shorter than the longest segment ({longest})")
    shape = (lengths.numel(), width, *row_shape)
    if isinstance(pad, Tensor):
        check_pad_row(pad, row_shape)
        out = pad.to(device=values.device, dtype=values.dtype).expand(shape).clone()
    else:
        out = torch.full(shape, check_fill_value(pad, values.dtype), dtype=values.dtype, device=values.device)
    flat = padded_flat_index(lengths, width, side)
    out.view(-1, *row_shape).index_copy_(0, to_device_async(flat, values.device), values)
    return out


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Rotary positions of a left-padded batch: ``[pad, pad, a, b]`` -> ``[0, 0, 0, 1]``.

    Args:
        attention_mask: ``[B, S]`` bool or 0/1, left-padded, on any device.

    Returns:
        int64 ``[B, S]`` on the mask's device (padding gets 0). One cumsum; no host sync.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
