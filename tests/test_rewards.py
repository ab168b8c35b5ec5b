"""verl-compatible text rewards and the scoring pool."""

from __future__ import annotations

import logging
import threading

import pytest

from r3lightning.job.rewards import TextRewardScorer, exact_match, extract_answer, math_answer
from r3lightning.models.tiny_tokenizer import build_tiny_tokenizer


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


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_scorer_decodes_and_passes_verl_arguments(tokenizer):
    calls = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((data_source, solution_str, ground_truth, extra_info, threading.current_thread().name))
        return {"score": 0.5, "format_ok": 1, "note": "text is not a metric"}

    ids = tokenizer.encode("12+3")
    with TextRewardScorer(compute_score, tokenizer, max_workers=2) as scorer:
        (result,) = scorer.score_all([("src", [*ids, tokenizer.eos_token_id], "15", {"i": 1})])
    assert (result.score, result.metrics, result.failed) == (0.5, {"format_ok": 1.0}, False)
    source, text, truth, extra, thread = calls[0]
    assert (source, text, truth, extra) == ("src", "12+3", "15", {"i": 1})  # eos skipped
    assert thread.startswith("r3-reward")  # off the calling thread


def test_failing_scorer_scores_zero_counted_and_logged_once(tokenizer, caplog):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "bad":
            raise RuntimeError("scorer exploded")
        return 1.0

    items = [("s", [10], truth, None) for truth in ("ok", "bad", "ok", "bad", "bad")]
    with caplog.at_level(logging.ERROR), TextRewardScorer(flaky, tokenizer) as scorer:
        results = scorer.score_all(items)
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert [r.failed for r in results] == [False, True, False, True, True]
    assert scorer.failures == 3
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "scorer exploded" in caplog.text  # the first traceback, once


@pytest.mark.parametrize("bad", [float("nan"), "1.0", True, {"value": 1.0}])
def test_non_numeric_rewards_count_as_failures(tokenizer, bad):
    with TextRewardScorer(lambda *a, **k: bad, tokenizer) as scorer:
        (result,) = scorer.score_all([("s", [10], "1", None)])
    assert result.failed and result.score == 0.0 and scorer.failures == 1


def test_a_slow_scorer_does_not_block_submission(tokenizer):
    release = threading.Event()

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        assert release.wait(10)
        return 1.0

    with TextRewardScorer(slow, tokenizer, max_workers=1) as scorer:
        futures = [scorer.submit("s", [10], "1") for _ in range(3)]
        assert not any(f.done() for f in futures)  # submit returned while scoring waits
        release.set()
        assert [f.result(timeout=10).score for f in futures] == [1.0, 1.0, 1.0]


def test_scorer_arguments_are_checked(tokenizer):
    with pytest.raises(TypeError, match="compute_score must be callable"):
        TextRewardScorer("not callable", tokenizer)
    with pytest.raises(ValueError, match=r"reward.max_workers must be >= 1"):
        TextRewardScorer(exact_match, tokenizer, max_workers=0)
