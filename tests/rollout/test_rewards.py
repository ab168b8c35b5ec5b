"""verl-compatible text rewards and the scoring pool."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import pytest
import torch

from r3lightning.app.models.tiny_tokenizer import build_tiny_tokenizer
from r3lightning.app.tasks.rewards import exact_match, extract_answer, math_answer
from r3lightning.rollout.prompts import RolloutPrompt, TextReward, score_value


@pytest.mark.parametrize(
    ("solution", "truth", "score"),
    [
        ("the answer is 5", "5", 1.0),
        ("3+2 = 5. so answer: 6", "6", 1.0),
        ("we get \\boxed{1/2} and later 7", "0.5", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("first 4 then 9", "4", 0.0),  # the last number counts
        ("no number at all", "3", 0.0),
        ("answer: Paris.", "paris", 1.0),
    ],
)
def test_math_answer(solution, truth, score):
    assert math_answer("any", solution, truth) == score


def test_extract_answer_and_exact_match():
    assert extract_answer("a \\boxed{3} b \\boxed{4}") == "4"
    assert extract_answer("nothing") is None
    assert exact_match("s", " 42. ", "42") == 1.0
    assert exact_match("s", "42 and more", "42") == 0.0


def test_text_reward_decodes_passes_verl_arguments_and_keeps_extra_numbers():
    tokenizer = build_tiny_tokenizer()
    calls = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": 0.5, "format_ok": 1, "note": "text is not a metric"}

    reward = TextReward(compute_score, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    prompt = RolloutPrompt([5], data_source="src", ground_truth="15", extra_info={"i": 1})
    assert reward(prompt, [*tokenizer.encode("12+3"), tokenizer.eos_token_id]) == 0.5
    assert reward(prompt, tokenizer.encode("1")) == 0.5
    assert calls[0] == ("src", "12+3", "15", {"i": 1})  # eos skipped
    assert reward.pop_metrics() == {"reward/format_ok": 1.0, "reward/failures": 0.0, "reward/timeouts": 0.0}
    assert reward.pop_metrics() == {"reward/failures": 0.0, "reward/timeouts": 0.0}  # reset


def test_failing_scorer_scores_zero_counted_and_logged_once_per_run(caplog):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "bad":
            raise RuntimeError("scorer\nexploded")
        return {"score": 1.0, "ok": 1.0}

    reward = TextReward(flaky, str)
    with caplog.at_level(logging.WARNING):
        scores = [reward(RolloutPrompt([1], ground_truth=t), [1]) for t in ("ok", "bad", "ok", "bad", "bad")]
        # a failed response counts in the mean of the extra entries as a 0
        assert reward.pop_metrics() == {
            "reward/ok": pytest.approx(2 / 5),
            "reward/failures": 3.0,
            "reward/timeouts": 0.0,
        }
        assert reward(RolloutPrompt([1], ground_truth="bad"), [1]) == 0.0  # the next step fails again
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    (record,) = caplog.records  # once per run, not once per step
    assert record.getMessage() == (
        "reward test_failing_scorer_scores_zero_counted_and_logged_once_per_run.<locals>.flaky raised "
        "RuntimeError: scorer exploded; the response scored 0 (counted in reward/failures; logged once per run)"
    )
    assert record.exc_info[0] is RuntimeError  # the traceback follows the line
    assert reward.pop_metrics()["reward/failures"] == 1.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (np.float32(0.5), 0.5),
        (np.float64(0.25), 0.25),
        (np.int64(1), 1.0),
        (np.array(0.75, dtype=np.float32), 0.75),  # 0-d array
        (np.array([3], dtype=np.int16), 3.0),
        (torch.tensor(0.5), 0.5),
        ({"score": np.float32(0.5)}, 0.5),
        ({"score": np.array(2, dtype=np.int64)}, 2.0),
        (True, 1.0),  # verl scorers often return `answer == truth`: a bool is 1 or 0
        (np.bool_(False), 0.0),
        (Fraction(1, 4), 0.25),
        (-2, -2.0),
    ],
    ids=repr,
)
def test_any_real_number_is_a_score(value, expected):
    reward = TextReward(lambda *a, **k: value, str)
    score = reward(RolloutPrompt([1]), [1])
    assert score == expected and type(score) is float
    assert reward.pop_metrics()["reward/failures"] == 0.0
    assert score_value(value, "here") == expected


def test_numpy_extra_entries_are_averaged():
    reward = TextReward(
        lambda *a, **k: {"score": 1, "length": np.int64(4), "ok": np.bool_(True), "v": np.zeros(2)}, str
    )
    reward(RolloutPrompt([1]), [1])
    assert reward.pop_metrics() == {
        "reward/length": 4.0,
        "reward/ok": 1.0,
        "reward/failures": 0.0,
        "reward/timeouts": 0.0,
    }


@pytest.mark.parametrize(
    "bad",
    [float("nan"), float("inf"), np.float32("nan"), "1.0", None, 1j, np.array([1.0, 2.0]), {"value": 1.0}],
    ids=repr,
)
def test_non_numeric_rewards_count_as_failures(bad):
    reward = TextReward(lambda *a, **k: bad, str)
    assert reward(RolloutPrompt([1]), [1]) == 0.0
    assert reward.pop_metrics()["reward/failures"] == 1.0
    with pytest.raises(ValueError, match=r"for here"):
        score_value(bad, "here")


def test_a_scorer_that_never_returns_times_out_scores_zero_and_is_counted(caplog):
    release = threading.Event()

    def stuck(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "hang":
            release.wait(60)  # never set before the timeout: a scorer stuck on a dead sandbox
        return 1.0

    reward = TextReward(stuck, str, timeout_s=0.2)
    try:
        with caplog.at_level(logging.WARNING):
            start = time.perf_counter()
            with ThreadPoolExecutor(2) as pool:  # the collector's reward threads
                hangs = pool.map(lambda t: reward(RolloutPrompt([1], ground_truth=t), [1]), ["hang"] * 3)
                assert list(hangs) == [0.0, 0.0, 0.0]
            elapsed = time.perf_counter() - start
            assert reward(RolloutPrompt([1], ground_truth="fine"), [1]) == 1.0
    finally:
        release.set()
    assert 0.2 <= elapsed < 50.0  # two waves of 0.2 s, not 60 s (generous: a loaded machine)
    assert reward.pop_metrics() == {"reward/failures": 0.0, "reward/timeouts": 3.0}
    (record,) = caplog.records
    assert record.getMessage() == (
        "reward test_a_scorer_that_never_returns_times_out_scores_zero_and_is_counted.<locals>.stuck did not "
        "return within 0.2 s; the response scored 0 (counted in reward/timeouts; logged once per run)"
    )


def test_no_timeout_calls_the_scorer_in_the_callers_thread():
    threads = []
    reward = TextReward(
        lambda *a, **k: threads.append(threading.current_thread()) or 1.0, str, timeout_s=None
    )
    assert reward(RolloutPrompt([1]), [1]) == 1.0 and threads == [threading.current_thread()]
    guarded = TextReward(lambda *a, **k: threads.append(threading.current_thread()) or 1.0, str)
    assert guarded.timeout_s == 60.0 and guarded(RolloutPrompt([1]), [1]) == 1.0
    assert threads[1] is not threading.current_thread() and threads[1].daemon
    for bad in (0, -1.0, "60", True):
        with pytest.raises(ValueError, match=rf"^timeout_s must be a number > 0 or None, got {bad!r}$"):
            TextReward(str, str, timeout_s=bad)


def test_id_rewards_time_out_but_their_errors_end_the_run():
    from r3lightning.app.tasks.token_class import ScoredTask, TokenClassTask

    release = threading.Event()

    def reward(prompt_ids, response_ids):
        if response_ids == [9]:
            release.wait(60)
        if response_ids == [8]:
            raise RuntimeError("bug in the reward")
        return np.float32(0.5)

    task = ScoredTask(TokenClassTask(vocab_size=32), reward, timeout_s=0.2)
    try:
        assert task.score_prompt(RolloutPrompt([5]), [1]) == 0.5
        assert task.score_prompt(RolloutPrompt([5]), [9]) == 0.0
        with pytest.raises(RuntimeError, match="bug in the reward"):
            task.score_prompt(RolloutPrompt([5]), [8])
    finally:
        release.set()
    assert task.pop_metrics() == {"reward/failures": 0.0, "reward/timeouts": 1.0}
    assert task.reward([5], [1]) == 0.5


def test_text_reward_is_safe_from_reward_threads():
    reward = TextReward(lambda d, s, g, extra_info=None: {"score": 1.0, "n": 1.0}, str)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: reward(RolloutPrompt([1]), [1]), range(400))) == [1.0] * 400
    assert reward.pop_metrics() == {"reward/n": 1.0, "reward/failures": 0.0, "reward/timeouts": 0.0}


def test_compute_score_must_be_callable():
    with pytest.raises(TypeError, match="compute_score must be callable"):
        TextReward("not callable", str)
