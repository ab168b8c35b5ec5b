"""A toy tool-use task that the tiny model learns: call the calculator, then answer with its result.

A prompt ends in operands ``first_token + a``, ``first_token + b`` and ``ASK``. A turn holding
``CALL`` gets ``[RESULT, first_token + (a + b) % num_classes]`` (the first call earns
``call_reward``); a turn without it is the answer (`CalculatorReward`, 0 before any call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from r3lightning.app.tasks.settings import check_calculator
from r3lightning.app.tasks.token_class import TokenClassReward
from r3lightning.rollout.prompts import RolloutPrompt

__all__ = ["CalculatorEnvironment", "CalculatorReward", "CalculatorTask"]


def _answer(prompt_ids: Sequence[int], first_token: int, num_classes: int) -> int:
    """``(a + b) % num_classes`` of the prompt's operand tokens (the two before ``ASK``)."""
    operands = [int(t) - first_token for t in prompt_ids[-3:-1]]
    if len(operands) != 2 or not all(0 <= v < num_classes for v in operands):
        raise ValueError(
            f"a calculator prompt ends with two operand ids in [{first_token}, {first_token + num_classes}) "
            f"and ASK, got {list(prompt_ids)[-3:]}"
        )
    return sum(operands) % num_classes


class CalculatorReward(TokenClassReward):
    """The answer's score (``reward=calculator``): `TokenClassReward` of ``(a + b) % num_classes``."""

    def target_class(self, prompt_ids: Sequence[int]) -> int:
        return _answer(prompt_ids, self.first_token, self.num_classes)


class CalculatorTask:
    """Prompts of the calculator task and its environments (``make_environment``).

    Token ids: operands ``[first_token, first_token + num_classes)``, then ``ASK``, ``CALL``,
    ``RESULT``, then fillers up to ``vocab_size``. ``max_turns``: generations per trajectory.
    """

    def __init__(
        self,
        vocab_size: int = 96,
        num_classes: int = 2,
        prompt_length: int = 6,
        response_length: int = 4,
        first_token: int = 4,
        call_reward: float = 0.2,
        max_turns: int = 3,
    ) -> None:
        check_calculator(
            vocab_size, num_classes, prompt_length, response_length, first_token, call_reward, max_turns
        )
        self.vocab_size, self.num_classes = vocab_size, num_classes
        self.prompt_length, self.response_length = prompt_length, response_length
        self.first_token, self.call_reward, self.max_turns = first_token, float(call_reward), max_turns
        self.ask_token = first_token + num_classes
        self.call_token, self.result_token = self.ask_token + 1, self.ask_token + 2

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        """``num_prompts`` prompts of ``prompt_length`` ids (host tensors only)."""
        shape = (num_prompts, self.prompt_length - 3)
        fillers = torch.randint(self.result_token + 1, self.vocab_size, shape, generator=generator)
        operands = torch.randint(0, self.num_classes, (num_prompts, 2), generator=generator)
        ask = torch.full((num_prompts, 1), self.ask_token)
        return torch.cat([fillers, operands + self.first_token, ask], dim=1).tolist()

    def make_environment(self, score: Callable[[RolloutPrompt, list[int]], float]) -> CalculatorEnvironment:
        """One trajectory's environment; ``score(prompt, answer_ids)`` rates the final answer."""
        return CalculatorEnvironment(self, score)


class CalculatorEnvironment:
    """The calculator tool of `CalculatorTask` for one trajectory (ids in, ids out)."""

    def __init__(self, task: CalculatorTask, score: Callable[[RolloutPrompt, list[int]], float]) -> None:
        self.task, self.score = task, score
        self.prompt: RolloutPrompt | None = None
        self.calls = 0

    def reset(self, prompt: RolloutPrompt) -> list[int]:
        self.prompt, self.calls = prompt, 0
        return prompt.token_ids

    def step(self, response: list[int]) -> tuple[list[int], float, bool, dict[str, int]]:
        if self.prompt is None:
            raise RuntimeError("CalculatorEnvironment.step before reset")
        task = self.task
        if task.call_token in response:
            self.calls += 1
            value = _answer(self.prompt.token_ids, task.first_token, task.num_classes)
            reward = task.call_reward if self.calls == 1 else 0.0
            return [task.result_token, task.first_token + value], reward, False, {"calls": self.calls}
        reward = self.score(self.prompt, response) if self.calls else 0.0
        return [], reward, True, {"calls": self.calls}
