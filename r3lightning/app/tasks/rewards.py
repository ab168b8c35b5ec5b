"""Built-in verl-style ``compute_score`` text rewards for prompt datasets (see the job page, "Real data")."""

from __future__ import annotations

import math
import re
from typing import Any

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
    """1.0 when the whole response equals the ground truth after `normalize_answer`."""
    return float(normalize_answer(solution_str) == normalize_answer(str(ground_truth)))


def math_answer(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the response's final answer (`extract_answer`) equals the ground truth:
    numerically (``0.5`` == ``1/2``, ``1,000`` == ``1000``) when both parse as numbers, else as
    normalised text."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    a, b = _as_number(answer), _as_number(str(ground_truth))
    if a is not None and b is not None:
        return float(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9))
    return exact_match(data_source, answer, ground_truth)
