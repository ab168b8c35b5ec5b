"""The environment interface of multi-turn rollouts (the multi-turn page has the whole contract)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from r3lightning.checks import check_setting
from r3lightning.rollout.prompts import RolloutPrompt, TextReward

__all__ = ["Environment", "Environments", "Observation", "TextEnvironment", "text_environment"]

Observation = Sequence[int] | Sequence[Mapping[str, str]]  # token ids or chat messages
StepResult = tuple[Observation, float, bool, Mapping[str, Any]]


class Environment(Protocol):
    """``reset`` gives the first observation (token ids or chat messages, rendered with the
    environment's ``tokenizer``); ``step`` takes the turn's ids (its text with
    ``response_format = "text"``); either may be ``async``. The rewards of the turns add up."""

    def reset(self, prompt: RolloutPrompt) -> Observation | Awaitable[Observation]:
        """Start an episode.

        Args:
            prompt: The collector's prompt of this trajectory.

        Returns:
            The first observation: token ids, or chat messages rendered with ``self.tokenizer``
            (at least one token).
        """

    def step(self, response: list[int] | str) -> StepResult | Awaitable[StepResult]:
        """Answer one turn.

        Args:
            response: The turn's generated ids, or their text with ``response_format = "text"``.

        Returns:
            ``(observation, reward, done, info)``: the next observation (ids or chat messages,
            appended with loss mask 0), the turn's reward (a finite number), whether the episode
            ends (a bool), and anything else.
        """


class TextEnvironment:
    """A single-turn task as a one-turn environment: ``reset`` gives the prompt's ids, ``step``
    scores the response with ``score(prompt, response_ids)`` and ends the trajectory. One instance
    per trajectory (it keeps the prompt).

    Args:
        score: ``(prompt, response_ids) -> float``.
    """

    def __init__(self, score: Callable[[RolloutPrompt, list[int]], float]) -> None:
        self.score = score
        self.prompt: RolloutPrompt | None = None

    def reset(self, prompt: RolloutPrompt) -> list[int]:
        """Keep ``prompt`` for `step`.

        Args:
            prompt: The trajectory's prompt.

        Returns:
            ``prompt.token_ids``.
        """
        self.prompt = prompt
        return prompt.token_ids

    def step(self, response: list[int]) -> StepResult:
        """Score the response and end the episode.

        Args:
            response: The generated ids.

        Returns:
            ``([], score(prompt, response), True, {})``.

        Raises:
            RuntimeError: Called before `reset`.
        """
        if self.prompt is None:
            raise RuntimeError("TextEnvironment.step before reset")
        return [], self.score(self.prompt, response), True, {}


def text_environment(compute_score: Callable[..., Any], tokenizer: Any) -> functools.partial[TextEnvironment]:
    """A factory of one-turn environments that score decoded responses with a verl-style
    ``compute_score``, as the collector's single turns would.

    Args:
        compute_score: ``(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``.
        tokenizer: Decodes responses (``skip_special_tokens=True``).

    Returns:
        A ``functools.partial`` building a `TextEnvironment`; every environment shares one
        `TextReward` (``factory.args[0]``).
    """
    reward = TextReward(compute_score, functools.partial(tokenizer.decode, skip_special_tokens=True))
    return functools.partial(TextEnvironment, reward)


@dataclass(frozen=True)
class Environments:
    """Multi-turn rollouts for a [`RolloutCollector`][r3lightning.rollout.collector.RolloutCollector], passed
    where its ``reward_fn`` goes.

    Args:
        make: Builds one environment per trajectory (a class or a ``functools.partial``).
        max_turns: The most generations an episode runs.
        timeout_s: How long one ``reset()`` or ``step()`` (sync or async) may take; past it the
            trajectory fails with a ``TimeoutError`` and its whole group is dropped and counted
            (``dropped_groups``), as any failing environment's. A sync method then runs in a daemon
            thread (one that never returns is left behind). None: unbounded, called as it is.

    Raises:
        TypeError: ``make`` is not callable.
        ValueError: ``max_turns`` is not an int >= 1, or ``timeout_s`` is not a number > 0.
    """

    make: Callable[[], Environment]
    max_turns: int = 1
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not callable(self.make):
            raise TypeError(f"Environments.make must build an environment, got {self.make!r}")
        check_setting("Environments.max_turns", self.max_turns, low=1, integer=True)
        check_setting("Environments.timeout_s", self.timeout_s, low=0, above=True, optional=True)
