"""verl-compatible text rewards and the scoring pool."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest

from r3lightning.rollout.prompts import RolloutPrompt, TextReward
from r3lightning.rollout.rewards import exact_match, extract_answer, math_answer
from r3lightning.testing.tiny_tokenizer import build_tiny_tokenizer


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
    assert reward.pop_metrics() == {"reward/format_ok": 1.0, "reward/failures": 0.0}
    assert reward.pop_metrics() == {"reward/failures": 0.0}  # reset


def test_failing_scorer_scores_zero_counted_and_logged_once(caplog):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "bad":
            raise RuntimeError("scorer exploded")
        return {"score": 1.0, "ok": 1.0}

    reward = TextReward(flaky, str)
    with caplog.at_level(logging.ERROR):
        scores = [reward(RolloutPrompt([1], ground_truth=t), [1]) for t in ("ok", "bad", "ok", "bad", "bad")]
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "scorer exploded" in caplog.text  # the first traceback, once
    # a failed response counts in the mean of the extra entries as a 0
    assert reward.pop_metrics() == {"reward/ok": pytest.approx(2 / 5), "reward/failures": 3.0}


@pytest.mark.parametrize("bad", [float("nan"), "1.0", True, {"value": 1.0}])
def test_non_numeric_rewards_count_as_failures(bad):
    reward = TextReward(lambda *a, **k: bad, str)
    assert reward(RolloutPrompt([1]), [1]) == 0.0
    assert reward.pop_metrics()["reward/failures"] == 1.0


def test_text_reward_is_safe_from_reward_threads():
    reward = TextReward(lambda d, s, g, extra_info=None: {"score": 1.0, "n": 1.0}, str)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: reward(RolloutPrompt([1]), [1]), range(400))) == [1.0] * 400
    assert reward.pop_metrics() == {"reward/n": 1.0, "reward/failures": 0.0}


def test_compute_score_must_be_callable():
    with pytest.raises(TypeError, match="compute_score must be callable"):
        TextReward("not callable", str)
