"""The ``algorithm`` group's settings (`GRPOConfig`) and GRPO's advantages (`GRPOAdvantages`), in a
module that imports torch only to compute advantages: the job checks its config without torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from r3lightning.checks import check_setting
from r3lightning.correction.config import CorrectionConfig

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["LOSSES", "GRPOAdvantages", "GRPOConfig", "group_advantages"]

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
        loss: One of ``LOSSES``: ``grpo`` (token-level, ``policy_loss``) or ``gspo``
            (sequence-level, ``gspo_loss``).

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
    import torch  # here, not at the top: the job's config checks import this module

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
