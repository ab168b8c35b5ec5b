"""Where each real token of a batch sits in the tensor the model actually sees.

A batch of ``B`` trajectories is canonically a left-padded ``[B, S]`` tensor (real tokens at the
right end). Models see other arrangements: the same rectangle widened to a multiple (HF, Megatron's
unpacked path, possibly right-padded), or one packed ``[1, T]`` row ``[seq0, pad0, seq1, pad1, ...]``
whose sequences are each padded to a multiple and, under context parallelism, cut into ``2 * cp``
chunks of which rank ``r`` keeps ``r`` and ``2 * cp - 1 - r``.

:class:`TokenMetadataLayout` records, for every model-facing position, which real token it holds
(trajectory ``i``, real-token offset ``j``) or that it is padding. Every per-token quantity is moved
with that one map: routes (``align_packed_token_metadata``), batch tensors (:meth:`from_batch`),
and model outputs going back to the batch (``scatter_to_padded_batch``). The map is built on the
host, vectorised, when the layout is built; moving data with it costs one host->device copy of an
int64 index per call (staged through page-locked memory) and never a device->host sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

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

_CPU = torch.device("cpu")


def _round_up(value: torch.Tensor | int, multiple: int) -> torch.Tensor | int:
    return (value + multiple - 1) // multiple * multiple


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` when it is an ``int`` (not a bool) ``>= minimum``; else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_rank(name: str, rank: object, size_name: str, size: int) -> int:
    """``rank`` when it is an ``int`` in ``[0, size)``; else ``ValueError`` naming both fields."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{name} must be an int in [0, {size}) for {size_name}={size}, got {rank!r}")
    return rank


@dataclass(frozen=True, eq=False)
class TokenMetadataLayout:
    """Map from the real tokens of a batch to the positions of the model-facing token tensor.

    Build it with :meth:`padded` or :meth:`packed`; the fields are host tensors.

    - ``kind``: ``"padded"`` (model sees ``[B, S']``) or ``"packed"`` (model sees ``[1, T_local]``).
    - ``token_shape``: the model-facing token shape.
    - ``sequence_lengths``: int64 host ``[B]``, real tokens per trajectory.
    - ``batch_width``: ``S`` of the canonical left-padded batch (default width for
      ``scatter_to_padded_batch``).
    - ``cu_seqlens`` / ``cu_seqlens_padded``: int32 host ``[B+1]`` global offsets of the real and of
      the padded sequences in the unsharded packed row (``None`` for padded layouts).
    - ``position_ids``: int64 host ``[*token_shape]``; real token ``j`` of a sequence has id ``j``.
      Packed padding keeps counting within its sequence's padded span (ids restart at 0 for each
      sequence, as packed attention and RoPE expect); padded-layout padding has id 0.
    - ``cp_size`` / ``cp_rank``: context-parallel sharding of a packed layout.
    - ``position_sequence`` / ``position_offset``: int64 host ``[num_positions]`` (flattened
      ``token_shape``): trajectory index and real-token offset held by each position, -1 for padding.
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

    # ----------------------------------------------------------------------------- constructors
    @classmethod
    def padded(
        cls,
        attention_mask: torch.Tensor,
        *,
        side: Literal["left", "right"] = "left",
        pad_to_multiple: int = 1,
    ) -> TokenMetadataLayout:
        """Layout of a model that sees the batch as a ``[B, S']`` rectangle.

        ``attention_mask`` is the canonical batch's ``[B, S]`` mask and must be left-padded (each
        row ``0...0 1...1``). ``S' = S`` rounded up to ``pad_to_multiple``. ``side="left"`` keeps real
        tokens at the right end (extra columns go on the left); ``side="right"`` moves them to the
        front (Megatron's unpacked path). Cost: O(B * S') host ops; one device->host copy if the
        mask lives on a GPU (pass the host mask at collate time to avoid it).
        """
        check_side(side)
        multiple = check_int("pad_to_multiple", pad_to_multiple)
        mask = torch.as_tensor(attention_mask)
        if mask.dim() != 2:
            raise ValueError(f"attention_mask must be 2-D [batch, seq], got shape {tuple(mask.shape)}")
        mask = mask.detach().to(_CPU)
        if mask.dtype != torch.bool:
            if mask.dtype.is_complex or bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError("attention_mask must be bool or hold only 0/1")
            mask = mask != 0
        batch, width = mask.shape
        lengths = mask.sum(1, dtype=torch.int64)  # [B]
        columns = torch.arange(width)
        expected = columns[None, :] >= (width - lengths)[:, None]  # [B, S] left-padded
        bad = (expected != mask).any(1).nonzero()
        if bad.numel():
            row = int(bad[0, 0])
            raise ValueError(
                f"attention_mask row {row} is not left-padded (expected 0...0 1...1 with real tokens "
                f"at the right end), got {mask[row].int().tolist()}; the mask is the canonical batch's, "
                f"side={side!r} only chooses how the model sees it"
            )
        model_width = int(_round_up(width, multiple))
        columns = torch.arange(model_width).expand(batch, model_width)  # [B, S']
        if side == "left":
            offset = columns - (model_width - lengths)[:, None]
        else:
            offset = columns
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
        """Layout of a model that sees the batch packed into one ``[1, T_local]`` row.

        Sequences are concatenated ``[seq0, pad0, seq1, pad1, ...]``, each padded to a multiple of
        ``pad_to_multiple`` (Megatron: TP, or ``2 * TP * CP`` with context parallelism). With
        ``cp_size > 1`` each padded sequence is cut into ``2 * cp_size`` equal chunks and this rank
        keeps chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` (load-balanced causal CP), so
        ``T_local = T / cp_size``. ``pad_total_to_multiple`` pads the whole unsharded row ``T`` to a
        multiple by extending the last sequence's padding (fp8 GEMMs need aligned token counts; see
        ``megatron_token_layout(fp8=True)``). ``batch_width`` is the width of the canonical
        left-padded batch (default: the longest sequence). Cost: O(T_local) host ops, no Python
        loop; device-resident ``sequence_lengths`` are read back once (a sync: pass host lengths).
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
        longest = int(lengths.max()) if lengths.numel() else 0
        if batch_width is None:
            batch_width = longest
        elif isinstance(batch_width, bool) or not isinstance(batch_width, int) or batch_width < longest:
            raise ValueError(
                f"batch_width must be an int >= the longest sequence ({longest}), got {batch_width!r}"
            )
        padded = _round_up(lengths, multiple)  # [B]
        if total_multiple > 1 and padded.numel():
            padded[-1] += (-int(padded.sum())) % total_multiple
        cu_padded = offsets_from_lengths(padded, "padded sequence_lengths")  # [B + 1] int32
        cu_real = offsets_from_lengths(lengths, "sequence_lengths")  # [B + 1] int32

        chunk = padded // (2 * cp)  # [B] chunk length (cp == 1: half a sequence, two halves kept)
        local_lengths = padded // cp  # [B]
        sequence, local = segment_ids_and_positions(local_lengths)  # [T_local] each
        chunk_of = chunk[sequence]
        # offset inside the sequence's padded span: first kept chunk is cp_rank, second 2cp-1-cp_rank
        span_offset = torch.where(
            local < chunk_of,
            cp_rank * chunk_of + local,
            (2 * cp - 1 - cp_rank) * chunk_of + (local - chunk_of),
        )
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
            cu_seqlens=cu_real,
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

    # ----------------------------------------------------------------------------- properties
    @property
    def batch_size(self) -> int:
        return self.sequence_lengths.numel()

    @property
    def num_positions(self) -> int:
        """Number of model-facing token positions, ``prod(token_shape)``."""
        return self.position_sequence.numel()

    @property
    def token_mask(self) -> torch.Tensor:
        """bool host ``[*token_shape]``: True where a real token sits (the model's attention mask)."""
        return (self.position_sequence >= 0).reshape(self.token_shape)

    @property
    def max_seqlen_padded(self) -> int:
        """Longest padded sequence of a packed layout (what varlen attention kernels take)."""
        if self.cu_seqlens_padded is None:
            raise ValueError("max_seqlen_padded is defined for packed layouts only")
        return int((self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).max()) if self.batch_size else 0

    # ----------------------------------------------------------------------------- index maps
    def source_index(
        self,
        row_offsets: torch.Tensor,
        *,
        starts: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
        next_token: bool = False,
    ) -> torch.Tensor:
        """int64 host ``[num_positions]``: source row for each position, -1 where none.

        A source stores trajectory ``i``'s real tokens ``starts[i] .. starts[i] + counts[i] - 1``
        as consecutive rows beginning at ``row_offsets[i]`` (defaults: start 0, all real tokens).
        With ``next_token`` the position of token ``j`` takes token ``j + 1``'s row (the last token
        of each sequence takes none). All arguments are host int64 ``[B]``; O(num_positions).
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
        """int64 host ``[B]``: flat row of each trajectory's first real token in a left-padded
        ``[B, width]`` batch."""
        longest = int(self.sequence_lengths.max()) if self.batch_size else 0
        if isinstance(width, bool) or not isinstance(width, int) or width < longest:
            raise ValueError(f"batch width must be an int >= the longest sequence ({longest}), got {width!r}")
        return torch.arange(self.batch_size) * width + width - self.sequence_lengths

    # ----------------------------------------------------------------------------- moving data
    def from_batch(self, tensor: torch.Tensor, *, pad: Pad = 0, next_token: bool = False) -> torch.Tensor:
        """Lay a canonical left-padded ``[B, S, *row]`` tensor out as ``[*token_shape, *row]``.

        For example ``input_ids``, ``attention_mask`` or ``loss_mask`` for the model; with
        ``next_token=True`` each position gets the *next* token's value (labels). Padding gets
        ``pad``. One index_select on the tensor's device after a host->device index copy.
        """
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or tensor.shape[0] != self.batch_size:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"tensor must be a [B={self.batch_size}, S, ...] batch tensor, got {shape}")
        width = tensor.shape[1]
        index = self.source_index(self.batch_row_offsets(width), next_token=next_token)
        return take_rows(tensor.reshape(-1, *tensor.shape[2:]), index, pad, self.token_shape)


def _pad_rows(
    pad: Pad, count: int, like: torch.Tensor
) -> tuple[torch.Tensor | int | float | bool, torch.dtype]:
    """Normalise ``pad`` for ``count`` uncovered positions of rows shaped like ``like[0]``."""
    row_shape = tuple(like.shape[1:])
    if isinstance(pad, (bool, int, float)):
        return check_fill_value(pad, like.dtype, what="metadata dtype"), like.dtype
    if callable(pad) and not isinstance(pad, torch.Tensor):
        rows = pad(count)
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (count, *row_shape):
            got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"pad({count}) must return a tensor of shape {(count, *row_shape)}, got {got}")
    elif isinstance(pad, torch.Tensor):
        check_pad_row(pad, row_shape)
        rows = pad
    else:
        raise ValueError(f"pad must be a scalar, a row tensor or a callable, got {type(pad).__name__}")
    dtype = torch.promote_types(like.dtype, rows.dtype)
    return to_device_async(rows, like.device).to(dtype), dtype


def take_rows(
    source: torch.Tensor, index: torch.Tensor, pad: Pad, token_shape: tuple[int, ...]
) -> torch.Tensor:
    """``[*token_shape, *row]``: ``source[index[p]]`` at each position, ``pad`` where ``index < 0``.

    ``index`` is an int64 host ``[num_positions]`` map (from :meth:`TokenMetadataLayout.source_index`).
    Tensor pads may widen the result (``torch.promote_types``); callable pads receive the number of
    uncovered positions and fill them in position order. Runs on ``source``'s device: host->device
    index copies only, no device->host sync.
    """
    uncovered = (index < 0).nonzero().reshape(-1)  # host
    pad_value, dtype = _pad_rows(pad, uncovered.numel(), source)
    device = source.device
    if source.shape[0]:
        # padding positions gather row 0 and are overwritten below: one kernel, no masked gather
        out = source.index_select(0, to_device_async(index.clamp(min=0), device))
    else:  # nothing to gather: every position is padding
        out = source.new_empty((index.numel(), *source.shape[1:]))
    if out.dtype != dtype:
        out = out.to(dtype)
    if uncovered.numel():
        positions = to_device_async(uncovered, device)
        if isinstance(pad_value, torch.Tensor):
            out[positions] = pad_value
        else:  # a Scalar argument, not a CPU tensor that indexing would copy to the device
            out.index_fill_(0, positions, pad_value)
    return out.reshape(*token_shape, *source.shape[1:])


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Rotary positions of a left-padded batch: ``[B, S]`` int64, 0 on the padding.

    A row ``[pad, pad, a, b]`` gets ``[0, 0, 0, 1]``, so every sequence sees the positions it
    had when it was generated unpadded (engine and trainer must agree on them). Runs on the
    mask's device; no host sync.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def split_for_sequence_parallel(
    tensor: torch.Tensor, tp_size: int, tp_rank: int, *, dim: int = 1
) -> torch.Tensor:
    """This tensor-parallel rank's contiguous ``1/tp_size`` of the token dimension (a view).

    With sequence parallelism each TP rank's router sees only its slice of the sequence, e.g.
    routes ``[1, T_local, L, K] -> [1, T_local / TP, L, K]`` (``dim=1`` is the sequence dimension
    of ``[*token_shape, ...]`` tensors). No copy, no sync.
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
