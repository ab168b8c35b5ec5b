"""Where each real token of a left-padded ``[B, S]`` batch sits in the tensor the model sees: a
host map, so moving data costs one host->device index copy per call and never a sync."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from r3lightning.checks import check_int, check_rank
from r3lightning.padded import position_ids_from_mask  # re-exported: its public path since 0.2
from r3lightning.ragged import (
    check_fill_value,
    check_pad_row,
    check_side,
    host_lengths,
    offsets_from_lengths,
    segment_ids_and_positions,
    to_device_async,
)

__all__ = ["Pad", "TokenMetadataLayout", "position_ids_from_mask", "split_for_sequence_parallel"]

# a scalar, one row broadcast to every uncovered position, or ``pad(n) -> [n, *row_shape]``
Pad = int | float | bool | torch.Tensor | Callable[[int], torch.Tensor]


def _width(name: str, width: int | None, lengths: torch.Tensor) -> int:
    """``width`` (default: the longest of ``lengths``), refused below the longest."""
    longest = int(lengths.max()) if lengths.numel() else 0
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < longest):
        raise ValueError(f"{name} must be an int >= the longest sequence ({longest}), got {width!r}")
    return longest if width is None else width


@dataclass(frozen=True, eq=False)
class TokenMetadataLayout:
    """Map from a batch's real tokens to the model-facing positions, built by `padded` or `packed`.

    Its tensors are on the host: aligning with it costs host index maths and a host-to-device
    index copy, never a device-to-host sync.

    Attributes:
        kind: ``"padded"`` (``[B, S']``) or ``"packed"`` (one ``[1, T_local]`` row).
        token_shape: The shape of the model's token tensor.
        sequence_lengths: int64 ``[B]``: real tokens of each trajectory.
        batch_width: ``S`` of the canonical left-padded batch.
        position_sequence: int64 ``[num_positions]``: each position's trajectory (-1: padding).
        position_offset: int64 ``[num_positions]``: each position's real-token offset in its
            trajectory (-1: padding).
        position_ids: int64 ``[*token_shape]``: rotary positions (packed padding keeps counting,
            padded padding is 0).
        side: Where a padded layout's padding sits in the model's batch.
        pad_to_multiple: The multiple ``S'`` (padded) or each sequence (packed) is padded to.
        cu_seqlens: int32 ``[B + 1]`` offsets of the real tokens in the unsharded packed row
            (None when padded).
        cu_seqlens_padded: int32 ``[B + 1]`` offsets of the padded sequences in the unsharded
            packed row, for varlen attention (None when padded).
        cp_size: Context-parallel ranks the packed row is shared over.
        cp_rank: This rank's place among them.
    """

    kind: Literal["padded", "packed"]
    token_shape: tuple[int, ...]
    sequence_lengths: torch.Tensor
    batch_width: int
    position_sequence: torch.Tensor
    position_offset: torch.Tensor
    position_ids: torch.Tensor
    side: Literal["left", "right"] = "left"
    pad_to_multiple: int = 1
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None
    cp_size: int = 1
    cp_rank: int = 0

    @classmethod
    def padded(
        cls,
        attention_mask: torch.Tensor,
        *,
        side: Literal["left", "right"] = "left",
        pad_to_multiple: int = 1,
    ) -> TokenMetadataLayout:
        """The layout of a padded batch.

        Args:
            attention_mask: ``[B, S]`` bool or 0/1, left-padded (``0...0 1...1`` per row).
            side: Where the padding goes in the model's batch.
            pad_to_multiple: ``S`` is rounded up to a multiple of it.

        Returns:
            Token shape ``[B, S']``. Host maths; a device mask costs one device-to-host copy (a sync).

        Raises:
            ValueError: A mask not 2-D, not 0/1 or not left-padded, or a bad ``side`` or multiple.
        """
        check_side(side)
        multiple = check_int("pad_to_multiple", pad_to_multiple)
        mask = torch.as_tensor(attention_mask).detach().cpu()
        if mask.dim() != 2:
            raise ValueError(f"attention_mask must be 2-D [batch, seq], got shape {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            if mask.dtype.is_complex or bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError("attention_mask must be bool or hold only 0/1")
            mask = mask != 0
        batch, width = mask.shape
        lengths = mask.sum(1, dtype=torch.int64)  # [B]
        expected = torch.arange(width) >= (width - lengths)[:, None]  # [B, S] left-padded
        bad = (expected != mask).any(1).nonzero()
        if bad.numel():
            row = int(bad[0, 0])
            raise ValueError(
                f"attention_mask row {row} is not left-padded (expected 0...0 1...1 with real tokens "
                f"at the right end), got {mask[row].int().tolist()}; the mask is the canonical batch's, "
                f"side={side!r} only chooses how the model sees it"
            )
        model_width = -(-width // multiple) * multiple
        offset = torch.arange(model_width).expand(batch, model_width)  # [B, S']
        if side == "left":
            offset = offset - (model_width - lengths)[:, None]
        real = (offset >= 0) & (offset < lengths[:, None])  # [B, S']
        sequence = torch.arange(batch)[:, None].expand(batch, model_width)
        return cls(
            kind="padded",
            token_shape=(batch, model_width),
            sequence_lengths=lengths,
            batch_width=width,
            position_sequence=torch.where(real, sequence, -1).reshape(-1),
            position_offset=torch.where(real, offset, -1).reshape(-1),
            position_ids=torch.where(real, offset, 0),
            side=side,
            pad_to_multiple=multiple,
        )

    @classmethod
    def packed(
        cls,
        sequence_lengths: Sequence[int] | torch.Tensor,
        *,
        pad_to_multiple: int = 1,
        cp_size: int = 1,
        cp_rank: int = 0,
        batch_width: int | None = None,
        pad_total_to_multiple: int = 1,
    ) -> TokenMetadataLayout:
        """The layout of a batch packed into one row ``[seq0, pad0, seq1, pad1, ...]``.

        Args:
            sequence_lengths: Real tokens of each sequence, ``[B]``.
            pad_to_multiple: Each sequence is padded to a multiple of it.
            cp_size: Context-parallel ranks; each holds its share of every sequence.
            cp_rank: This rank's place among them.
            batch_width: ``S`` of the canonical padded batch (default: the longest sequence).
            pad_total_to_multiple: The last sequence's padding grows so the total aligns (fp8 GEMMs).

        Returns:
            Token shape ``[1, T_local]``: this context-parallel rank's share. O(T_local) host ops;
            device ``sequence_lengths`` cost one sync.

        Raises:
            ValueError: A bad length, multiple, rank or width.
        """
        multiple = check_int("pad_to_multiple", pad_to_multiple)
        total_multiple = check_int("pad_total_to_multiple", pad_total_to_multiple)
        cp = check_int("cp_size", cp_size)
        check_rank("cp_rank", cp_rank, "cp_size", cp)
        if cp > 1 and multiple % (2 * cp):
            raise ValueError(
                f"pad_to_multiple ({multiple}) must be a multiple of 2 * cp_size = {2 * cp}: each "
                f"padded sequence is cut into {2 * cp} equal context-parallel chunks"
            )
        if total_multiple > 1 and total_multiple % multiple:
            raise ValueError(
                f"pad_total_to_multiple ({total_multiple}) must be a multiple of pad_to_multiple "
                f"({multiple}): the extra padding goes to the last sequence, which stays aligned"
            )
        lengths = host_lengths(sequence_lengths, "sequence_lengths")
        batch_width = _width("batch_width", batch_width, lengths)
        padded = -(-lengths // multiple) * multiple  # [B]
        if total_multiple > 1 and padded.numel():
            padded[-1] += (-int(padded.sum())) % total_multiple
        cu_padded = offsets_from_lengths(padded, "padded sequence_lengths")  # [B + 1] int32, T < 2**31
        sequence, local = segment_ids_and_positions(padded // cp)  # [T_local] each
        chunk = (padded // (2 * cp))[sequence]  # [T_local] (cp == 1: half a sequence, both kept)
        # offset in the sequence's padded span: the kept chunks are cp_rank and 2cp-1-cp_rank, so
        # the second one's local positions (from chunk on) shift by (2cp-1-cp_rank-1) chunks
        span_offset = local + torch.where(local < chunk, cp_rank, 2 * cp - 2 - cp_rank) * chunk
        real = span_offset < lengths[sequence]
        return cls(
            kind="packed",
            token_shape=(1, sequence.numel()),
            sequence_lengths=lengths,
            batch_width=batch_width,
            position_sequence=torch.where(real, sequence, -1),
            position_offset=torch.where(real, span_offset, -1),
            position_ids=span_offset.reshape(1, -1),
            pad_to_multiple=multiple,
            cu_seqlens=offsets_from_lengths(lengths, "sequence_lengths"),
            cu_seqlens_padded=cu_padded,
            cp_size=cp,
            cp_rank=cp_rank,
        )

    def __repr__(self) -> str:
        extra = f", side={self.side!r}" if self.kind == "padded" else f", cp={self.cp_rank}/{self.cp_size}"
        return (
            f"TokenMetadataLayout(kind={self.kind!r}, token_shape={self.token_shape}, "
            f"batch_size={self.batch_size}, real_tokens={int(self.sequence_lengths.sum())}, "
            f"pad_to_multiple={self.pad_to_multiple}{extra})"
        )

    @property
    def batch_size(self) -> int:
        """``B``: the number of trajectories."""
        return self.sequence_lengths.numel()

    @property
    def num_positions(self) -> int:
        """``prod(token_shape)``."""
        return self.position_sequence.numel()

    @property
    def token_mask(self) -> torch.Tensor:
        """bool host ``[*token_shape]``: True where a real token sits (the model's attention mask)."""
        return (self.position_sequence >= 0).reshape(self.token_shape)

    @property
    def max_seqlen_padded(self) -> int:
        """Longest padded sequence of a packed layout (for varlen attention)."""
        if self.cu_seqlens_padded is None:
            raise ValueError("max_seqlen_padded is defined for packed layouts only")
        return int((self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).max()) if self.batch_size else 0

    def source_index(
        self,
        row_offsets: torch.Tensor,
        *,
        starts: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
        next_token: bool = False,
    ) -> torch.Tensor:
        """Each model-facing position's row in a source that holds some real tokens of each trajectory.

        Args:
            row_offsets: int64 host ``[B]``: the source row of trajectory ``i``'s first held token.
            starts: int64 host ``[B]``: the real-token offset of that first held token (None: 0).
            counts: int64 host ``[B]``: how many real tokens of trajectory ``i`` the source holds
                from there (None: all the rest).
            next_token: Token ``j`` takes token ``j + 1``'s row (targets of next-token losses).

        Returns:
            int64 host ``[num_positions]``: each position's source row, -1 where none (padding, a
            token the source does not hold, past the end with ``next_token``); host maths.
        """
        sequence = self.position_sequence
        offset = self.position_offset + int(next_token)
        if self.batch_size == 0:
            return torch.full_like(sequence, -1)
        index = sequence.clamp(min=0)
        start = starts[index] if starts is not None else torch.zeros_like(index)
        end = start + counts[index] if counts is not None else self.sequence_lengths[index]
        covered = (sequence >= 0) & (offset >= start) & (offset < end)
        covered &= offset < self.sequence_lengths[index]
        return torch.where(covered, row_offsets[index] + offset - start, -1)

    def batch_row_offsets(self, width: int) -> torch.Tensor:
        """The flat row of each trajectory's first real token in a left-padded ``[B, width]`` batch.

        Args:
            width: ``S`` of the batch: an int, at least the longest sequence (else ``ValueError``).

        Returns:
            int64 host ``[B]``, for `source_index`'s ``row_offsets``.
        """
        width = _width("batch width", width, self.sequence_lengths)
        return torch.arange(self.batch_size) * width + width - self.sequence_lengths

    def from_batch(self, tensor: torch.Tensor, *, pad: Pad = 0, next_token: bool = False) -> torch.Tensor:
        """Lays a tensor of the canonical left-padded batch out as the model sees its tokens.

        Args:
            tensor: ``[B, S, *row]``, left-padded like the batch's ``attention_mask`` (input ids,
                loss mask, logprobs...), on any device.
            pad: What positions without a real token hold: a scalar, a row, or ``pad(n) -> [n, *row]``.
            next_token: Token ``j`` takes token ``j + 1``'s value (labels, next-token loss masks);
                the last token of each sequence gets ``pad``.

        Returns:
            ``[*token_shape, *row]`` on ``tensor``'s device (dtype promoted with a tensor ``pad``'s);
            cost as `take_rows`, no host sync.

        Raises:
            ValueError: ``tensor`` is not ``[B, S, ...]`` for this ``B`` with ``S`` >= the longest
                sequence, or ``pad`` does not fit.
        """
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or tensor.shape[0] != self.batch_size:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"tensor must be a [B={self.batch_size}, S, ...] batch tensor, got {shape}")
        index = self.source_index(self.batch_row_offsets(tensor.shape[1]), next_token=next_token)
        return take_rows(tensor.reshape(-1, *tensor.shape[2:]), index, pad, self.token_shape)


def take_rows(
    source: torch.Tensor, index: torch.Tensor, pad: Pad, token_shape: tuple[int, ...]
) -> torch.Tensor:
    """Gathers rows into a token-shaped tensor, padding where no row is given.

    Args:
        source: ``[rows, *row]`` on any device.
        index: int64 host ``[prod(token_shape)]``: the source row of each position, -1 for ``pad``
            (as `TokenMetadataLayout.source_index` makes it).
        pad: A scalar ``source``'s dtype stores exactly, one row broadcasting to ``row``, or
            ``pad(n) -> [n, *row]`` for the ``n`` padding positions.
        token_shape: The leading shape of the result.

    Returns:
        ``[*token_shape, *row]`` on ``source``'s device, in its dtype promoted with a tensor
        ``pad``'s. Cost: a gather-index copy and one ``index_select``, then a padding-index copy
        and an ``index_fill_`` or indexed write; no host sync.

    Raises:
        ValueError: ``pad`` is none of the above, or does not fit the dtype or the row shape.
    """
    uncovered = (index < 0).nonzero().reshape(-1)  # host
    row_shape = tuple(source.shape[1:])
    count = uncovered.numel()
    if isinstance(pad, (bool, int, float)):
        fill = check_fill_value(pad, source.dtype, what="metadata dtype")
    elif callable(pad) and not isinstance(pad, torch.Tensor):
        fill = pad(count)
        if not isinstance(fill, torch.Tensor) or tuple(fill.shape) != (count, *row_shape):
            got = tuple(fill.shape) if isinstance(fill, torch.Tensor) else type(fill).__name__
            raise ValueError(f"pad({count}) must return a tensor of shape {(count, *row_shape)}, got {got}")
    elif isinstance(pad, torch.Tensor):
        check_pad_row(pad, row_shape)
        fill = pad
    else:
        raise ValueError(f"pad must be a scalar, a row tensor or a callable, got {type(pad).__name__}")
    device = source.device
    if source.shape[0]:
        # padding positions gather row 0 and are overwritten below: one kernel, no masked gather
        out = source.index_select(0, to_device_async(index.clamp(min=0), device))
    else:  # nothing to gather: every position is padding
        out = source.new_empty((index.numel(), *row_shape))
    if isinstance(fill, torch.Tensor):
        out = out.to(torch.promote_types(out.dtype, fill.dtype))
        fill = to_device_async(fill, device).to(out.dtype)
    if count:
        positions = to_device_async(uncovered, device)
        if isinstance(fill, torch.Tensor):
            out[positions] = fill
        else:  # a Scalar argument, not a CPU tensor that indexing would copy to the device
            out.index_fill_(0, positions, fill)
    return out.reshape(*token_shape, *row_shape)


def split_for_sequence_parallel(
    tensor: torch.Tensor, tp_size: int, tp_rank: int, *, dim: int = 1
) -> torch.Tensor:
    """This tensor-parallel rank's contiguous share of a token dimension, for sequence parallelism.

    Args:
        tensor: Any tensor whose dimension ``dim`` is the token axis.
        tp_size: Tensor-parallel ranks (>= 1); they split the axis into equal contiguous parts.
        tp_rank: This rank's place among them, in ``[0, tp_size)``.
        dim: The token dimension (negative counts from the end).

    Returns:
        A view of ``tensor`` with ``size / tp_size`` entries on ``dim``: no copy, no sync.

    Raises:
        ValueError: A bad size or rank, ``dim`` out of range, or a token dimension that
            ``tp_size`` does not divide (pad the layout to a multiple of it).
    """
    tp = check_int("tp_size", tp_size)
    check_rank("tp_rank", tp_rank, "tp_size", tp)
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"dim {dim} out of range for a tensor of shape {tuple(tensor.shape)}")
    size = tensor.shape[dim]
    if size % tp:
        raise ValueError(
            f"token dimension {dim} of size {size} is not divisible by tp_size={tp} "
            f"(pad the layout to a multiple of the TP size)"
        )
    share = size // tp
    return tensor.narrow(dim, tp_rank * share, share)
