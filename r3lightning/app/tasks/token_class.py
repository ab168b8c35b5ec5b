"""A task joined with its reward (`ScoredTask`), and the token-class task: prompts end in
an instruction token ``first_token + c``, and the reward is the share of response tokens ``t``
with ``t % num_classes == c`` (exact, cheap, learnt by a tiny random model in tens of steps)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from r3lightning.app.tasks.settings import check_token_class
from r3lightning.rollout.environment import Environments
from r3lightning.rollout.prompts import (
    GuardedReward,
    RolloutPrompt,
    TextReward,
    callable_name,
    sampling_seed,
    score_value,
)

__all__ = ["Reward", "ScoredTask", "TokenClassReward", "TokenClassTask"]

Reward = Callable[[Sequence[int], Sequence[int]], float]  # (prompt_ids, response_ids) -> reward


class ScoredTask:
    """A task's prompts with the reward that scores them (the ``task`` and ``reward`` config keys).

    A task with ``decode`` (a dataset) is scored by a verl-style ``compute_score`` on the decoded
    text (`TextReward`: a scorer that raises scores 0); any other by ``reward(prompt_ids,
    response_ids)`` (an exception ends the run). A scorer still running after ``timeout_s``
    seconds scores 0 either way.

    Args:
        prompts: The task: it has ``sample_prompts(num_prompts, generator)`` or
            ``prompts_for_step(step, num_prompts)``, and may have ``decode`` (a text task),
            ``make_environment`` and ``max_turns`` (a multi-turn task).
        reward: The scorer: ``reward(prompt_ids, response_ids) -> float``, or a verl-style
            ``compute_score`` for a task with ``decode``.
        timeout_s: Seconds a scorer call may take; None: no limit.

    Raises:
        TypeError: ``prompts`` has neither prompt method, or ``reward`` is not callable.
    """

    def __init__(self, prompts: Any, reward: Reward, *, timeout_s: float | None = 60.0) -> None:
        if not any(callable(getattr(prompts, name, None)) for name in ("sample_prompts", "prompts_for_step")):
            raise TypeError(
                "task must have sample_prompts(num_prompts, generator) or prompts_for_step(step, "
                f"num_prompts), got {type(prompts).__name__}"
            )
        if not callable(reward):
            raise TypeError(
                f"reward must be callable as reward(prompt_ids, response_ids) -> float, got "
                f"{type(reward).__name__} (for a function that takes more keywords add _partial_: true)"
            )
        self.prompts = prompts
        self.score = reward
        decode = getattr(prompts, "decode", None)
        if callable(decode):
            self.guarded: GuardedReward = TextReward(reward, decode, timeout_s=timeout_s)
        else:
            name = callable_name(reward)
            self.guarded = GuardedReward(
                self._score_ids, timeout_s=timeout_s, errors_score_zero=False, name=name
            )

    def _score_ids(self, prompt: RolloutPrompt, response_ids: list[int]) -> float:
        return self.reward(prompt.token_ids, response_ids)

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> list[list[int] | RolloutPrompt]:
        """The task's own ``sample_prompts``.

        Args:
            num_prompts: How many prompts.
            generator: The random source.

        Returns:
            Token-id lists or ``RolloutPrompt`` records, as the task gives them.
        """
        return self.prompts.sample_prompts(num_prompts, generator)

    def prompts_for_step(self, step: int, num_prompts: int, seed: int) -> list[RolloutPrompt]:
        """The RL step's prompts, a pure function of ``(seed, step)``: the same on every rank,
        for any number of ranks.

        Args:
            step: The RL step.
            num_prompts: How many prompts.
            seed: The run's seed.

        Returns:
            A dataset task's own ``prompts_for_step``, else ``sample_prompts`` with a generator
            seeded by ``sampling_seed(seed, step, -1)`` (-1: the groups' own seeds are >= 0);
            token-id lists become ``RolloutPrompt`` records, records keep their ground truth.
        """
        per_step = getattr(self.prompts, "prompts_for_step", None)
        if callable(per_step):
            return list(per_step(step, num_prompts))
        generator = torch.Generator().manual_seed(sampling_seed(seed, step, -1))
        prompts = self.sample_prompts(num_prompts, generator)
        return [p if isinstance(p, RolloutPrompt) else RolloutPrompt(p) for p in prompts]

    def score_prompt(self, prompt: RolloutPrompt, response_ids: list[int]) -> float:
        """The reward of one response, guarded: the collector's scorer.

        Blocks until the scorer returns or ``timeout_s`` passes.

        Args:
            prompt: The prompt (its ids, and a dataset row's ground truth).
            response_ids: The response's token ids.

        Returns:
            The reward; 0 for a timeout, or for a text scorer that raised.

        Raises:
            Exception: What an id scorer raised (it ends the run), or a ``ValueError`` for a
                value it returned that is not a finite number.
        """
        return self.guarded(prompt, response_ids)

    def environments(self) -> Environments | None:
        """The multi-turn rollouts of a task with ``make_environment``.

        Returns:
            [`Environments`][r3lightning.rollout.environment.Environments] whose factory is the
            task's ``make_environment(score_prompt)`` and whose turns are its ``max_turns`` (1 if
            it has none); None for a single-turn task.
        """
        make = getattr(self.prompts, "make_environment", None)
        if make is None:
            return None
        factory = functools.partial(make, self.score_prompt)  # each environment scores its answer
        return Environments(factory, getattr(self.prompts, "max_turns", 1))

    def pop_metrics(self) -> dict[str, float]:
        """The scorer's metrics since the last call, then resets them.

        Returns:
            ``reward/failures``, ``reward/timeouts`` and the mean of each extra entry a scorer
            returned (``reward/<key>``).
        """
        return self.guarded.pop_metrics()

    def reward(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        """The id reward of one response, unguarded.

        Args:
            prompt_ids: The prompt's token ids.
            response_ids: The response's token ids.

        Returns:
            The scorer's value as a float.

        Raises:
            ValueError: The scorer returned something other than a finite number.
        """
        value = self.score(prompt_ids, response_ids)
        try:
            return score_value(value, "")
        except ValueError:
            raise ValueError(
                f"reward {callable_name(self.score)} returned {value!r}; expected a finite number"
            ) from None


class TokenClassReward:
    """The share of the expected ``response_length`` tokens in the prompt's target class: a
    response cut short cannot score higher than a complete one.

    Args:
        num_classes: A token ``t`` is in class ``t % num_classes``.
        first_token: The id of the instruction for class 0.
        response_length: The response tokens scored; the score's denominator.
    """

    def __init__(self, num_classes: int = 2, first_token: int = 4, response_length: int = 4) -> None:
        self.num_classes = num_classes
        self.first_token = first_token
        self.response_length = response_length

    def target_class(self, prompt_ids: Sequence[int]) -> int:
        """The class the prompt's final instruction token asks for.

        Args:
            prompt_ids: A prompt of the task: it ends with an instruction token.

        Returns:
            The class, in ``[0, num_classes)``.

        Raises:
            ValueError: The last token is not an instruction token.
        """
        target = int(prompt_ids[-1]) - self.first_token
        if not 0 <= target < self.num_classes:
            raise ValueError(
                f"prompt must end with an instruction token in [{self.first_token}, "
                f"{self.first_token + self.num_classes}), got {int(prompt_ids[-1])}"
            )
        return target

    def __call__(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        target = self.target_class(prompt_ids)
        hits = sum(1 for t in response_ids[: self.response_length] if t % self.num_classes == target)
        return hits / self.response_length


class TokenClassTask:
    """Prompts of the token-class task (deterministic given the generator): `TokenClassReward`'s.

    Args:
        vocab_size: The model's vocabulary size; fillers are drawn above the instruction ids.
        num_classes: Instruction ids are ``[first_token, first_token + num_classes)``.
        prompt_length: Prompt ids: fillers, then one instruction (at least 1).
        response_length: Response tokens the reward scores (at least 1).
        first_token: The id of the instruction for class 0.

    Raises:
        ValueError: A size out of range, naming its ``task.*`` key.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        num_classes: int = 2,
        prompt_length: int = 6,
        response_length: int = 4,
        first_token: int = 4,
    ) -> None:
        # instruction ids are [first_token, first_token + num_classes); fillers come after them,
        # so special ids (pad, bos, eos below first_token) never appear in prompts
        check_token_class(vocab_size, num_classes, prompt_length, response_length, first_token)
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.first_token = first_token
        self.reward = TokenClassReward(num_classes, first_token, response_length)
        self.target_class = self.reward.target_class

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        """Random prompts: fillers, then the instruction of a random class. Host tensors only.

        Args:
            num_prompts: How many prompts.
            generator: The random source; the same generator state gives the same prompts.

        Returns:
            ``num_prompts`` lists of ``prompt_length`` token ids.
        """
        first_filler = self.first_token + self.num_classes  # fillers come after the instruction ids
        shape = (num_prompts, self.prompt_length - 1)
        fillers = torch.randint(first_filler, self.vocab_size, shape, generator=generator)
        classes = torch.randint(0, self.num_classes, (num_prompts, 1), generator=generator)
        return torch.cat([fillers, classes + self.first_token], dim=1).tolist()
