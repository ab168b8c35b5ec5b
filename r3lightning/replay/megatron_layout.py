"""Where a megatron-core rank's tokens are: its tensor/context-parallel position and token layout.

Megatron packs a batch (THD) into one ``[1, T]`` row whose sequences are each padded to a multiple
of the TP size, or of ``2 * TP * CP`` with context parallelism; each CP rank keeps two of the
``2 * CP`` chunks of every sequence (:meth:`TokenMetadataLayout.packed`), and under sequence
parallelism each TP rank's MoE layers see only its contiguous ``1/TP`` of that row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megatron.core import parallel_state
from torch import Tensor

from r3lightning.align.layout import TokenMetadataLayout, check_int, check_rank
from r3lightning.replay.batch_fields import host_attention_mask

__all__ = ["MegatronParallelism", "megatron_token_layout"]


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


def megatron_token_layout(
    batch: Any,
    *,
    packed: bool = True,
    parallelism: MegatronParallelism | None = None,
    side: Literal["left", "right"] = "right",
) -> TokenMetadataLayout:
    """Layout of the tokens this rank's megatron model sees for a ``RolloutBatch``-like batch.

    ``batch`` is a left-padded ``attention_mask`` ``[B, S]`` or has one (``batch.attention_mask``;
    a ``RolloutBatch``'s host lengths are used, so a batch already on the GPU costs no sync).
    ``packed=True``: THD packing, each sequence padded to ``parallelism.pad_to_multiple`` and cut
    for this CP rank: ``[1, T_local]``. ``packed=False``: megatron's unpacked ``[B, S']`` path
    (real tokens moved to the front with ``side="right"``, ``S'`` a multiple of TP); context
    parallelism needs packing. ``parallelism`` defaults to :meth:`MegatronParallelism.resolve`.
    Built on the host; a device-resident bare mask is copied back once.
    """
    if isinstance(batch, Tensor):
        if batch.dim() != 2:
            raise ValueError(f"attention_mask must be [B, S], got shape {tuple(batch.shape)}")
        mask = batch.detach().cpu()
    else:
        mask = host_attention_mask(batch)
    par = parallelism if parallelism is not None else MegatronParallelism.resolve()
    if packed:
        return TokenMetadataLayout.packed(
            mask.sum(-1),
            pad_to_multiple=par.pad_to_multiple,
            cp_size=par.cp_size,
            cp_rank=par.cp_rank,
            batch_width=mask.shape[1],
        )
    if par.cp_size > 1:
        raise ValueError(
            f"context parallelism (cp_size={par.cp_size}) needs the packed layout: pass packed=True"
        )
    return TokenMetadataLayout.padded(mask, side=side, pad_to_multiple=par.tp_size)
