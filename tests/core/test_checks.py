"""The one validation vocabulary: each check lets exactly the documented values through and names
the field, the expectation and the value otherwise."""

from __future__ import annotations

import math

import pytest

from r3lightning.checks import check_fields, check_int, check_rank, check_setting
from r3lightning.rollout.config import RetryPolicy


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_check_setting_refuses_what_is_not_finite_even_without_bounds(value):
    with pytest.raises(ValueError, match=f"^timeout_s must be a number, got {value!r}$"):
        check_setting("timeout_s", value)
    with pytest.raises(ValueError, match=f"^timeout_s must be None or a number >= 0, got {value!r}$"):
        check_setting("timeout_s", value, low=0, optional=True)


def test_an_infinite_timeout_never_reaches_a_client():
    """A hung engine would never be given up on with timeout_s=inf."""
    with pytest.raises(ValueError, match=r"^timeout_s must be a number > 0, got inf$"):
        RetryPolicy(timeout_s=math.inf)


def test_check_setting_bounds_kinds_and_none():
    check_setting("x", 0, low=0)
    check_setting("x", 2.5, low=0, above=True, high=3)
    check_setting("x", None, optional=True)
    refused = [
        (dict(low=0), -1, "x must be a number >= 0, got -1"),
        (dict(low=0, above=True), 0, "x must be a number > 0, got 0"),
        (dict(high=3), 4, "x must be a number <= 3, got 4"),
        (dict(high=0.5), 1, "x must be a number <= 0.5, got 1"),
        (dict(integer=True), 1.0, "x must be an integer, got 1.0"),
        (dict(), True, "x must be a number, got True"),
        (dict(), "1", "x must be a number, got '1'"),
        (dict(), None, "x must be a number, got None"),
    ]
    for options, value, message in refused:
        with pytest.raises(ValueError) as info:
            check_setting("x", value, **options)
        assert str(info.value) == message


def test_check_int_and_check_rank():
    assert check_int("n", 3) == 3
    assert check_int("n", 0, 0) == 0
    assert check_rank("rank", 1, "world_size", 2) == 1
    for value in (0, True, 1.0, "2"):
        with pytest.raises(ValueError, match=f"^n must be an int >= 1, got {value!r}$"):
            check_int("n", value)
    for value in (-1, 2, False):
        with pytest.raises(
            ValueError, match=rf"^rank must be an int in \[0, 2\) for world_size=2, got {value!r}$"
        ):
            check_rank("rank", value, "world_size", 2)


def test_check_fields_wants_exactly_the_keys_typed_and_bounded():
    rules = {"batches": (int, 0), "shuffle": (bool, None), "seed": (int, None)}
    state = {"batches": 0, "shuffle": True, "seed": -5}
    assert check_fields(state, rules, "cursor") is state
    refused = [
        (
            {"batches": 0, "shuffle": True},
            "cursor must be a dict with the keys ['batches', 'seed', 'shuffle'], got ['batches', 'shuffle']",
        ),
        ([1], "cursor must be a dict with the keys ['batches', 'seed', 'shuffle'], got list"),
        ({**state, "batches": -1}, "cursor.batches must be an int >= 0, got -1"),
        ({**state, "shuffle": 1}, "cursor.shuffle must be a bool, got 1"),
        ({**state, "seed": True}, "cursor.seed must be an int, got True"),
    ]
    for bad, message in refused:
        with pytest.raises(ValueError) as info:
            check_fields(bad, rules, "cursor")
        assert str(info.value) == message
