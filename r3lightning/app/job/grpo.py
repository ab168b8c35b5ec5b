"""GRPO advantages, the clipped policy loss and mismatch metrics, on left-padded ``[B, S]`` token
tensors aligned to token ``t`` (the forward at ``t - 1``); ``loss_mask`` is 1 on loss targets. No
syncs."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# the algorithm's settings and advantages live in r3lightning.app.job.algorithm (the job checks
# them without torch); kept importable from here
from r3lightning.app.job.algorithm import LOSSES, GRPOAdvantages, GRPOConfig, group_advantages
from r3lightning.correction.importance import k3_terms

__all__ = [
    "LOSSES",
    "MAX_LOG_RATIO",
    "GRPOAdvantages",
    "GRPOConfig",
    "group_advantages",
    "gspo_loss",
    "k3_terms",
    "masked_mean",
    "mismatch_metrics",
    "paired_mismatch_metrics",
    "policy_loss",
    "token_entropy",
    "token_logprobs",
]

MAX_LOG_RATIO = 20.0  # the losses' log-ratio cap before exp: exp(20) ~ 4.9e8


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """The log-probability the model gave each token, from the forward at the token before it.

    Memory: one ``[B, S - 1, V]`` float32 buffer (the log-softmax). No sync.

    Args:
        logits: ``[B, S, V]``, the forward's output (any float dtype).
        input_ids: ``[B, S]``, the tokens the logits were computed from.

    Returns:
        ``[B, S]`` float32: entry ``t`` is ``log_softmax(logits[:, t - 1])[input_ids[:, t]]``;
        entry 0, which nothing predicts, is 0.
    """
    picked = _shifted_log_softmax(logits).gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, S-1]
    return torch.nn.functional.pad(picked, (1, 0))


def _shifted_log_softmax(logits: Tensor) -> Tensor:
    return logits[:, :-1].float().log_softmax(dim=-1)  # [B, S-1, V] float32: predicts tokens 1..S-1


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """The mean of ``values`` weighted by ``mask``. No sync.

    Args:
        values: Any shape.
        mask: ``values``' shape (or broadcastable to it); 0 leaves an entry out, other values
            weigh it. Entries off the mask, even NaN or inf, never reach the result or its
            gradient.

    Returns:
        A scalar in ``values``' dtype; 0 for an empty mask.
    """
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
    """The token-level clipped surrogate loss of PPO / GRPO: the mean over the loss tokens of
    ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` with ``r = exp(logprobs - old_logprobs)``.

    A log-ratio is capped at ``MAX_LOG_RATIO`` before ``exp``. No sync.

    Args:
        logprobs: ``[B, S]`` the trainer's logprobs (with gradient).
        old_logprobs: ``[B, S]`` the behaviour policy's logprobs (the engine's, or r2's recompute).
        advantages: ``[B]`` one advantage per sequence.
        loss_mask: ``[B, S]`` 1 on loss tokens; masked tokens add exactly 0 to the loss and its
            gradient.
        clip_low: ``r`` is clipped below at ``1 - clip_low``.
        clip_high: ``r`` is clipped above at ``1 + clip_high``.
        weights: ``[B, S]`` constant per-token weights (an importance-sampling correction) that
            scale each token's term; no gradient flows into them. None: all 1.

    Returns:
        The scalar loss and ``{"clip_fraction": ...}``: the detached share of loss tokens whose
        clipped term was taken.
    """
    # a log-ratio past 20 (ratio 5e8) is clamped before exp: exp overflows float32 at 88.7, and an
    # inf ratio times a zero advantage is NaN; past the cap a token gives no gradient (as the clip
    # already does for a positive advantage)
    log_ratio = torch.where(loss_mask != 0, logprobs - old_logprobs, 0.0).clamp(max=MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)  # [B, S]
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


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: per sequence ``i`` the ratio ``s_i = exp(mean of its loss tokens' logprobs - old_logprobs)``,
    the term ``-min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)`` (clipped per sequence),
    and the loss is the mean of the terms over sequences with a loss token.

    Args:
        logprobs: ``[B, S]`` the trainer's logprobs (with gradient).
        old_logprobs: ``[B, S]`` the behaviour policy's logprobs (the engine's, or r2's recompute).
        advantages: ``[B]`` one advantage per sequence.
        loss_mask: ``[B, S]`` 1 on loss tokens; masked tokens add exactly 0 to loss and gradient.
        clip_low: ``s_i`` is clipped below at ``1 - clip_low``.
        clip_high: ``s_i`` is clipped above at ``1 + clip_high``.
        weights: ``[B, S]`` constant per-token weights (an importance-sampling correction): token
            ``t`` of sequence ``i`` contributes ``w_t / n_i`` of the sequence's term and of its
            gradient (GSPO's token form), ``n_i`` the sequence's loss tokens; None = all 1.

    Returns:
        The scalar loss and detached ``sequence_clip_fraction``: the share of sequences (with a loss
        token) whose clipped term was taken.
    """
    keep = loss_mask != 0  # [B, S]
    log_ratio = torch.where(keep, logprobs - old_logprobs, 0.0)  # [B, S]
    tokens = keep.sum(-1).to(log_ratio.dtype)  # [B] n_i
    sequence_log_ratio = log_ratio.sum(-1) / tokens.clamp(min=1.0)  # [B] mean over loss tokens
    # token form: the value of every token's ratio is s_i, its gradient flows through token t alone;
    # averaged over the n_i tokens this is exactly the gradient of s_i (each token's d s_i = s_i / n_i)
    sequence_ratio = torch.exp(sequence_log_ratio.detach().clamp(max=MAX_LOG_RATIO))[:, None]  # [B, 1]
    ratio = sequence_ratio * torch.exp(log_ratio - log_ratio.detach())  # [B, S], value s_i
    adv = advantages[:, None].to(ratio.dtype)  # [B, 1]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # [B, S]
    if weights is not None:
        per_token = per_token * torch.where(keep, weights.detach(), 0.0)
    per_token = torch.where(keep, per_token, 0.0)
    per_sequence = per_token.sum(-1) / tokens.clamp(min=1.0)  # [B]
    has_tokens = tokens > 0
    sequences = has_tokens.sum().to(per_sequence.dtype).clamp(min=1.0)
    loss = per_sequence.sum() / sequences
    with torch.no_grad():
        sequence_adv = advantages.to(sequence_ratio.dtype)  # [B]
        s = sequence_ratio[:, 0]
        took_clip = s.clamp(1.0 - clip_low, 1.0 + clip_high) * sequence_adv < s * sequence_adv
        clip_fraction = (took_clip & has_tokens).sum().to(s.dtype) / sequences
    return loss, {"sequence_clip_fraction": clip_fraction}


def mismatch_metrics(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor, *, ratio_band: float = 2.0
) -> dict[str, Tensor]:
    """How far the trainer's token probabilities are from the engine's, on the loss tokens.

    With ``r = p_trainer / p_rollout`` per token. No sync; no gradient.

    Args:
        trainer_logprobs: ``[B, S]`` the trainer's logprobs.
        rollout_logprobs: ``[B, S]`` the engine's logprobs of the same tokens.
        loss_mask: ``[B, S]`` 1 on the tokens measured.
        ratio_band: ``r`` outside ``[1 / ratio_band, ratio_band]`` counts as out of band.

    Returns:
        Detached float64 scalars: ``k3_kl`` (the mean of `k3_terms`, the k3 estimator of
        KL(rollout || trainer)), ``ratio_out_of_band`` (the share of tokens out of band) and
        ``abs_logprob_diff`` (the mean ``|log r|``).
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
    """The mismatch R3 removes: `mismatch_metrics` of the trainer's logprobs with its own routing
    and with the engine's routes replayed, same weights and batch. No sync; no gradient.

    Args:
        native_logprobs: ``[B, S]`` the trainer's logprobs, routed by its own routers.
        replayed_logprobs: ``[B, S]`` the trainer's logprobs with the engine's routes replayed.
        rollout_logprobs: ``[B, S]`` the engine's logprobs.
        loss_mask: ``[B, S]`` 1 on the tokens measured.
        ratio_band: As in `mismatch_metrics`.

    Returns:
        Detached float64 scalars ``k3_native``, ``k3_replayed``, ``outside_band_native``,
        ``outside_band_replayed``, ``abs_logprob_diff_native`` and ``abs_logprob_diff_replayed``.
    """
    native = mismatch_metrics(native_logprobs, rollout_logprobs, loss_mask, ratio_band=ratio_band)
    replayed = mismatch_metrics(replayed_logprobs, rollout_logprobs, loss_mask, ratio_band=ratio_band)
    return {
        "k3_native": native["k3_kl"],
        "k3_replayed": replayed["k3_kl"],
        "outside_band_native": native["ratio_out_of_band"],
        "outside_band_replayed": replayed["ratio_out_of_band"],
        "abs_logprob_diff_native": native["abs_logprob_diff"],
        "abs_logprob_diff_replayed": replayed["abs_logprob_diff"],
    }


def token_entropy(logits: Tensor) -> Tensor:
    """The entropy of the distribution that predicted each token, aligned like `token_logprobs`.

    Memory: two ``[B, S - 1, V]`` float32 buffers. No sync.

    Args:
        logits: ``[B, S, V]``, the forward's output.

    Returns:
        ``[B, S]`` float32 entropies in nats; entry 0 is 0.
    """
    logp = _shifted_log_softmax(logits)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0))
