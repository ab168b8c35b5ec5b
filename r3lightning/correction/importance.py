"""Importance-sampling corrections of ``log_ratio = log p_trainer - log p_engine`` over the loss
``mask``: padded ``[B, T]`` tensors or a ``PackedTensor`` of per-token values (``mask`` packed alike
or ``[rows]``). Results have ``log_ratio``'s form and dtype, detached, 0 off the mask. Cost: a few
elementwise kernels, sequence sums in float64 as cumsum differences; no host sync, deterministic."""

from __future__ import annotations

import torch
from torch import Tensor

# the settings' checks live in r3lightning.checks (the job reads them without torch); kept importable here
from r3lightning.checks import check_band, check_cap, check_floor, check_lower_clip, check_max_k3
from r3lightning.packed import PackedTensor

Tokens = Tensor | PackedTensor


def _check_cap_dtype(threshold: float, dtype: torch.dtype) -> None:
    """The cap must be a value of the weights' dtype: above fp16's largest it would be inf there."""
    largest = torch.finfo(dtype).max
    if threshold > largest:
        raise ValueError(f"threshold must be <= {largest:g}, the largest {dtype} value, got {threshold!r}")


def _defined(weights: Tensor, keep: Tensor) -> Tensor:
    """``weights`` on the loss tokens, 0 elsewhere and where the log-ratio was undefined (NaN, or
    ``+inf`` and ``-inf`` in one sequence): such a token or sequence is dropped, never NaN."""
    return torch.where(keep & ~weights.isnan(), weights, 0.0)


def tokens_of(log_ratio: Tokens, mask: Tokens) -> tuple[Tensor, Tensor, Tensor | None]:
    """The tensors of a padded or packed correction input, checked.

    Args:
        log_ratio: Padded ``[B, T]`` floating-point tensor, or a ``PackedTensor`` of ``[]`` rows.
        mask: The loss mask, nonzero on loss tokens: ``log_ratio``'s shape and device (for packed
            input: a ``PackedTensor`` with the same ``cu_seqlens``, or its ``[rows]`` values).

    Returns:
        ``(values, keep, cu_seqlens)``: ``log_ratio``'s values (``[B, T]`` or ``[rows]``,
        detached), bool ``keep`` of the same shape, and int32 ``[B + 1]`` device offsets for packed
        input (None for padded). No device work beyond ``mask != 0``; no host sync.

    Raises:
        ValueError: ``log_ratio`` is not a floating-point ``[B, T]`` tensor or ``[]``-row
            ``PackedTensor``, or ``mask`` does not match it.
    """
    cu = None
    if isinstance(log_ratio, PackedTensor):
        if log_ratio.row_shape != ():
            raise ValueError(f"log_ratio must be per-token values (row_shape ()), got {log_ratio.row_shape}")
        if isinstance(mask, PackedTensor):
            if not torch.equal(mask.cu_seqlens_host, log_ratio.cu_seqlens_host):
                raise ValueError("mask must be a PackedTensor with log_ratio's cu_seqlens")
            mask = mask.values
        values = log_ratio.values
        cu = log_ratio.cu_seqlens
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


def token_tis(
    log_ratio: Tokens, mask: Tokens, *, threshold: float = 2.0, lower_clip: float | None = None
) -> Tokens:
    """Truncated importance sampling: one weight per token.

    Args:
        log_ratio: ``log p_trainer - log p_engine`` per token: padded ``[B, T]`` or a
            ``PackedTensor`` of ``[]`` rows (one segment per sequence), any floating dtype and
            device. Values off the mask are ignored, NaN and infinities included.
        mask: The loss mask (nonzero on loss tokens): ``log_ratio``'s shape, or for packed input a
            ``PackedTensor`` with its offsets or the ``[rows]`` values.
        threshold: The cap ``C``: a weight is ``min(exp(log_ratio), C)``; finite, >= 1 and at most
            the dtype's largest value.
        lower_clip: Weights below it are raised to it, in ``(0, 1]`` (None: no lower clip).

    Returns:
        ``min(max(exp(log_ratio), lower_clip), threshold)`` on loss tokens, 0 off the mask and
        where ``log_ratio`` is NaN; ``log_ratio``'s form and dtype, detached (the ratio is taken in
        at least float32). A few elementwise kernels; no host sync.

    Raises:
        ValueError: A bad ``threshold`` or ``lower_clip``, or ``log_ratio`` / ``mask`` of the
            wrong form (`tokens_of`).
    """
    check_cap(threshold)
    check_lower_clip(lower_clip)
    lr, keep, _ = tokens_of(log_ratio, mask)
    _check_cap_dtype(threshold, lr.dtype)
    weight = _ratio(lr).clamp(min=lower_clip, max=threshold)
    return _like(log_ratio, _defined(weight, keep))


def sequence_tis(
    log_ratio: Tokens, mask: Tokens, *, threshold: float = 2.0, lower_clip: float | None = None
) -> Tokens:
    """Sequence-level truncated importance sampling: one weight per sequence, on its loss tokens.

    Args:
        log_ratio: ``log p_trainer - log p_engine`` per token: padded ``[B, T]`` or a
            ``PackedTensor`` of ``[]`` rows (one segment per sequence), any floating dtype and
            device. Values off the mask are ignored, NaN and infinities included.
        mask: The loss mask (nonzero on loss tokens): ``log_ratio``'s shape, or for packed input a
            ``PackedTensor`` with its offsets or the ``[rows]`` values.
        threshold: The cap ``C`` of a sequence's weight ``exp(sum of its loss tokens' log_ratio)``;
            finite, >= 1 and at most the dtype's largest value.
        lower_clip: Weights below it are raised to it, in ``(0, 1]`` (None: no lower clip).

    Returns:
        Each sequence's ``min(max(exp(sum), lower_clip), threshold)`` repeated on its loss tokens,
        0 off the mask and for a sequence whose sum is undefined (a NaN, or ``+inf`` and
        ``-inf``); ``log_ratio``'s form and dtype, detached. The sums are float64 cumsum
        differences (packed) or row sums (padded); no host sync.

    Raises:
        ValueError: A bad ``threshold`` or ``lower_clip``, or ``log_ratio`` / ``mask`` of the
            wrong form (`tokens_of`).
    """
    check_cap(threshold)
    check_lower_clip(lower_clip)
    lr, keep, cu = tokens_of(log_ratio, mask)
    _check_cap_dtype(threshold, lr.dtype)
    total = _sequence_sum(torch.where(keep, lr, 0.0), cu)
    weight = torch.exp(total).clamp(min=lower_clip, max=threshold)
    return _like(log_ratio, _defined(weight, keep))


def geometric_mask(log_ratio: Tokens, mask: Tokens, *, lower: float = 0.5, upper: float = 2.0) -> Tokens:
    """Geometric-mean mask: keeps whole sequences whose mean ratio lies in a band.

    Args:
        log_ratio: ``log p_trainer - log p_engine`` per token: padded ``[B, T]`` or a
            ``PackedTensor`` of ``[]`` rows (one segment per sequence), any floating dtype and
            device. Values off the mask are ignored, NaN and infinities included.
        mask: The loss mask (nonzero on loss tokens): ``log_ratio``'s shape, or for packed input a
            ``PackedTensor`` with its offsets or the ``[rows]`` values.
        lower: The band's lower edge, in ``[0, 1]``.
        upper: The band's upper edge, >= 1 and above ``lower``.

    Returns:
        1 on the loss tokens of sequences whose ``exp(mean of their loss tokens' log_ratio)`` lies
        in ``[lower, upper]``, else 0 (a NaN on a loss token drops its sequence); ``log_ratio``'s
        form and dtype, detached. Float64 sequence sums; no host sync.

    Raises:
        ValueError: A bad band, or ``log_ratio`` / ``mask`` of the wrong form (`tokens_of`).
    """
    check_band(lower, upper)
    lr, keep, cu = tokens_of(log_ratio, mask)
    mean = _sequence_sum(torch.where(keep, lr, 0.0), cu) / _sequence_sum(keep, cu).clamp(min=1)
    ratio = torch.exp(mean)
    return _like(log_ratio, keep & (ratio >= lower) & (ratio <= upper))


def token_mask(log_ratio: Tokens, mask: Tokens, *, lower: float = 0.5, upper: float = 2.0) -> Tokens:
    """Token mask: keeps the loss tokens whose ratio lies in a band.

    Args:
        log_ratio: ``log p_trainer - log p_engine`` per token: padded ``[B, T]`` or a
            ``PackedTensor`` of ``[]`` rows (one segment per sequence), any floating dtype and
            device. Values off the mask are ignored, NaN and infinities included.
        mask: The loss mask (nonzero on loss tokens): ``log_ratio``'s shape, or for packed input a
            ``PackedTensor`` with its offsets or the ``[rows]`` values.
        lower: The band's lower edge, in ``[0, 1]``.
        upper: The band's upper edge, >= 1 and above ``lower``.

    Returns:
        1 on the loss tokens whose ``exp(log_ratio)`` lies in ``[lower, upper]``, else 0 (NaN: 0);
        ``log_ratio``'s form and dtype, detached. Elementwise; no host sync.

    Raises:
        ValueError: A bad band, or ``log_ratio`` / ``mask`` of the wrong form (`tokens_of`).
    """
    check_band(lower, upper)
    lr, keep, _ = tokens_of(log_ratio, mask)
    ratio = _ratio(lr)
    return _like(log_ratio, keep & (ratio >= lower) & (ratio <= upper))


def veto_mask(log_ratio: Tokens, mask: Tokens, *, floor: float) -> Tokens:
    """Veto mask: drops whole sequences that hold a loss token with a tiny ratio.

    Args:
        log_ratio: ``log p_trainer - log p_engine`` per token: padded ``[B, T]`` or a
            ``PackedTensor`` of ``[]`` rows (one segment per sequence), any floating dtype and
            device. Values off the mask are ignored, NaN and infinities included.
        mask: The loss mask (nonzero on loss tokens): ``log_ratio``'s shape, or for packed input a
            ``PackedTensor`` with its offsets or the ``[rows]`` values.
        floor: The smallest ratio a loss token may have, in ``(0, 1)``.

    Returns:
        1 on the loss tokens of sequences each of whose loss tokens has ``exp(log_ratio) >= floor``,
        else 0: a loss token below the floor, or with a NaN log-ratio, vetoes its sequence.
        ``log_ratio``'s form and dtype, detached. Float64 sequence sums; no host sync.

    Raises:
        ValueError: A bad ``floor``, or ``log_ratio`` / ``mask`` of the wrong form (`tokens_of`).
    """
    check_floor(floor)
    lr, keep, cu = tokens_of(log_ratio, mask)
    # not ">= floor" rather than "< floor": an undefined (NaN) ratio vetoes too
    below = ~(_ratio(lr) >= floor)
    vetoes = _sequence_sum(keep & below, cu)  # float64 count per sequence
    return _like(log_ratio, keep & (vetoes == 0))


_K3_SATURATION = 600.0  # k3's log-ratio bound, exp(600) ~ 3.8e260


def k3_terms(log_ratio: Tensor) -> Tensor:
    """Per-token k3 ``r - 1 - log r`` of ``log_ratio = log r``.

    Computed in float64 as ``expm1(x) - x``: float32 ``exp(x) - 1 - x`` is off by tens of percent
    at ``x ~ 1e-4``.

    Args:
        log_ratio: Any shape, floating dtype and device.

    Returns:
        float64 of ``log_ratio``'s shape, >= 0. ``x`` saturates at +-600 (k3 ~ 4e260), so the
        terms and a mean over any batch stay finite where ``exp`` overflows at 709; NaN stays NaN.
        Elementwise; no host sync.
    """
    x = log_ratio.double().clamp(-_K3_SATURATION, _K3_SATURATION)
    return torch.expm1(x) - x


def k3_mask(log_ratio: Tokens, mask: Tokens, *, max_k3: float) -> Tokens:
    """K3 rejection: drops whole sequences whose k3 estimate of KL(engine || trainer) is large.

    Args:
        log_ratio: ``log p_trainer - log p_engine`` per token: padded ``[B, T]`` or a
            ``PackedTensor`` of ``[]`` rows (one segment per sequence), any floating dtype and
            device. Values off the mask are ignored, NaN and infinities included.
        mask: The loss mask (nonzero on loss tokens): ``log_ratio``'s shape, or for packed input a
            ``PackedTensor`` with its offsets or the ``[rows]`` values.
        max_k3: The largest mean k3 (`k3_terms`) over a sequence's loss tokens that is kept: a
            finite number > 0.

    Returns:
        1 on the loss tokens of sequences whose mean k3 is at most ``max_k3``, else 0 (a NaN on a
        loss token drops its sequence); ``log_ratio``'s form and dtype, detached. Float64 terms
        and sums; no host sync.

    Raises:
        ValueError: A bad ``max_k3``, or ``log_ratio`` / ``mask`` of the wrong form (`tokens_of`).
    """
    check_max_k3(max_k3)
    lr, keep, cu = tokens_of(log_ratio, mask)
    terms = torch.where(keep, k3_terms(torch.where(keep, lr, 0.0)), 0.0)
    mean = _sequence_sum(terms, cu) / _sequence_sum(keep, cu).clamp(min=1)
    return _like(log_ratio, keep & (mean <= max_k3))
