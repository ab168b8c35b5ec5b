"""GRPO-style advantages, the clipped policy loss, and training/inference mismatch metrics.

All token tensors are left-padded ``[B, S]`` and aligned to token ``t`` (the logprob of token
``t`` comes from the forward at position ``t - 1``); ``loss_mask`` is 1 on the tokens that
are loss targets. Everything here is pure tensor math: no host<->device syncs unless stated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from r3lightning.correction.importance import CorrectionConfig


@dataclass(frozen=True)
class GRPOConfig:
    group_size: int = 8  # responses sampled per prompt
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28
    normalize_std: bool = True  # divide by the group's reward std (GRPO); False = Dr. GRPO
    std_eps: float = 1e-6
    # Probability ratios outside [1 / ratio_band, ratio_band] count as "far off" in the metrics.
    ratio_band: float = 2.0
    # Paired native-vs-replayed mismatch (mismatch/*) every n RL steps; 0 = never.
    mismatch_every_n_steps: int = 1
    # Importance-sampling correction of the loss tokens (r3lightning.correction); none by default.
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)


def group_advantages(
    rewards: Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-trajectory advantage: reward minus its group's mean (over ``std + eps`` if normalising).

    ``rewards`` ``[num_groups * group_size]``, consecutive entries form a group. The std is the
    unbiased sample std; a group whose rewards are all equal gets advantage 0 (no signal).
    """
    if rewards.ndim != 1 or rewards.numel() % group_size != 0:
        shape = tuple(rewards.shape)
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got shape {shape}"
        )
    grouped = rewards.float().view(-1, group_size)  # [groups, group_size]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Logprob of each token under the logits of the previous position.

    ``logits`` ``[B, S, V]``, ``input_ids`` ``[B, S]`` -> ``[B, S]`` float32 where entry ``t``
    is ``log softmax(logits[:, t - 1])[input_ids[:, t]]`` and entry 0 is 0 (no predecessor).
    Computed in float32 whatever the logits' dtype. Memory: one ``[B, S - 1, V]`` float32 buffer.
    """
    shifted = logits[:, :-1].float().log_softmax(dim=-1)  # [B, S-1, V]
    picked = shifted.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, S-1]
    return torch.nn.functional.pad(picked, (1, 0))


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` weighted by ``mask``; what ``values`` hold where ``mask`` is 0 (even NaN)
    never reaches the result or its gradient; 0 when the mask is empty (no sync)."""
    mask = mask.to(values.dtype)
    return torch.where(mask != 0, values * mask, 0.0).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate loss: the loss tokens' sum over their count (token-mean).

    ``logprobs`` (trainer, with grad), ``old_logprobs`` (the behaviour policy: the engine's
    logprobs), ``loss_mask`` and ``weights`` (a correction's, treated as constants) are
    ``[B, S]``; ``advantages`` ``[B]``. A weight scales its token's term; the divisor stays the
    loss-token count (a dropped token does not reweight the rest). Masked tokens add exactly 0 to
    the loss and its gradient whatever their values; no loss token gives 0. Returns the loss and
    detached metrics (``clip_fraction``).
    """
    log_ratio = torch.where(loss_mask != 0, logprobs - old_logprobs, 0.0)  # [B, S]
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].to(ratio.dtype)  # [B, 1]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # [B, S]
    if weights is not None:
        per_token = per_token * torch.where(loss_mask != 0, weights.detach(), 0.0)
    loss = masked_mean(per_token, loss_mask)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped < unclipped).float(), loss_mask)
    return loss, {"clip_fraction": clip_fraction}


def k3_terms(log_ratio: Tensor) -> Tensor:
    """Per-token k3 estimator ``r - 1 - log r`` of ``log_ratio = log r``, in float64.

    Computed as ``expm1(x) - x``: non-negative and accurate down to tiny ratios (float32
    ``exp(x) - 1 - x`` is off by tens of percent at ``x ~ 1e-4`` and can go negative).
    """
    x = log_ratio.double()
    return torch.expm1(x) - x


def mismatch_metrics(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, *, ratio_band: float = 2.0
) -> dict[str, Tensor]:
    """How far the trainer's token probabilities are from the rollout engine's, with
    ``r = p_trainer / p_rollout`` on the loss tokens (sampled by the engine):

    * ``k3_kl``: mean of ``r - 1 - log r`` (:func:`k3_terms`, float64), the unbiased,
      non-negative k3 estimator of KL(rollout || trainer);
    * ``ratio_out_of_band``: fraction of loss tokens with ``r`` outside ``[1 / ratio_band, ratio_band]``;
    * ``abs_logprob_diff``: mean ``|log r|``.

    Detached float64 scalars; no host sync.
    """
    with torch.no_grad():
        log_r = trainer_logprobs.double() - rollout_logprobs.double()  # [B, S]
        return {
            "k3_kl": masked_mean(k3_terms(log_r), loss_mask),
            "ratio_out_of_band": masked_mean((log_r.abs() > math.log(ratio_band)).double(), loss_mask),
            "abs_logprob_diff": masked_mean(log_r.abs(), loss_mask),
        }


def paired_mismatch_metrics(
    native_logprobs: Tensor,
    replayed_logprobs: Tensor,
    rollout_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    ratio_band: float = 2.0,
) -> dict[str, Tensor]:
    """The mismatch R3 removes, measured on one batch and one set of weights.

    ``native_logprobs`` / ``replayed_logprobs`` ``[B, S]``: the trainer's logprobs of the batch
    with its own routing and with the engine's routes replayed, each compared with the engine's
    by :func:`mismatch_metrics`: ``k3_native`` / ``k3_replayed`` and ``outside_band_native`` /
    ``outside_band_replayed``. Detached float64 scalars; no host sync.
    """
    native, replayed = (
        mismatch_metrics(lp, rollout_logprobs, loss_mask, ratio_band=ratio_band)
        for lp in (native_logprobs, replayed_logprobs)
    )
    return {
        "k3_native": native["k3_kl"],
        "k3_replayed": replayed["k3_kl"],
        "outside_band_native": native["ratio_out_of_band"],
        "outside_band_replayed": replayed["ratio_out_of_band"],
    }


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy (nats) of the distribution each token was predicted from, aligned like
    :func:`token_logprobs`: ``logits [B, S, V]`` -> ``[B, S]`` float32, entry 0 is 0.
    Memory: one ``[B, S - 1, V]`` float32 buffer."""
    logp = logits[:, :-1].float().log_softmax(dim=-1)  # [B, S-1, V]
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0))
