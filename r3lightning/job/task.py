"""A small verifiable task that a randomly initialised tiny model learns in a few RL steps.

A prompt is a few random filler tokens followed by an *instruction* token naming a class
``c`` in ``[0, num_classes)`` (token id ``first_token + c``); the class of token ``t`` is
``t % num_classes``. The reward is the fraction of response tokens in class ``c``, so it is exact
and cheap (no reward model). A uniform random policy scores ``1 / num_classes``, the optimum is
1.0, and the answer depends on the prompt. The instruction sits right before the first response
token, so a randomly initialised tiny model learns the rule in a few tens of GRPO steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class TokenClassTaskConfig:
    vocab_size: int = 256
    num_classes: int = 2
    prompt_length: int = 6
    response_length: int = 4
    # instruction ids are [first_token, first_token + num_classes); fillers come after them,
    # so special ids (pad, bos, eos below first_token) never appear in prompts
    first_token: int = 4


class TokenClassTask:
    """Prompts and rewards of the token-class task; deterministic given the generator."""

    def __init__(self, config: TokenClassTaskConfig):
        if config.num_classes < 2:
            raise ValueError(f"task.num_classes must be >= 2, got {config.num_classes}")
        if config.prompt_length < 1 or config.response_length < 1:
            raise ValueError(
                "task.prompt_length and task.response_length must be >= 1, got "
                f"{config.prompt_length} and {config.response_length}"
            )
        if not 0 <= config.first_token < config.vocab_size - 2 * config.num_classes:
            raise ValueError(
                f"task.first_token must be in [0, vocab_size - 2 * num_classes) = "
                f"[0, {config.vocab_size - 2 * config.num_classes}), got {config.first_token}"
            )
        self.config = config

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        """``num_prompts`` random prompts of ``prompt_length`` token ids (host tensors only)."""
        c = self.config
        filler_start = c.first_token + c.num_classes
        fillers = torch.randint(
            filler_start, c.vocab_size, (num_prompts, c.prompt_length - 1), generator=generator
        )  # [num_prompts, prompt_length - 1]
        classes = torch.randint(0, c.num_classes, (num_prompts, 1), generator=generator)
        return torch.cat([fillers, classes + c.first_token], dim=1).tolist()

    def target_class(self, prompt_ids: Sequence[int]) -> int:
        """The class the prompt's final instruction token asks for."""
        c = self.config
        target = int(prompt_ids[-1]) - c.first_token
        if not 0 <= target < c.num_classes:
            raise ValueError(
                f"prompt must end with an instruction token in [{c.first_token}, "
                f"{c.first_token + c.num_classes}), got {int(prompt_ids[-1])}"
            )
        return target

    def reward(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        """Fraction of the expected ``response_length`` tokens in the prompt's target class.

        Dividing by the expected length (not the actual one) means a response cut short
        cannot score higher than a complete one.
        """
        target = self.target_class(prompt_ids)
        hits = sum(
            1 for t in response_ids[: self.config.response_length] if t % self.config.num_classes == target
        )
        return hits / self.config.response_length
