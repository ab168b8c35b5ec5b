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
        """The class the answer must hold: ``(a + b) % num_classes`` of the prompt's operands.

        Args:
            prompt_ids: A calculator prompt: it ends with the two operand ids and ``ASK``.

        Returns:
            The sum's class, in ``[0, num_classes)``.

        Raises:
            ValueError: The prompt does not end with two operand ids and ``ASK``.
        """
        return _answer(prompt_ids, self.first_token, self.num_classes)


class CalculatorTask:
    """Prompts of the calculator task and its environments (``make_environment``).

    Token ids: operands ``[first_token, first_token + num_classes)``, then ``ASK``, ``CALL``,
    ``RESULT``, then fillers up to ``vocab_size``.

    Args:
        vocab_size: The model's vocabulary size; fillers are drawn above ``RESULT``.
        num_classes: Operand values (and answers) are in ``[0, num_classes)``.
        prompt_length: Prompt ids: fillers, the two operands and ``ASK`` (at least 3).
        response_length: Answer ids the reward scores (at least 1).
        first_token: The id of operand 0; the ids below it (pad, bos, eos) never appear in
            prompts.
        call_reward: The reward of a trajectory's first calculator call.
        max_turns: Generations per trajectory (at least 1).

    Raises:
        ValueError: A size out of range, naming its ``task.*`` key.
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
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.first_token = first_token
        self.call_reward = float(call_reward)
        self.max_turns = max_turns
        # the three control tokens follow the operand ids
        self.ask_token = first_token + num_classes
        self.call_token = self.ask_token + 1
        self.result_token = self.ask_token + 2

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> list[list[int]]:
        """Random prompts: fillers, two operands, ``ASK``. Host tensors only.

        Args:
            num_prompts: How many prompts.
            generator: The random source; the same generator state gives the same prompts.

        Returns:
            ``num_prompts`` lists of ``prompt_length`` token ids.
        """
        shape = (num_prompts, self.prompt_length - 3)
        fillers = torch.randint(self.result_token + 1, self.vocab_size, shape, generator=generator)
        operands = torch.randint(0, self.num_classes, (num_prompts, 2), generator=generator)
        ask = torch.full((num_prompts, 1), self.ask_token)
        return torch.cat([fillers, operands + self.first_token, ask], dim=1).tolist()

    def make_environment(self, score: Callable[[RolloutPrompt, list[int]], float]) -> CalculatorEnvironment:
        """The environment of one trajectory.

        Args:
            score: Rates the final answer: ``score(prompt, answer_ids) -> reward``.

        Returns:
            A new `CalculatorEnvironment`.
        """
        return CalculatorEnvironment(self, score)


class CalculatorEnvironment:
    """The calculator tool of `CalculatorTask` for one trajectory (ids in, ids out).

    Args:
        task: The task (its token ids and rewards).
        score: Rates the final answer: ``score(prompt, answer_ids) -> reward``.
    """

    def __init__(self, task: CalculatorTask, score: Callable[[RolloutPrompt, list[int]], float]) -> None:
        self.task = task
        self.score = score
        self.prompt: RolloutPrompt | None = None
        self.calls = 0

    def reset(self, prompt: RolloutPrompt) -> list[int]:
        """Starts the trajectory of ``prompt``.

        Args:
            prompt: The prompt; its ids end with the two operands and ``ASK``.

        Returns:
            The first observation: the prompt's token ids.
        """
        self.prompt = prompt
        self.calls = 0
        return prompt.token_ids

    def step(self, response: list[int]) -> tuple[list[int], float, bool, dict[str, int]]:
        """One turn: a response holding ``CALL`` calls the calculator, any other is the answer.

        Args:
            response: The turn's generated token ids.

        Returns:
            ``(observation, reward, done, info)``. A call: ``[RESULT, first_token + sum]``, the
            ``call_reward`` for the first call (0 after), not done. An answer: no ids, its
            score (0 before any call), done. ``info`` counts the ``calls`` so far.

        Raises:
            RuntimeError: Called before `reset`.
        """
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
