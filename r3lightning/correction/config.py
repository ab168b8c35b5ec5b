"""The correction settings, ``CorrectionConfig`` and its ``CorrectionStep`` s, in a module that imports
no torch: the job checks ``algorithm.correction`` before it imports torch. Each step's values are
computed by `r3lightning.correction.importance` (imported when a step is applied)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from r3lightning.checks import check_band, check_cap, check_floor, check_lower_clip, check_max_k3

if TYPE_CHECKING:
    from r3lightning.correction.importance import Tokens

__all__ = ["MASK_KINDS", "MODES", "STEP_KINDS", "TIS_KINDS", "CorrectionConfig", "CorrectionStep"]

MODES = ("none", "token_tis", "sequence_tis", "geometric_mask", "token_mask")  # the single-step form
TIS_KINDS = ("token_tis", "sequence_tis")
MASK_KINDS = ("token_mask", "geometric_mask", "veto", "k3_reject")
STEP_KINDS = TIS_KINDS + MASK_KINDS
# the settings each kind takes (the others stay null) and the defaults of the optional ones
_SETTINGS = {
    "token_tis": ("cap", "lower_clip"),
    "sequence_tis": ("cap", "lower_clip"),
    "token_mask": ("lower", "upper"),
    "geometric_mask": ("lower", "upper"),
    "veto": ("floor",),
    "k3_reject": ("max_k3",),
}
_DEFAULTS = {"cap": 2.0, "lower": 0.5, "upper": 2.0}  # floor and max_k3 have none: they must be set


@dataclass(frozen=True)
class CorrectionStep:
    """One step of ``algorithm.correction.steps``; a setting the kind does not take must stay None.

    Args:
        kind: one of `STEP_KINDS`.
        cap: TIS cap ``C >= 1`` (``token_tis`` / ``sequence_tis``; default 2.0).
        lower_clip: TIS lower clip in ``(0, 1]``: weights below it are raised to it (default none).
        lower: lower edge of the kept ratio band (``token_mask`` / ``geometric_mask``; default 0.5).
        upper: upper edge of the kept ratio band (default 2.0).
        floor: ``veto``: a sequence is dropped when any loss token's ratio is below it, in ``(0, 1)``.
        max_k3: ``k3_reject``: a sequence is dropped when its mean k3 over loss tokens exceeds it.

    Raises:
        ValueError: an unknown kind, a setting the kind does not take, a missing required setting
            or a value out of its range, in one line naming the setting.
    """

    kind: str
    cap: float | None = None
    lower_clip: float | None = None
    lower: float | None = None
    upper: float | None = None
    floor: float | None = None
    max_k3: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"kind must be one of {list(STEP_KINDS)}, got {self.kind!r}")
        takes = _SETTINGS[self.kind]
        for field in dataclasses.fields(self)[1:]:
            value = getattr(self, field.name)
            if field.name not in takes and value is not None:
                raise ValueError(
                    f"{field.name} is not a setting of a {self.kind} step; it takes {list(takes)}"
                )
            if field.name in takes and value is None and field.name in _DEFAULTS:
                object.__setattr__(self, field.name, _DEFAULTS[field.name])
        if self.kind in TIS_KINDS:
            check_cap(self.cap, "cap")
            check_lower_clip(self.lower_clip)
        elif self.kind in ("token_mask", "geometric_mask"):
            check_band(self.lower, self.upper)
        elif self.kind == "veto":
            if self.floor is None:
                raise ValueError("floor must be set for a veto step (a number in (0, 1))")
            check_floor(self.floor)
        else:
            if self.max_k3 is None:
                raise ValueError("max_k3 must be set for a k3_reject step (a finite number > 0)")
            check_max_k3(self.max_k3)

    def apply(self, log_ratio: Tokens, mask: Tokens) -> Tokens:
        """This step's per-token values.

        Args:
            log_ratio: ``log p_trainer - log p_engine``, padded ``[B, T]`` or packed.
            mask: The loss mask, in the same form.

        Returns:
            TIS weights or a 0/1 mask in ``log_ratio``'s form and dtype, detached, 0 off ``mask``
            (see the functions of `r3lightning.correction.importance`). No host sync.

        Raises:
            ValueError: ``log_ratio`` / ``mask`` of the wrong form, or a cap above the dtype's
                largest value.
        """
        from r3lightning.correction.importance import (
            geometric_mask,
            k3_mask,
            sequence_tis,
            token_mask,
            token_tis,
            veto_mask,
        )

        if self.kind == "token_tis":
            return token_tis(log_ratio, mask, threshold=self.cap, lower_clip=self.lower_clip)
        if self.kind == "sequence_tis":
            return sequence_tis(log_ratio, mask, threshold=self.cap, lower_clip=self.lower_clip)
        if self.kind == "token_mask":
            return token_mask(log_ratio, mask, lower=self.lower, upper=self.upper)
        if self.kind == "geometric_mask":
            return geometric_mask(log_ratio, mask, lower=self.lower, upper=self.upper)
        if self.kind == "veto":
            return veto_mask(log_ratio, mask, floor=self.floor)
        return k3_mask(log_ratio, mask, max_k3=self.max_k3)


def _step(index: int, entry: CorrectionStep | Mapping) -> CorrectionStep:
    if isinstance(entry, CorrectionStep):
        return entry
    if not isinstance(entry, Mapping):
        raise ValueError(f"steps[{index}] must be a mapping with a kind, got {entry!r}")
    try:
        return CorrectionStep(**entry)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"steps[{index}].{exc}") from None


@dataclass(frozen=True)
class CorrectionConfig:
    """``algorithm.correction``: ``steps``, or the single-step form ``mode`` (+ ``threshold``,
    ``lower``, ``upper``) that predates steps.

    Args:
        mode: one of `MODES`; ``token_tis`` is ``steps=[{kind: token_tis, cap: threshold}]``.
        threshold: the cap ``C`` of the TIS modes (>= 1).
        lower: lower edge of the band the mask modes keep.
        upper: upper edge of that band.
        steps: [`CorrectionStep`][r3lightning.correction.config.CorrectionStep] s (or mappings of their fields): at most one TIS step, each
            kind once; the loss weight is the product of their values.

    Raises:
        ValueError: a bad value, both ``mode`` and ``steps``, two TIS steps or a repeated kind.
    """

    mode: str = "none"
    threshold: float = 2.0
    lower: float = 0.5
    upper: float = 2.0
    steps: tuple[CorrectionStep, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        check_cap(self.threshold)
        check_band(self.lower, self.upper)
        if isinstance(self.steps, str | bytes) or not isinstance(self.steps, Sequence):
            raise ValueError(f"steps must be a list of steps, got {self.steps!r}")
        steps = tuple(_step(i, entry) for i, entry in enumerate(self.steps))
        object.__setattr__(self, "steps", steps)
        if steps and self.mode != "none":
            raise ValueError(
                f"mode and steps are two forms of one setting, set one: mode={self.mode!r} is "
                f"steps=[{{kind: {self.mode}}}]"
            )
        kinds = [step.kind for step in steps]
        if sum(kind in TIS_KINDS for kind in kinds) > 1:
            raise ValueError(f"steps take at most one TIS weight (token_tis or sequence_tis), got {kinds}")
        repeated = sorted({kind for kind in kinds if kinds.count(kind) > 1})
        if repeated:
            raise ValueError(
                f"steps take each kind once, got {repeated[0]!r} {kinds.count(repeated[0])} times"
            )

    @property
    def plan(self) -> tuple[CorrectionStep, ...]:
        """The steps applied (the single-step form as its one step; none for ``mode: none``)."""
        if self.steps or self.mode == "none":
            return self.steps
        if self.mode in TIS_KINDS:
            return (CorrectionStep(self.mode, cap=self.threshold),)
        return (CorrectionStep(self.mode, lower=self.lower, upper=self.upper),)

    @property
    def active(self) -> bool:
        """Whether any step applies (the GRPO module logs ``correction/*`` only then)."""
        return bool(self.plan)
