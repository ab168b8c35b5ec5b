"""A megatron-core rank's TP/CP position and the token layout its routers see."""

import math
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch
from megatron.core import parallel_state
from torch import Tensor

from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.checks import check_int, check_rank
from r3lightning.ragged import to_device_async
from r3lightning.replay.batch_fields import host_attention_mask

__all__ = ["MegatronParallelism", "megatron_padding_mask", "megatron_token_layout"]
FP8_SEQUENCE_MULTIPLE = 16  # fp8 GEMMs need token counts that are multiples of 16
FP8_BLOCK = 128  # block-scaled fp8 quantises the packed row in blocks of 128 per alignment unit


@dataclass(frozen=True)
class MegatronParallelism:
    """This rank's tensor- and context-parallel position.

    Args:
        tp_size: Tensor-parallel ranks.
        tp_rank: This rank's place among them.
        cp_size: Context-parallel ranks.
        cp_rank: This rank's place among them.
        sequence_parallel: Each tensor-parallel rank's routers see only its contiguous
            ``1 / tp_size`` of the sequence.

    Raises:
        ValueError: A size below 1 or a rank outside ``[0, size)``.
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
    def resolve(cls, *, sequence_parallel: bool | None = None) -> Self:
        """This rank's position, read from ``megatron.core.parallel_state``.

        Args:
            sequence_parallel: Whether the model runs sequence parallel (None: whenever
                ``tp_size > 1``).

        Returns:
            The position; TP = CP = 1 before ``parallel_state`` is initialised.
        """
        if not parallel_state.model_parallel_is_initialized():
            return cls(sequence_parallel=bool(sequence_parallel))
        ps = parallel_state
        tp_size = ps.get_tensor_model_parallel_world_size()
        tp_rank = ps.get_tensor_model_parallel_rank()
        cp_size = ps.get_context_parallel_world_size()
        cp_rank = ps.get_context_parallel_rank()
        sp = tp_size > 1 if sequence_parallel is None else bool(sequence_parallel)
        return cls(tp_size, tp_rank, cp_size, cp_rank, sp)

    @property
    def pad_to_multiple(self) -> int:
        """Packed sequences are padded to ``2 * TP * CP`` with context parallelism, else to TP."""
        return 2 * self.tp_size * self.cp_size if self.cp_size > 1 else self.tp_size

    def packed_multiples(self, *, fp8: bool = False) -> tuple[int, int]:
        """The pad multiples of this rank's packed layout.

        Args:
            fp8: fp8 GEMMs: each sequence to a multiple of 16 and `pad_to_multiple`, the whole row
                to ``128 * pad_to_multiple``.

        Returns:
            ``(per sequence, whole row)``: ``(pad_to_multiple, 1)`` without fp8.
        """
        align = self.pad_to_multiple
        return (math.lcm(FP8_SEQUENCE_MULTIPLE, align), FP8_BLOCK * align) if fp8 else (align, 1)


def megatron_token_layout(
    batch: Any,
    *,
    packed: bool = True,
    parallelism: MegatronParallelism | None = None,
    side: Literal["left", "right"] = "right",
    fp8: bool = False,
) -> TokenMetadataLayout:
    """The layout of the tokens this rank's megatron-core model sees.

    Args:
        batch: A left-padded attention mask ``[B, S]`` (bool or 0/1, any device) or a batch
            holding one (``RolloutBatch``, mapping).
        packed: The THD layout ``[1, T_local]`` of this context-parallel rank (sequences padded
            to `MegatronParallelism.packed_multiples`), else the unpacked ``[B, S']``.
        parallelism: This rank's TP / CP position (None: `MegatronParallelism.resolve`).
        side: Where the unpacked layout puts the padding (megatron's unpacked path: ``"right"``).
        fp8: Pad the packed row for fp8 GEMMs.

    Returns:
        The layout: host maths; a device mask not in a ``RolloutBatch`` costs one
        device-to-host copy.

    Raises:
        ValueError: A mask that is not 2-D (or, unpacked, not left-padded), ``fp8`` or context
            parallelism without ``packed``.
    """
    if isinstance(batch, Tensor) and batch.dim() != 2:
        raise ValueError(f"attention_mask must be [B, S], got shape {tuple(batch.shape)}")
    mask = batch.detach().cpu() if isinstance(batch, Tensor) else host_attention_mask(batch)
    par = parallelism if parallelism is not None else MegatronParallelism.resolve()
    if packed:
        per_sequence, whole_row = par.packed_multiples(fp8=fp8)
        pads = dict(pad_to_multiple=per_sequence, pad_total_to_multiple=whole_row, batch_width=mask.shape[1])
        return TokenMetadataLayout.packed(mask.sum(-1), cp_size=par.cp_size, cp_rank=par.cp_rank, **pads)
    if fp8:
        raise ValueError("fp8 padding applies to the packed layout: pass packed=True")
    if par.cp_size > 1:
        raise ValueError(f"context parallelism (cp_size={par.cp_size}) needs the packed layout (packed=True)")
    return TokenMetadataLayout.padded(mask, side=side, pad_to_multiple=par.tp_size)


def megatron_padding_mask(layout: TokenMetadataLayout, device: torch.device | str | None = None) -> Tensor:
    """The ``padding_mask`` that megatron-core's ``GPTModel`` / ``MoELayer`` take for a layout.

    Args:
        layout: The model's token layout.
        device: Where the mask goes (None: the host); a CUDA copy is non-blocking.

    Returns:
        bool ``[*token_shape]``: True on padding positions.
    """
    mask = ~layout.token_mask
    return mask if device is None else to_device_async(mask, torch.device(device))
