"""The environment interface of multi-turn rollouts, and the one-turn text adapter.

An environment is any object with two methods, plain or ``async`` (a ``typing.Protocol``; no
base class to inherit):

    reset(prompt: RolloutPrompt) -> observation           # the first prompt of the trajectory
    step(response) -> (observation, reward, done, info)   # after every generated turn

An observation is token ids or chat messages (``[{"role", "content"}, ...]``, rendered with the
environment's ``tokenizer`` chat template plus the generation prompt). ``response`` is the
turn's sampled token ids, or their text when the environment sets ``response_format = "text"``
(decoded with its ``tokenizer``). ``reward`` is this turn's reward (the trajectory's is their
sum); ``done`` ends the trajectory; ``info`` is free-form and ignored by the collector. The
collector builds one environment per trajectory from :class:`Environments` and calls a plain
method in its ``reward_threads`` pool when it has one, so a slow tool does not stall the event
loop.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from r3lightning.rollout.prompts import RolloutPrompt, TextReward

__all__ = ["Environment", "Environments", "Observation", "TextEnvironment", "text_environment"]

Observation = Sequence[int] | Sequence[Mapping[str, str]]  # token ids or chat messages
StepResult = tuple[Observation, float, bool, Mapping[str, Any]]


class Environment(Protocol):
    """What the collector asks of an environment (see the module docstring)."""

    def reset(self, prompt: RolloutPrompt) -> Observation | Awaitable[Observation]: ...

    def step(self, response: list[int] | str) -> StepResult | Awaitable[StepResult]: ...


class TextEnvironment:
    """A single-turn task as a one-turn environment: ``reset`` gives the prompt's ids, ``step``
    scores the response with ``score(prompt, response_ids)`` and ends the trajectory.

    With a verl dataset (:class:`~r3lightning.rollout.prompts_file.PromptsFileTask` records) and
    its ``compute_score``, :func:`text_environment` builds the factory; the trajectories equal
    the collector's single-turn ones with the same reward.
    """

    def __init__(self, score: Callable[[RolloutPrompt, list[int]], float]) -> None:
        self.score = score
        self.prompt: RolloutPrompt | None = None

    def reset(self, prompt: RolloutPrompt) -> list[int]:
        self.prompt = prompt
        return prompt.token_ids

    def step(self, response: list[int]) -> StepResult:
        if self.prompt is None:
            raise RuntimeError("TextEnvironment.step before reset")
        return [], self.score(self.prompt, response), True, {}


def text_environment(compute_score: Callable[..., Any], tokenizer: Any) -> functools.partial[TextEnvironment]:
    """The factory of one-turn environments scoring decoded responses with a verl-style
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``. They share one
    :class:`TextReward` (``factory.args[0]``: its ``pop_metrics()`` counts failures and extras)."""
    reward = TextReward(compute_score, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    return functools.partial(TextEnvironment, reward)


@dataclass(frozen=True)
class Environments:
    """Multi-turn rollouts for a :class:`~r3lightning.rollout.collector.RolloutCollector`, given
    where its ``reward_fn`` goes: ``make()`` builds one environment per trajectory (a class or a
    ``functools.partial``), which runs at most ``max_turns`` generations; the sum of its step
    rewards is the trajectory's reward."""

    make: Callable[[], Environment]
    max_turns: int = 1

    def __post_init__(self) -> None:
        if not callable(self.make):
            raise TypeError(f"Environments.make must build an environment, got {self.make!r}")
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"Environments.max_turns must be an integer >= 1, got {self.max_turns!r}")
