"""The calculator tool task: prompt layout, the tool's observations, per-turn rewards, the job's
reward config wiring (ScoredTask.environment_factory)."""

from __future__ import annotations

import pytest
import torch

from r3lightning.app.tasks.calculator import CalculatorReward, CalculatorTask
from r3lightning.app.tasks.token_class import ScoredTask, TokenClassTask
from r3lightning.rollout.prompts import RolloutPrompt

# default ids: operands 4, 5; ASK 6, CALL 7, RESULT 8; fillers 9..95
ASK, CALL, RESULT = 6, 7, 8


def test_prompts_end_with_two_operands_and_ask():
    task = CalculatorTask(vocab_size=96, prompt_length=7)
    prompts = task.sample_prompts(64, torch.Generator().manual_seed(3))
    assert prompts == task.sample_prompts(64, torch.Generator().manual_seed(3))
    assert (task.ask_token, task.call_token, task.result_token) == (ASK, CALL, RESULT)
    for prompt in prompts:
        assert len(prompt) == 7 and prompt[-1] == ASK
        assert all(9 <= t < 96 for t in prompt[:4]) and all(t in (4, 5) for t in prompt[4:6])
    assert {tuple(p[4:6]) for p in prompts} == {(4, 4), (4, 5), (5, 4), (5, 5)}


@pytest.mark.parametrize(("a", "b"), [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_the_tool_answers_and_only_an_answer_after_a_call_scores(a, b):
    answer = (a + b) % 2
    scored = []

    def score(prompt, response):
        scored.append(list(response))
        return 0.75

    env = CalculatorTask(call_reward=0.2).make_environment(score)
    prompt = RolloutPrompt([50, 51, 52, 4 + a, 4 + b, ASK])
    assert env.reset(prompt) == prompt.token_ids
    assert env.step([10, 11, 12, 13]) == ([], 0.0, True, {"calls": 0})  # no tool: scores 0
    assert scored == []
    env.reset(prompt)
    assert env.step([10, CALL, 12, 13]) == ([RESULT, 4 + answer], 0.2, False, {"calls": 1})
    assert env.step([CALL, 9, 9, 9]) == ([RESULT, 4 + answer], 0.0, False, {"calls": 2})  # once only
    assert env.step([20, 21, 22, 23]) == ([], 0.75, True, {"calls": 2})
    assert scored == [[20, 21, 22, 23]]


def test_the_answer_reward_is_the_class_fraction_of_the_operands_sum():
    reward = CalculatorReward(num_classes=3, first_token=4, response_length=4)
    prompt = [40, 4 + 2, 4 + 2, 9]  # (2 + 2) % 3 == 1
    assert reward(prompt, [1, 4, 7, 8]) == 3 / 4  # t % 3 == 1 for 1, 4, 7
    assert reward(prompt, [1, 4]) == 2 / 4  # a short answer cannot score more than a full one
    with pytest.raises(ValueError, match=r"two operand ids in \[4, 7\) and ASK, got \[40, 9, 9\]"):
        reward([40, 9, 9], [1])


def test_scored_task_builds_environments_with_the_checked_reward():
    task = ScoredTask(CalculatorTask(max_turns=4), CalculatorReward())
    assert task.environments().max_turns == 4
    env = task.environments().make()
    env.reset(RolloutPrompt([50, 51, 52, 5, 4, ASK]))  # answer 1
    env.step([CALL])
    assert env.step([5, 9, 10, 11]) == ([], 0.75, True, {"calls": 1})
    assert ScoredTask(TokenClassTask(), lambda p, r: 0.0).environments() is None
    nan = ScoredTask(CalculatorTask(), lambda p, r: float("nan")).environments().make()
    nan.reset(RolloutPrompt([50, 51, 52, 5, 4, ASK]))
    nan.step([CALL])
    with pytest.raises(ValueError, match="expected a finite number"):
        nan.step([5])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_classes": 1}, "task.num_classes must be an integer >= 2, got 1"),
        ({"prompt_length": 2}, "task.prompt_length must be an integer >= 3"),
        ({"max_turns": 0}, "task.max_turns must be an integer >= 1, got 0"),
        ({"first_token": 90}, r"task.first_token must be in \[0, vocab_size - num_classes - 4\) = \[0, 90\)"),
    ],
)
def test_bad_settings_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CalculatorTask(**kwargs)
    with pytest.raises(RuntimeError, match="step before reset"):
        CalculatorTask().make_environment(lambda p, r: 0.0).step([1])
