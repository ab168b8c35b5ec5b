"""The checks of the shipped tasks' settings (``task.*``), in a module that imports no torch: each
task's constructor runs its check, and the job runs the same check on its config before it
builds the model (`TASK_CHECKS`, keyed by the task's ``_target_``). A setting given as None is
one not known yet: the job leaves ``task.vocab_size`` null for the model's vocabulary size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from r3lightning.checks import check_setting

__all__ = [
    "OVERLONG",
    "TASK_CHECKS",
    "check_calculator",
    "check_prompts_file",
    "check_room",
    "check_task_sizes",
    "check_token_class",
]

OVERLONG = ("drop", "truncate_left", "truncate_right")  # what a prompts file does with a long prompt


def _given(name: str, value: Any, **bounds: Any) -> None:
    """`check_setting` of a value that is given (not None)."""
    if value is not None:
        check_setting(name, value, **bounds)


def check_task_sizes(
    num_classes: int | None,
    prompt_length: tuple[int | None, int],
    response_length: int | None,
    first_token: int | None,
) -> None:
    """Checks the sizes the token-class and calculator tasks share.

    Args:
        num_classes: At least 2.
        prompt_length: The prompt's length and its least value (room for the task's fixed tokens).
        response_length: At least 1.
        first_token: The first instruction id, at least 0 (its upper bound: `check_room`).

    Raises:
        ValueError: Naming the ``task.*`` key of the first value that is not an integer in range.
    """
    length, least = prompt_length
    sizes = {
        "num_classes": (num_classes, 2),
        "prompt_length": (length, least),
        "response_length": (response_length, 1),
        "first_token": (first_token, 0),
    }
    for name, (value, low) in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"task.{name} must be an integer >= {low}, got {value!r}")


def check_room(vocab_size: int | None, first_token: int | None, reserved: tuple[str, int | None]) -> None:
    """Checks that the vocabulary leaves room for the task's ids: ``first_token`` in
    ``[0, vocab_size - reserved)``.

    Args:
        vocab_size: The vocabulary size; None: not known yet (the model's), nothing more to check.
        first_token: The first instruction id (checked by `check_task_sizes`).
        reserved: The ids the task reserves: its formula (for the message) and its count.

    Raises:
        ValueError: ``task.vocab_size`` not an integer >= 1, or ``task.first_token`` past the bound.
    """
    check_setting("task.vocab_size", vocab_size, low=1, integer=True, optional=True)
    formula, count = reserved
    if vocab_size is None or first_token is None or count is None:
        return
    bound = vocab_size - count
    if first_token >= bound:
        raise ValueError(f"task.first_token must be in [0, {formula}) = [0, {bound}), got {first_token}")


def check_token_class(
    vocab_size: int | None = None,
    num_classes: int | None = None,
    prompt_length: int | None = None,
    response_length: int | None = None,
    first_token: int | None = None,
) -> None:
    """Checks `TokenClassTask`'s settings (instruction ids ``[first_token, first_token +
    num_classes)``, fillers after them up to ``vocab_size``).

    Every argument may be None: a setting not given, left unchecked.

    Args:
        vocab_size: The vocabulary size (None: the model's, not known yet).
        num_classes: At least 2.
        prompt_length: At least 1: the instruction id.
        response_length: At least 1.
        first_token: In ``[0, vocab_size - 2 * num_classes)``.

    Raises:
        ValueError: Naming the ``task.*`` key.
    """
    check_task_sizes(num_classes, (prompt_length, 1), response_length, first_token)
    # instruction ids, then as many filler ids at least
    reserved = None if num_classes is None else 2 * num_classes
    check_room(vocab_size, first_token, ("vocab_size - 2 * num_classes", reserved))


def check_calculator(
    vocab_size: int | None = None,
    num_classes: int | None = None,
    prompt_length: int | None = None,
    response_length: int | None = None,
    first_token: int | None = None,
    call_reward: float | None = None,
    max_turns: int | None = None,
) -> None:
    """Checks `CalculatorTask`'s settings (operands, then ``ASK``, ``CALL``, ``RESULT``, then
    fillers up to ``vocab_size``; ``max_turns`` generations per trajectory).

    Every argument may be None: a setting not given, left unchecked.

    Args:
        vocab_size: The vocabulary size (None: the model's, not known yet).
        num_classes: At least 2.
        prompt_length: At least 3: two operands and ``ASK``.
        response_length: At least 1.
        first_token: In ``[0, vocab_size - num_classes - 4)``.
        call_reward: A finite number.
        max_turns: At least 1.

    Raises:
        ValueError: Naming the ``task.*`` key.
    """
    check_task_sizes(num_classes, (prompt_length, 3), response_length, first_token)
    reserved = None if num_classes is None else num_classes + 4  # operands, ASK, CALL, RESULT, a filler
    check_room(vocab_size, first_token, ("vocab_size - num_classes - 4", reserved))
    _given("task.call_reward", call_reward)
    _given("task.max_turns", max_turns, low=1, integer=True)


def check_prompts_file(
    max_prompt_length: int | None = None,
    response_length: int | None = None,
    overlong: str | None = None,
    shuffle: bool | None = None,
    seed: int | None = None,
) -> None:
    """Checks `PromptsFileTask`'s settings (its file and tokenizer are read when it is built).

    Every argument may be None: a setting not given, left unchecked.

    Args:
        max_prompt_length: At least 1.
        response_length: At least 1.
        overlong: One of ``OVERLONG``.
        shuffle: True or false.
        seed: At least 0.

    Raises:
        ValueError: Naming the ``task.*`` key.
    """
    _given("task.max_prompt_length", max_prompt_length, low=1, integer=True)
    _given("task.response_length", response_length, low=1, integer=True)
    if overlong is not None and overlong not in OVERLONG:
        raise ValueError(f"task.overlong must be one of {list(OVERLONG)}, got {overlong!r}")
    if shuffle is not None and not isinstance(shuffle, bool):
        raise ValueError(f"task.shuffle must be true or false, got {shuffle!r}")
    _given("task.seed", seed, low=0, integer=True)


# the shipped tasks' checks, by the ``_target_`` that builds each; a user's task checks its own
# keywords when the job builds it
TASK_CHECKS: dict[str, Callable[..., Any]] = {
    "r3lightning.app.tasks.token_class.TokenClassTask": check_token_class,
    "r3lightning.app.tasks.calculator.CalculatorTask": check_calculator,
    "r3lightning.app.tasks.prompts_file.PromptsFileTask": check_prompts_file,
}
