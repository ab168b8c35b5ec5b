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
    """A task's prompts with the reward that scores them (``task`` and ``reward`` config keys): a
    task with ``decode`` (a dataset) by a verl-style ``compute_score`` (`TextReward`: a
    scorer that raises scores 0), any other by ``reward(prompt_ids, response_ids)`` (an exception
    ends the run). A scorer still running after ``timeout_s`` seconds scores 0 either way."""

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
        self.prompts, self.score = prompts, reward
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
        return self.prompts.sample_prompts(num_prompts, generator)

    def prompts_for_step(self, step: int, num_prompts: int, seed: int) -> list[RolloutPrompt]:
        """The RL step's prompts, a pure function of ``(seed, step)`` (the same on every rank, for
        any number of ranks): a dataset task's own ``prompts_for_step``, else ``sample_prompts``
        with a generator seeded by ``sampling_seed(seed, step, -1)`` (groups are >= 0); either
        gives token-id lists or ``RolloutPrompt`` records (their ground truth kept)."""
        per_step = getattr(self.prompts, "prompts_for_step", None)
        if callable(per_step):
            return list(per_step(step, num_prompts))
        generator = torch.Generator().manual_seed(sampling_seed(seed, step, -1))
        prompts = self.sample_prompts(num_prompts, generator)
        return [p if isinstance(p, RolloutPrompt) else RolloutPrompt(p) for p in prompts]

    def score_prompt(self, prompt: RolloutPrompt, response_ids: list[int]) -> float:
        """The reward of one response to ``prompt`` (0 for a timeout, or a text scorer's failure)."""
        return self.guarded(prompt, response_ids)

    def environments(self) -> Environments | None:
        """A multi-turn task's [`Environments`][r3lightning.rollout.environment.Environments] (its ``make_environment(score_prompt)`` and
        ``max_turns``, 1 if it has none); None for a single-turn task."""
        make = getattr(self.prompts, "make_environment", None)
        if make is None:
            return None
        return Environments(functools.partial(make, self.score_prompt), getattr(self.prompts, "max_turns", 1))

    def pop_metrics(self) -> dict[str, float]:
        """``reward/failures``, ``reward/timeouts`` and the scorer's extra entries since the last call."""
        return self.guarded.pop_metrics()

    def reward(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        """The id reward of one response, unguarded: a ``ValueError`` unless a real number."""
        value = self.score(prompt_ids, response_ids)
        try:
            return score_value(value, "")
        except ValueError:
            raise ValueError(
                f"reward {callable_name(self.score)} returned {value!r}; expected a finite number"
            ) from None


class TokenClassReward:
    """Fraction of the expected ``response_length`` tokens in the prompt's target class: a
    response cut short cannot score higher than a complete one."""

    def __init__(self, num_classes: int = 2, first_token: int = 4, response_length: int = 4) -> None:
        self.num_classes, self.first_token, self.response_length = num_classes, first_token, response_length

    def target_class(self, prompt_ids: Sequence[int]) -> int:
        """The class the prompt's final instruction token asks for."""
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
    """Prompts of the token-class task (deterministic given the generator): `TokenClassReward`'s."""

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
        self.vocab_size, self.num_classes, self.prompt_length = vocab_size, num_classes, prompt_length
        self.response_length, self.first_token = response_length, first_token
        self.reward = TokenClassReward(num_classes, first_token, response_length)
        self.target_class = self.reward.target_class

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        """``num_prompts`` random prompts of ``prompt_length`` token ids (host tensors only)."""
        shape, low = (num_prompts, self.prompt_length - 1), self.first_token + self.num_classes
        fillers = torch.randint(low, self.vocab_size, shape, generator=generator)
        classes = torch.randint(0, self.num_classes, (num_prompts, 1), generator=generator)
        return torch.cat([fillers, classes + self.first_token], dim=1).tolist()
