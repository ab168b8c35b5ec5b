"""Rewards on decoded text: verl-compatible scoring functions and a thread pool that runs them.

A reward function has verl's signature::

    compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None)
        -> float | dict   # a dict holds "score" plus extra numbers, logged as reward/<key>

so a team's existing scorer is used as it is (``reward._target_=my.module.compute_score``).
:class:`TextRewardScorer` decodes each response with the tokenizer and scores it in a thread pool,
so a slow scorer overlaps with generation instead of stalling the collection. A scorer that raises
scores 0 for that response; failures are counted and the first traceback is logged once.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ComputeScore = Callable[..., float | Mapping[str, Any]]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_MARKED = re.compile(r"(?:####|answer\s*[:=]|answer is)\s*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def normalize_answer(text: str) -> str:
    """Lower-cased, whitespace-free, without a trailing period or surrounding ``$``."""
    return re.sub(r"\s+", "", str(text)).strip("$").rstrip(".").lower()


def extract_answer(solution: str) -> str | None:
    """The final answer of a response: the last ``\\boxed{...}``, else what follows the last
    ``####`` / ``answer:`` / ``answer is`` marker, else the last number; None if none is found."""
    boxed = _BOXED.findall(solution)
    if boxed:
        return boxed[-1]
    marked = _MARKED.findall(solution)
    if marked and marked[-1].strip():
        return marked[-1].strip()
    numbers = _NUMBER.findall(solution)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    text = normalize_answer(text).replace(",", "")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the whole response equals the ground truth after :func:`normalize_answer`."""
    return float(normalize_answer(solution_str) == normalize_answer(str(ground_truth)))


def math_answer(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the response's final answer (:func:`extract_answer`) equals the ground truth:
    numerically (``0.5`` == ``1/2``, ``1,000`` == ``1000``) when both parse as numbers, else as
    normalised text."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    a, b = _as_number(answer), _as_number(str(ground_truth))
    if a is not None and b is not None:
        return float(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9))
    return float(normalize_answer(answer) == normalize_answer(str(ground_truth)))


@dataclass
class ScoredResponse:
    """One response's reward and the extra numbers a dict-returning scorer gave."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)
    failed: bool = False


class TextRewardScorer:
    """Decodes responses and scores them with ``compute_score`` in a thread pool.

    Args:
        compute_score: a function with verl's ``compute_score`` signature.
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
        max_workers: scoring threads (scorers are usually pure Python: more threads only help
            scorers that wait, e.g. on a sandbox or a judge model).
    """

    def __init__(
        self,
        compute_score: ComputeScore,
        tokenizer: Any,
        *,
        max_workers: int = 4,
        skip_special_tokens: bool = True,
    ) -> None:
        if not callable(compute_score):
            raise TypeError(f"reward: compute_score must be callable, got {compute_score!r}")
        if max_workers < 1:
            raise ValueError(f"reward.max_workers must be >= 1, got {max_workers}")
        self.compute_score = compute_score
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.failures = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="r3-reward")

    def decode(self, response_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(response_ids), skip_special_tokens=self.skip_special_tokens)

    def submit(
        self, data_source: str, response_ids: Sequence[int], ground_truth: Any, extra_info: Any = None
    ) -> Future[ScoredResponse]:
        """Score one response off the calling thread; the future never raises for a scorer error."""
        return self._pool.submit(self._score, data_source, list(response_ids), ground_truth, extra_info)

    def score_all(self, items: Sequence[tuple[str, Sequence[int], Any, Any]]) -> list[ScoredResponse]:
        """``(data_source, response_ids, ground_truth, extra_info)`` items scored in the pool, in order."""
        return [f.result() for f in [self.submit(*item) for item in items]]

    def _score(
        self, data_source: str, response_ids: list[int], ground_truth: Any, extra_info: Any
    ) -> ScoredResponse:
        try:
            result = self.compute_score(data_source, self.decode(response_ids), ground_truth, extra_info)
            return _scored(result)
        except Exception:
            with self._lock:
                self.failures += 1
                first = self.failures == 1
            if first:
                log.exception(
                    "the reward function raised; the response scores 0 (logged once, failures are counted)"
                )
            return ScoredResponse(0.0, failed=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> TextRewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scored(result: Any) -> ScoredResponse:
    """A scorer's float or ``{"score": ..., **extra}`` result; anything else is a ``TypeError``."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise TypeError(f"a dict reward needs a 'score' key, got keys {sorted(result)}")
        extra = {str(k): float(v) for k, v in result.items() if k != "score" and _is_number(v)}
        return ScoredResponse(_finite(result["score"]), extra)
    return ScoredResponse(_finite(result))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"a reward must be a finite number, got {value!r}")
    return float(value)
