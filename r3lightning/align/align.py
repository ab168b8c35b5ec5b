"""Align packed per-token metadata (routes) with the tokens the model sees, and back; no syncs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from r3lightning.align.layout import Pad, TokenMetadataLayout, take_rows
from r3lightning.packed import PackedTensor
from r3lightning.ragged import check_fill_value, host_lengths, to_device_async

__all__ = ["align_packed_token_metadata", "build_replay_mask", "scatter_to_padded_batch"]


def _segment_starts(
    segment_starts: Sequence[int] | torch.Tensor | None, counts: torch.Tensor, layout: TokenMetadataLayout
) -> torch.Tensor:
    """Validated host int64 ``[B]`` starts; each segment must fit inside its trajectory."""
    batch = layout.batch_size
    if counts.numel() != batch:
        raise ValueError(
            f"packed metadata has {counts.numel()} segments but the layout has {batch} trajectories"
        )
    starts = host_lengths([0] * batch if segment_starts is None else segment_starts, "segment_starts")
    if starts.numel() != batch:
        raise ValueError(f"segment_starts must have one entry per trajectory ({batch}), got {starts.numel()}")
    overrun = (starts + counts > layout.sequence_lengths).nonzero()
    if overrun.numel():
        i = int(overrun[0, 0])
        raise ValueError(
            f"segment {i} has {int(counts[i])} rows starting at real-token offset {int(starts[i])}, but "
            f"trajectory {i} has only {int(layout.sequence_lengths[i]) - int(starts[i])} real tokens "
            f"from there ({int(layout.sequence_lengths[i])} in all)"
        )
    return starts


def align_packed_token_metadata(
    packed: PackedTensor,
    layout: TokenMetadataLayout,
    *,
    pad: Pad,
    segment_starts: Sequence[int] | torch.Tensor | None = None,
    next_token: bool = False,
) -> torch.Tensor:
    """Lays per-token metadata out as the model sees its tokens.

    Args:
        packed: One segment per trajectory, rows ``[*row_shape]`` (routes ``[L, K]``, logprobs ``[]``).
        layout: The model-facing layout of the batch's tokens.
        pad: What positions without a row hold: a scalar, one row, or ``pad(n) -> [n, *row_shape]``.
        segment_starts: The real-token offset of each segment's first row (None: 0): a trace's
            ``prompt_start``. A segment never runs past its trajectory's end.
        next_token: Token ``j`` takes token ``j + 1``'s row (targets of next-token losses).

    Returns:
        ``[*layout.token_shape, *packed.row_shape]`` on ``packed``'s device, in its dtype (promoted
        with the dtype of a tensor ``pad``, or of what a callable ``pad`` returns, if that is
        wider). Cost: host index maths, one host-to-device copy of the gather index, one
        ``index_select``, and one more index copy and indexed write for the padding positions;
        no host sync (device ``segment_starts`` cost one).

    Raises:
        TypeError: ``packed`` is not a ``PackedTensor``.
        ValueError: ``packed`` has not one segment per trajectory, a segment runs past its
            trajectory's end, ``segment_starts`` has the wrong length, or ``pad`` is not a scalar
            the dtype holds, a row that broadcasts to ``row_shape`` or a callable returning
            ``[n, *row_shape]``.
    """
    if not isinstance(packed, PackedTensor):
        raise TypeError(f"packed must be a PackedTensor, got {type(packed).__name__}")
    counts = packed.lengths
    starts = _segment_starts(segment_starts, counts, layout)
    row_offsets = packed.cu_seqlens_host[:-1].to(torch.int64)
    index = layout.source_index(row_offsets, starts=starts, counts=counts, next_token=next_token)
    return take_rows(packed.values, index, pad, layout.token_shape)


def build_replay_mask(
    packed_or_lengths: PackedTensor | Sequence[int] | torch.Tensor,
    layout: TokenMetadataLayout,
    segment_starts: Sequence[int] | torch.Tensor | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Marks the positions where a captured row lands.

    Args:
        packed_or_lengths: The packed rows (only their host ``lengths`` are read), or the row
            count of each segment, ``[B]``.
        layout: The model-facing layout of the batch's tokens.
        segment_starts: The real-token offset of each segment's first row (None: 0).
        device: Where the mask goes (default: the packed rows' device, or the host for lengths);
            a CUDA copy is staged through page-locked memory and does not block.

    Returns:
        bool ``[*layout.token_shape]``: True where a row lands. Host maths and at most one
        non-blocking host-to-device copy; no host sync (device lengths or starts cost one).

    Raises:
        ValueError: Not one count per trajectory, a negative count, or a segment that runs past
            its trajectory's end.
    """
    packed = isinstance(packed_or_lengths, PackedTensor)
    counts = packed_or_lengths.lengths if packed else host_lengths(packed_or_lengths, "lengths")
    device = packed_or_lengths.device if packed and device is None else device
    starts = _segment_starts(segment_starts, counts, layout)
    offsets = torch.cumsum(counts, 0) - counts
    index = layout.source_index(offsets, starts=starts, counts=counts)
    mask = (index >= 0).reshape(layout.token_shape)
    return mask if device is None else to_device_async(mask, torch.device(device))


def scatter_to_padded_batch(
    tensor: torch.Tensor,
    layout: TokenMetadataLayout,
    *,
    width: int | None = None,
    pad: int | float | bool = 0,
    next_token: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Puts model-facing values back in the canonical left-padded batch: the inverse of
    ``layout.from_batch``.

    Args:
        tensor: ``[*layout.token_shape, *row]`` values on any device (per-token logprobs ``[]``
            rows, hidden states ``[H]``...).
        layout: The layout ``tensor`` is in.
        width: ``S`` of the batch (default: ``layout.batch_width``); at least the longest sequence.
        pad: What the positions no value lands on hold in a new batch; a scalar ``tensor``'s
            dtype stores exactly.
        next_token: The values are next-token ones (``from_batch(..., next_token=True)``): the
            value at token ``j`` goes to token ``j + 1``.
        out: A contiguous ``[B, width, *row]`` tensor of ``tensor``'s dtype and device to write
            into instead of a new one (each context-parallel rank's shard into one batch); its
            other positions are left as they are.

    Returns:
        ``[B, width, *row]`` in ``tensor``'s dtype on its device (``out`` itself when given).
        Cost: host index maths, two host-to-device index copies, one ``index_select`` and one
        indexed write; no host sync.

    Raises:
        ValueError: ``tensor`` does not lead with the layout's token shape, ``width`` is shorter
            than the longest sequence, ``pad`` does not fit the dtype, or ``out`` does not match.
    """
    expected = layout.token_shape
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape[: len(expected)]) != expected:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"tensor must have the layout's token shape {expected} leading, got {got}")
    row_shape = tuple(tensor.shape[len(expected) :])
    width = layout.batch_width if width is None else width
    index = layout.source_index(layout.batch_row_offsets(width), next_token=next_token)
    shape = (layout.batch_size, width, *row_shape)
    wanted = (shape, tensor.dtype, tensor.device)
    if out is None:
        out = torch.full(shape, check_fill_value(pad, tensor.dtype), dtype=tensor.dtype, device=tensor.device)
    elif (tuple(out.shape), out.dtype, out.device) != wanted or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {tensor.dtype} tensor of shape {shape} on {tensor.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    positions = (index >= 0).nonzero().reshape(-1)  # host
    if positions.numel():
        values = tensor.reshape(-1, *row_shape).index_select(0, to_device_async(positions, tensor.device))
        out.view(-1, *row_shape)[to_device_async(index[positions], tensor.device)] = values
    return out
