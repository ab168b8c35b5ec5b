"""What a rollout request carries and how its answer is scored.

:class:`RolloutPrompt` is one prompt plus the per-prompt metadata a reward needs (verl's dataset
fields); :class:`SamplingConfig` the request's sampling settings in each protocol's names;
:func:`sampling_seed` the seed of every sample, a pure function of ``(seed, step, group,
sample)``. A reward is any ``reward_fn(prompt, response_ids)`` returning a number or
``{"score": number}``; :func:`text_reward` adapts a verl-style ``compute_score(data_source,
solution_str, ground_truth, extra_info=None)``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from r3lightning.wire.request import engine_sampling_params

__all__ = [
    "RewardFn",
    "RolloutPrompt",
    "SamplingConfig",
    "TextReward",
    "sampling_seed",
    "score_value",
    "text_reward",
]

log = logging.getLogger(__name__)

_MAX_SEED = 2**31 - 1  # what every engine accepts as a sampling seed


def sampling_seed(seed: int, step: int, group: int, sample: int = 0, turn: int = 0) -> int:
    """The sampling seed of turn ``turn`` of sample ``sample`` of group ``group`` at RL step
    ``step``, in ``[0, 2**31 - 1)``: a hash, so seeds of different steps or groups never collide
    in a pattern. Turn 0 hashes the first four alone (single-turn seeds predate turns)."""
    fields = (seed, step, group, sample) if turn == 0 else (seed, step, group, sample, turn)
    digest = hashlib.blake2b(struct.pack(f"<{len(fields)}q", *fields), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _MAX_SEED


@dataclass
class RolloutPrompt:
    """One prompt and the metadata its reward needs (verl's dataset fields).

    ``token_ids``: the prompt as token ids; ``data_source``, ``ground_truth``, ``extra_info``:
    passed through to the reward untouched.
    """

    token_ids: list[int]
    data_source: str | None = None
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = self.token_ids.tolist() if hasattr(self.token_ids, "tolist") else list(self.token_ids)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(
                f"RolloutPrompt.token_ids must be a non-empty sequence of token ids >= 0, got {ids!r:.80}"
            )
        self.token_ids = ids


@dataclass
class SamplingConfig:
    """Sampling settings of every request, spelled per protocol by
    :func:`~r3lightning.wire.request.engine_sampling_params`; ``extra`` is merged into
    the wire parameters as is."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # e.g. the tokenizer's end-of-turn ids
    extra: dict[str, Any] = field(default_factory=dict)

    def wire_params(self, protocol: str, seed: int) -> dict[str, Any]:
        """The request's ``sampling_params`` in ``protocol``'s field names."""
        params = engine_sampling_params(
            protocol,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )
        params.update(self.extra)
        return params


RewardFn = Callable[[RolloutPrompt, list[int]], "float | Mapping[str, Any] | Awaitable[Any]"]


class TextReward:
    """A ``reward_fn`` from a verl-style ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None)``; the response is decoded with ``decode`` (e.g. a tokenizer's ``decode``).

    A scorer that raises scores 0 for that response: the failure is counted (``failures``) and the
    first traceback is logged once, so one bad row never ends a run. A dict result's ``score`` is
    the reward and its other numeric entries are summed per key for :meth:`pop_metrics`. Safe to
    call from several threads (the collector's ``reward_threads`` pool).
    """

    def __init__(self, compute_score: Callable[..., Any], decode: Callable[[list[int]], str]) -> None:
        if not callable(compute_score):
            raise TypeError(f"reward: compute_score must be callable, got {compute_score!r}")
        self.compute_score = compute_score
        self.decode = decode
        self.failures = 0
        self._lock = threading.Lock()
        self._sums: dict[str, float] = {}
        self._count = 0

    def __call__(self, prompt: RolloutPrompt, response_ids: list[int]) -> float:
        try:
            value = self.compute_score(
                prompt.data_source,
                self.decode(response_ids),
                prompt.ground_truth,
                extra_info=prompt.extra_info,
            )
            score = score_value(value, "compute_score")
        except Exception:
            with self._lock:
                self.failures += 1
                self._count += 1
                first = self.failures == 1
            if first:
                log.exception(
                    "the reward function raised; the response scores 0 (logged once, failures counted)"
                )
            return 0.0
        extra = {}
        if isinstance(value, Mapping):
            extra = {
                str(k): float(v)
                for k, v in value.items()
                if k != "score"
                and isinstance(v, int | float)
                and not isinstance(v, bool)
                and math.isfinite(v)
            }
        with self._lock:
            self._count += 1
            for key, v in extra.items():
                self._sums[key] = self._sums.get(key, 0.0) + v
        return score

    def pop_metrics(self) -> dict[str, float]:
        """``reward/<key>``: the mean of each extra entry over the responses scored since the last
        call (a response without the entry counts as 0), and ``reward/failures``; then resets."""
        with self._lock:
            count, sums, failures = self._count, self._sums, self.failures
            self._count, self._sums, self.failures = 0, {}, 0
        metrics = {f"reward/{k}": v / max(count, 1) for k, v in sums.items()}
        metrics["reward/failures"] = float(failures)
        return metrics


def text_reward(compute_score: Callable[..., Any], decode: Callable[[list[int]], str]) -> TextReward:
    """:class:`TextReward` of ``compute_score`` and ``decode``."""
    return TextReward(compute_score, decode)


def score_value(value: Any, where: str) -> float:
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(
                f"reward_fn returned a mapping without a 'score' entry for {where}: {value!r:.120}"
            )
        value = value["score"]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(
            f"reward_fn must return a finite number (or {{'score': number}}) for {where}, got {value!r}"
        )
    return float(value)
