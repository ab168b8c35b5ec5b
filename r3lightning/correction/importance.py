"""Importance-sampling corrections of ``log_ratio = log p_trainer - log p_engine`` over the loss
``mask``: padded ``[B, T]`` tensors or a ``PackedTensor`` of per-token values (``mask`` packed alike
or ``[rows]``). Results have ``log_ratio``'s form and dtype, detached, 0 off the mask. Cost: a few
elementwise kernels, sequence sums in float64 as cumsum differences; no host sync, deterministic."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from r3lightning.packed import PackedTensor

MODES = ("none", "token_tis", "sequence_tis", "geometric_mask", "token_mask")
TIS_MODES = ("token_tis", "sequence_tis")
MASK_MODES = ("geometric_mask", "token_mask")

Tokens = Tensor | PackedTensor


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _check(threshold: float = 2.0, lower: float = 0.5, upper: float = 2.0) -> None:
    if not 0 < _number("threshold", threshold) < math.inf:
        raise ValueError(
            f"threshold must be a number > 0 and finite (the truncation cap C), got {threshold!r}"
        )
    if not 0 <= _number("lower", lower) < _number("upper", upper):
        raise ValueError(f"lower and upper must satisfy 0 <= lower < upper, got {lower=}, {upper=}")


@dataclass(frozen=True)
class CorrectionConfig:
    """``algorithm.correction``: ``mode`` one of :data:`MODES`, ``threshold`` the cap ``C`` of the
    TIS modes, ``lower`` / ``upper`` the ratio band the mask modes keep."""

    mode: str = "none"
    threshold: float = 2.0
    lower: float = 0.5
    upper: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        _check(self.threshold, self.lower, self.upper)


def tokens_of(log_ratio: Tokens, mask: Tokens) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(values, bool keep, cu_seqlens or None)`` of a padded or packed input, shapes checked."""
    cu = None
    if isinstance(log_ratio, PackedTensor):
        if log_ratio.row_shape != ():
            raise ValueError(f"log_ratio must be per-token values (row_shape ()), got {log_ratio.row_shape}")
        if isinstance(mask, PackedTensor):
            if not torch.equal(mask.cu_seqlens_host, log_ratio.cu_seqlens_host):
                raise ValueError("mask must be a PackedTensor with log_ratio's cu_seqlens")
            mask = mask.values
        values, cu = log_ratio.values, log_ratio.cu_seqlens
    elif isinstance(log_ratio, Tensor) and log_ratio.dim() == 2:
        values = log_ratio
    else:
        got = tuple(log_ratio.shape) if isinstance(log_ratio, Tensor) else type(log_ratio).__name__
        raise ValueError(f"log_ratio must be a padded [B, T] tensor or a PackedTensor, got {got}")
    if not values.is_floating_point():
        raise ValueError(f"log_ratio must be a floating-point tensor, got dtype {values.dtype}")
    if not isinstance(mask, Tensor) or mask.shape != values.shape or mask.device != values.device:
        got = f"{tuple(mask.shape)} on {mask.device}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"mask must have log_ratio's shape {tuple(values.shape)} on {values.device}, got {got}"
        )
    return values.detach(), mask.detach() != 0, cu


def _like(log_ratio: Tokens, values: Tensor) -> Tokens:
    """``values`` (already 0 off the mask) in ``log_ratio``'s form and dtype."""
    values = values.to(log_ratio.dtype)
    if isinstance(log_ratio, PackedTensor):
        return PackedTensor(values, log_ratio.cu_seqlens, cu_seqlens_host=log_ratio.cu_seqlens_host)
    return values


def _sequence_sum(x: Tensor, cu: Tensor | None) -> Tensor:
    """Float64 sum of ``x`` over each token's own sequence, repeated on its tokens (``x``'s shape)."""
    x = x.double()
    if cu is None:  # [B, T]: a sequence is a row
        return x.sum(-1, keepdim=True).expand_as(x)
    ends = torch.nn.functional.pad(x.cumsum(0), (1, 0))  # [rows + 1] running sums
    cu = cu.long()
    per_sequence = ends[cu[1:]] - ends[cu[:-1]]  # [B]
    return per_sequence.repeat_interleave(cu[1:] - cu[:-1], output_size=x.shape[0])  # no sync


def _ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.to(torch.promote_types(log_ratio.dtype, torch.float32)))


def _check_cap(threshold: float, dtype: torch.dtype) -> None:
    """The cap must be a value of the weights' dtype: above fp16's largest it would be inf there."""
    largest = torch.finfo(dtype).max
    if threshold > largest:
        raise ValueError(f"threshold must be <= {largest:g}, the largest {dtype} value, got {threshold!r}")


def _defined(weights: Tensor, keep: Tensor) -> Tensor:
    """``weights`` on the loss tokens, 0 elsewhere and where the log-ratio was undefined (NaN, or
    ``+inf`` and ``-inf`` in one sequence): such a token or sequence is dropped, never NaN."""
    return torch.where(keep & ~weights.isnan(), weights, 0.0)


def token_tis(log_ratio: Tokens, mask: Tokens, *, threshold: float = 2.0) -> Tokens:
    """Truncated IS: per-token weight ``min(exp(log_ratio), threshold)`` on loss tokens (0 where
    ``log_ratio`` is NaN)."""
    _check(threshold=threshold)
    lr, keep, _ = tokens_of(log_ratio, mask)
    _check_cap(threshold, lr.dtype)
    return _like(log_ratio, _defined(_ratio(lr).clamp(max=threshold), keep))


def sequence_tis(log_ratio: Tokens, mask: Tokens, *, threshold: float = 2.0) -> Tokens:
    """Per sequence, ``min(exp(sum of its loss tokens' log_ratio), threshold)`` on its loss tokens
    (0 for a sequence whose sum is undefined: a NaN, or ``+inf`` and ``-inf``)."""
    _check(threshold=threshold)
    lr, keep, cu = tokens_of(log_ratio, mask)
    _check_cap(threshold, lr.dtype)
    total = _sequence_sum(torch.where(keep, lr, 0.0), cu)
    return _like(log_ratio, _defined(torch.exp(total).clamp(max=threshold), keep))


def geometric_mask(log_ratio: Tokens, mask: Tokens, *, lower: float = 0.5, upper: float = 2.0) -> Tokens:
    """1 on the loss tokens of sequences whose ``exp(mean log_ratio)`` lies in ``[lower, upper]``."""
    _check(lower=lower, upper=upper)
    lr, keep, cu = tokens_of(log_ratio, mask)
    mean = _sequence_sum(torch.where(keep, lr, 0.0), cu) / _sequence_sum(keep, cu).clamp(min=1)
    ratio = torch.exp(mean)
    return _like(log_ratio, keep & (ratio >= lower) & (ratio <= upper))


def token_mask(log_ratio: Tokens, mask: Tokens, *, lower: float = 0.5, upper: float = 2.0) -> Tokens:
    """1 on the loss tokens whose ratio ``exp(log_ratio)`` lies in ``[lower, upper]``, else 0."""
    _check(lower=lower, upper=upper)
    lr, keep, _ = tokens_of(log_ratio, mask)
    ratio = _ratio(lr)
    return _like(log_ratio, keep & (ratio >= lower) & (ratio <= upper))


def correction_weights(log_ratio: Tokens, mask: Tokens, config: CorrectionConfig) -> Tokens:
    """The per-token loss weights of ``config.mode`` (``none``: the mask as 0/1 weights)."""
    if config.mode == "none":
        _, keep, _ = tokens_of(log_ratio, mask)
        return _like(log_ratio, keep)
    if config.mode in TIS_MODES:
        tis = token_tis if config.mode == "token_tis" else sequence_tis
        return tis(log_ratio, mask, threshold=config.threshold)
    drop = geometric_mask if config.mode == "geometric_mask" else token_mask
    return drop(log_ratio, mask, lower=config.lower, upper=config.upper)
