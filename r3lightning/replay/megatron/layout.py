"""Where a megatron-core rank's tokens are: its tensor/context-parallel position and token layout.

Megatron packs a batch (THD) into one ``[1, T]`` row whose sequences are each padded to a multiple
of the TP size, or of ``2 * TP * CP`` with context parallelism; each CP rank keeps two of the
``2 * CP`` chunks of every sequence (:meth:`TokenMetadataLayout.packed`), and under sequence
parallelism each TP rank's MoE layers see only its contiguous ``1/TP`` of that row.

fp8 training needs more padding: fp8 GEMMs take token counts that are multiples of 16, and
Transformer Engine's block-scaled fp8 recipes quantise the packed row in blocks of 128 per
alignment unit. With ``fp8=True`` every sequence is padded to ``lcm(16, align)`` and the whole
row to ``128 * align`` (the last sequence takes the extra padding), as verl packs fp8 batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from megatron.core import parallel_state
from torch import Tensor

from r3lightning.align.layout import TokenMetadataLayout, check_int, check_rank
from r3lightning.ragged import to_device_async
from r3lightning.replay.batch_fields import host_attention_mask

__all__ = ["MegatronParallelism", "megatron_padding_mask", "megatron_token_layout"]

FP8_SEQUENCE_MULTIPLE = 16  # fp8 GEMMs need token counts that are multiples of 16
FP8_BLOCK = 128  # block-scaled fp8 quantises the packed row in blocks of 128 per alignment unit


@dataclass(frozen=True)
class MegatronParallelism:
    """The tensor- and context-parallel position of this rank, as router replay needs it.

    ``sequence_parallel``: each TP rank's routers see only its contiguous ``1/tp_size`` of the
    sequence (megatron's MoE with TP > 1 runs with sequence parallelism).
    """

    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        check_rank("tp_rank", self.tp_rank, "tp_size", check_int("tp_size", self.tp_size))
        check_rank("cp_rank", self.cp_rank, "cp_size", check_int("cp_size", self.cp_size))

    @classmethod
    def resolve(
        cls,
        *,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        cp_size: int | None = None,
        cp_rank: int | None = None,
        sequence_parallel: bool | None = None,
    ) -> MegatronParallelism:
        """Explicit values win; the rest come from ``megatron.core.parallel_state`` when it is
        initialised, else TP = CP = 1. ``sequence_parallel`` defaults to ``tp_size > 1``."""
        initialised = parallel_state.model_parallel_is_initialized()
        if tp_size is None:
            tp_size = parallel_state.get_tensor_model_parallel_world_size() if initialised else 1
        if tp_rank is None:
            tp_rank = parallel_state.get_tensor_model_parallel_rank() if initialised else 0
        if cp_size is None:
            cp_size = parallel_state.get_context_parallel_world_size() if initialised else 1
        if cp_rank is None:
            cp_rank = parallel_state.get_context_parallel_rank() if initialised else 0
        if sequence_parallel is None:
            sequence_parallel = tp_size > 1
        return cls(tp_size, tp_rank, cp_size, cp_rank, bool(sequence_parallel))

    @property
    def pad_to_multiple(self) -> int:
        """Packed sequences are padded to ``2 * TP * CP`` with context parallelism, else to TP."""
        return 2 * self.tp_size * self.cp_size if self.cp_size > 1 else self.tp_size

    def packed_multiples(self, *, fp8: bool = False) -> tuple[int, int]:
        """``(per sequence, whole row)`` pad multiples of the packed layout.

        ``(pad_to_multiple, 1)``, or with ``fp8`` ``(lcm(16, pad_to_multiple), 128 * pad_to_multiple)``.
        """
        align = self.pad_to_multiple
        if not fp8:
            return align, 1
        return math.lcm(FP8_SEQUENCE_MULTIPLE, align), FP8_BLOCK * align


def megatron_token_layout(
    batch: Any,
    *,
    packed: bool = True,
    parallelism: MegatronParallelism | None = None,
    side: Literal["left", "right"] = "right",
    fp8: bool = False,
) -> TokenMetadataLayout:
    """Layout of the tokens this rank's megatron model sees for a ``RolloutBatch``-like batch.

    ``batch`` is a left-padded ``attention_mask`` ``[B, S]`` or has one (``batch.attention_mask``;
    a ``RolloutBatch``'s host lengths are used, so a batch already on the GPU costs no sync).
    ``packed=True``: THD packing, each sequence padded to ``parallelism.pad_to_multiple`` and cut
    for this CP rank: ``[1, T_local]``. ``packed=False``: megatron's unpacked ``[B, S']`` path
    (real tokens moved to the front with ``side="right"``, ``S'`` a multiple of TP); context
    parallelism needs packing. ``parallelism`` defaults to :meth:`MegatronParallelism.resolve`.
    ``fp8=True`` (packed only) adds the padding fp8 GEMMs need (:meth:`MegatronParallelism.
    packed_multiples`). Built on the host; a device-resident bare mask is copied back once.
    """
    if isinstance(batch, Tensor):
        if batch.dim() != 2:
            raise ValueError(f"attention_mask must be [B, S], got shape {tuple(batch.shape)}")
        mask = batch.detach().cpu()
    else:
        mask = host_attention_mask(batch)
    par = parallelism if parallelism is not None else MegatronParallelism.resolve()
    if packed:
        per_sequence, whole_row = par.packed_multiples(fp8=fp8)
        return TokenMetadataLayout.packed(
            mask.sum(-1),
            pad_to_multiple=per_sequence,
            cp_size=par.cp_size,
            cp_rank=par.cp_rank,
            batch_width=mask.shape[1],
            pad_total_to_multiple=whole_row,
        )
    if fp8:
        raise ValueError("fp8 padding applies to the packed layout: pass packed=True")
    if par.cp_size > 1:
        raise ValueError(
            f"context parallelism (cp_size={par.cp_size}) needs the packed layout: pass packed=True"
        )
    return TokenMetadataLayout.padded(mask, side=side, pad_to_multiple=par.tp_size)


def megatron_padding_mask(
    layout: TokenMetadataLayout, device: torch.device | str | None = None
) -> torch.Tensor:
    """bool ``[*token_shape]``, True on padding: the ``padding_mask`` megatron-core's MoE routers take.

    Pass it as ``GPTModel(..., padding_mask=...)`` (the full, pre-sequence-parallel token shape:
    megatron scatters it itself) or ``MoELayer(..., padding_mask=...)``. megatron-core 0.16 leaves
    True positions out of the load-balancing aux losses, the z-loss and the expert-bias token
    counts (its docstrings say the opposite; its code reads True as padding). One host->device
    copy through page-locked staging, no sync.
    """
    mask = ~layout.token_mask
    return mask if device is None else to_device_async(mask, torch.device(device))
