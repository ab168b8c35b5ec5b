"""Built-in verl-style ``compute_score`` text rewards for prompt datasets (see the job page, "Real data")."""

from __future__ import annotations

import math
import re
from typing import Any

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_MARKED = re.compile(r"(?:####|answer\s*[:=]|answer is)\s*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def normalize_answer(text: str) -> str:
    """An answer in the form answers are compared in.

    Args:
        text: The answer (anything; it is converted with ``str``).

    Returns:
        ``text`` without whitespace, surrounding ``$`` or a trailing period, lower-cased.
    """
    return re.sub(r"\s+", "", str(text)).strip("$").rstrip(".").lower()


def extract_answer(solution: str) -> str | None:
    """The final answer of a response.

    Args:
        solution: The response's text.

    Returns:
        The content of the last ``\\boxed{...}``, else what follows the last ``####`` /
        ``answer:`` / ``answer is`` marker, else the last number; None if there is none.
    """
    boxed = _BOXED.findall(solution)
    if boxed:
        return boxed[-1]
    marked = _MARKED.findall(solution)
    if marked and marked[-1].strip():
        return marked[-1].strip()
    numbers = _NUMBER.findall(solution)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    """``text`` as a number (``1,000``, ``0.5``, ``1/2``), or None when it is not one."""
    text = normalize_answer(text).replace(",", "")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """A verl-style ``compute_score``: the whole response against the ground truth.

    Args:
        data_source: The row's data source (unused: one rule for every source).
        solution_str: The decoded response.
        ground_truth: The row's answer.
        extra_info: The row's extra fields (unused).

    Returns:
        1.0 when both are equal after `normalize_answer`, else 0.0.
    """
    return float(normalize_answer(solution_str) == normalize_answer(str(ground_truth)))


def math_answer(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """A verl-style ``compute_score``: the response's final answer against the ground truth.

    Args:
        data_source: The row's data source (unused: one rule for every source).
        solution_str: The decoded response; its answer is `extract_answer`'s.
        ground_truth: The row's answer.
        extra_info: The row's extra fields (unused).

    Returns:
        1.0 when the answers are equal, else 0.0: numerically (``0.5`` == ``1/2``, ``1,000`` ==
        ``1000``) when both parse as numbers, else as normalised text. 0.0 without an answer.
    """
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    answer_value = _as_number(answer)
    truth_value = _as_number(str(ground_truth))
    if answer_value is not None and truth_value is not None:
        return float(math.isclose(answer_value, truth_value, rel_tol=1e-9, abs_tol=1e-9))
    return exact_match(data_source, answer, ground_truth)
