"""GRPO advantages, the clipped policy loss and mismatch metrics, on left-padded ``[B, S]`` token
tensors aligned to token ``t`` (the forward at ``t - 1``); ``loss_mask`` is 1 on loss targets. No
syncs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from r3lightning.checks import check_setting
from r3lightning.correction.importance import k3_terms
from r3lightning.correction.steps import CorrectionConfig

LOSSES = ("grpo", "gspo")  # token-level clipped surrogate (PPO/GRPO) | sequence-level (GSPO)


@dataclass(frozen=True)
class GRPOConfig:
    """The job's ``algorithm`` settings: the GRPO loss and what the module measures.

    Args:
        group_size: Responses sampled per prompt (at least 2: advantages compare them).
        clip_low: The probability ratio is clipped below at ``1 - clip_low``; in (0, 1).
        clip_high: The probability ratio is clipped above at ``1 + clip_high``; above 0.
        normalize_std: Divide the centred rewards by the group's reward std (GRPO); False
            only centres them (Dr. GRPO).
        ratio_band: Ratios outside ``[1 / ratio_band, ratio_band]`` count as far off in the
            mismatch metrics; at least 1.
        mismatch_every_n_steps: Measure the paired native-vs-replayed ``mismatch/*`` every n RL
            steps (two extra no-grad forwards each time); 0 never does.
        correction: The loss's importance-sampling correction; none by default.
        loss: One of ``LOSSES``: ``grpo`` (token-level, `policy_loss`) or ``gspo``
            (sequence-level, `gspo_loss`).

    Raises:
        ValueError: A value outside its range, naming the field.
    """

    group_size: int = 8
    clip_low: float = 0.2
    clip_high: float = 0.28
    normalize_std: bool = True
    ratio_band: float = 2.0
    mismatch_every_n_steps: int = 1
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    loss: str = "grpo"

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {list(LOSSES)}, got {self.loss!r}")
        check_setting("group_size", self.group_size, low=2, high=2**31 - 1, integer=True)
        if (
            isinstance(self.clip_low, bool)
            or not isinstance(self.clip_low, int | float)
            or not 0 < self.clip_low < 1
        ):
            raise ValueError(f"clip_low must be a number in (0, 1), got {self.clip_low!r}")
        check_setting("clip_high", self.clip_high, low=0, above=True)
        if not isinstance(self.normalize_std, bool):
            raise ValueError(f"normalize_std must be true or false, got {self.normalize_std!r}")
        check_setting("ratio_band", self.ratio_band, low=1)
        check_setting("mismatch_every_n_steps", self.mismatch_every_n_steps, low=0, integer=True)
        if not isinstance(self.correction, CorrectionConfig):
            got = type(self.correction).__name__
            raise ValueError(f"correction must be a CorrectionConfig (r3lightning.correction), got {got}")


MAX_LOG_RATIO = 20.0  # the losses' log-ratio cap before exp: exp(20) ~ 4.9e8


def group_advantages(
    rewards: Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std if normalising.

    Computed in float64 (a spread of float32-range rewards would overflow the mean and the std).
    No sync: it runs where ``rewards`` are.

    Args:
        rewards: ``[groups * group_size]``; a group is ``group_size`` consecutive rewards.
        group_size: Rewards per group.
        normalize_std: Divide by the group's unbiased ``std + eps`` (GRPO); False only centres
            (Dr. GRPO). A group of one is only centred.
        eps: Added to the std, so a group of equal rewards gets zeros rather than NaN.

    Returns:
        ``[groups * group_size]`` in ``rewards``' floating dtype (float32 for integer rewards).

    Raises:
        ValueError: ``rewards`` is not 1-D, or its length not a multiple of ``group_size``.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size != 0:
        shape = tuple(rewards.shape)
        raise ValueError(f"rewards must be 1-D with a multiple of {group_size=} entries, got shape {shape}")
    # float64: a spread of float32-range rewards (1e38) overflows float32 in the mean and the std
    grouped = rewards.double().view(-1, group_size)  # [groups, group_size]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1).to(torch.promote_types(rewards.dtype, torch.float32))


@dataclass(frozen=True)
class GRPOAdvantages:
    """GRPO's advantages of one group, the ``advantages`` function a
    [`RolloutCollector`][r3lightning.rollout.collector.RolloutCollector] takes.

    Args:
        normalize_std: Divide by the group's unbiased reward std plus ``std_eps`` (GRPO); False
            only centres the rewards (Dr. GRPO).
        std_eps: Added to the std before dividing, so a group of equal rewards gets zeros.
    """

    normalize_std: bool = True
    std_eps: float = 1e-6

    def __post_init__(self) -> None:
        if not isinstance(self.normalize_std, bool):
            raise ValueError(f"normalize_std must be true or false, got {self.normalize_std!r}")
        check_setting("std_eps", self.std_eps, low=0, above=True)

    def __call__(self, rewards: Tensor) -> Tensor:
        """The advantages of one group (`group_advantages` of it).

        Args:
            rewards: One group's rewards, ``[group_size]``.

        Returns:
            ``[group_size]``, computed in float64, in ``rewards``' floating dtype (float32 for
            integers). Host tensors in, host tensors out: no sync.
        """
        return group_advantages(rewards, rewards.numel(), normalize_std=self.normalize_std, eps=self.std_eps)


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
