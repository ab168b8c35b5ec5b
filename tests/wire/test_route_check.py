"""The one route check (r3lightning.wire.route_check) against a plain-Python reference.

Every layout numpy may hand it (dtypes of every width and byte order, strided and Fortran-ordered
views, blocks of any size) must raise exactly what the set-based reference says, on the same row.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from route_samples import distinct_routes

from r3lightning.wire import route_check
from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.route_check import check_distinct, check_routes


def reference_error(
    routes: np.ndarray, num_experts: int | None, distinct: bool, rows: range | None
) -> str | None:
    """The message check_routes must raise, from Python ints and sets (None: valid)."""
    ids = [int(i) for i in routes.reshape(-1)]
    if ids and min(ids) < 0:
        return f"routed_experts: expert id {min(ids)} is negative"
    if ids and max(ids) >= (num_experts or 2**31):
        bound = f"num_experts={num_experts}" if num_experts else "int32 (ids < 2**31)"
        return f"routed_experts: expert id {max(ids)} is out of range for {bound}"
    for row in range(routes.shape[0] if distinct else 0):
        for layer in range(routes.shape[1]):
            experts = [int(i) for i in routes[row, layer]]
            if any(experts) and len(set(experts)) < len(experts):
                return f"routed_experts: row {row} layer {layer} repeats an expert: {experts}"
    if rows is not None and routes.shape[0] not in rows:
        return f"routed_experts: {routes.shape[0]} route rows, expected {rows}"
    return None


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(0, 9),
    layers=st.integers(1, 3),
    top_k=st.sampled_from([1, 2, 3, 6, 8, 10, 16]),
    dtype=st.sampled_from(["<u1", "<i2", "<u2", "<i4", ">i4", "<i8", "<u8"]),
    num_experts=st.sampled_from([None, 16, 128, 129, 256, 300, 32_768, 40_000]),
    block=st.sampled_from([1, 2, 5, 1 << 15]),
    seed=st.integers(0, 2**16),
    edits=st.lists(st.sampled_from(["repeat", "zero row", "zero pair", "negative", "large"]), max_size=3),
    distinct=st.booleans(),
    allowed=st.sampled_from([None, range(0, 5), range(3, 4)]),
)
def test_check_matches_a_set_based_reference(
    rows, layers, top_k, dtype, num_experts, block, seed, edits, distinct, allowed
):
    rng = np.random.default_rng(seed)
    routes = distinct_routes(rows, layers, top_k, max(16, top_k), seed).astype(dtype)
    info = np.iinfo(routes.dtype)
    for edit in edits if routes.size else []:
        row, layer, lane = rng.integers(rows), rng.integers(layers), rng.integers(top_k)
        if edit == "repeat" and top_k > 1:
            routes[row, layer, (lane + 1) % top_k] = routes[row, layer, lane]
        elif edit == "zero row":
            routes[row, layer] = 0  # a dense layer's filler: allowed
        elif edit == "zero pair" and top_k > 1:
            routes[row, layer, :2] = 0  # expert 0 twice in a row that is not all zero
        elif edit == "negative" and info.min < 0:
            routes[row, layer, lane] = max(info.min, -30_000)  # unsigned image below 40_000 as int16
        elif edit == "large":
            routes[row, layer, lane] = min(info.max, 35_000)
    before = routes.copy()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(route_check, "_BLOCK", block)
        for view in (routes, routes[:, ::-1], np.asfortranarray(routes)):
            want = reference_error(view, num_experts, distinct, allowed)
            kwargs = {"num_experts": num_experts, "distinct": distinct, "rows": allowed}
            if want is None:
                high = check_routes(view, **kwargs)
                assert high == max((int(i) for i in view.reshape(-1)), default=0)
            else:
                with pytest.raises(ValueError) as caught:
                    check_routes(view, **kwargs)
                assert str(caught.value) == want
    np.testing.assert_array_equal(routes, before)  # never modified


def test_the_first_repeat_is_reported_across_blocks(monkeypatch):
    monkeypatch.setattr(route_check, "_BLOCK", 4)
    routes = distinct_routes(7, 2, 3, 10, seed=5)  # 14 [top_k] rows: blocks of 4
    routes[1, 0] = 0  # filler, first block
    routes[4, 1] = 0  # filler, third block (flat rows 8-11)
    routes[5, 0] = [7, 1, 7]  # flat row 10: the first repeat
    routes[5, 1] = [2, 2, 3]  # flat row 11, same block
    routes[6, 0] = [4, 4, 3]  # flat row 12, next block
    with pytest.raises(ValueError, match=r"^where: row 5 layer 0 repeats an expert: \[7, 1, 7\]$"):
        check_distinct(routes, "where")


def test_all_zero_rows_are_exempt_and_ids_are_reported_before_repeats():
    routes = np.zeros((3000, 2, 8), dtype=np.uint8)
    assert check_routes(routes, num_experts=1) == 0
    routes[2500, 1] = [0, 0, 0, 0, 0, 0, 0, 9]  # not dense filler: a real repeat of 0
    with pytest.raises(ValueError, match=r"row 2500 layer 1 repeats an expert"):
        check_routes(routes, num_experts=10)
    with pytest.raises(ValueError, match="expert id 9 is out of range for num_experts=9"):
        check_routes(routes, num_experts=9)
    check_routes(routes, num_experts=10, distinct=False)


def test_the_row_count_follows_the_ids_and_names_its_rule():
    routes = distinct_routes(4, 2, 2, 8).astype(np.uint8)
    assert check_routes(routes, rows=range(4, 5)) == int(routes.max())
    with pytest.raises(ValueError, match=r"^r: 4 route rows, expected P - start \+ G - 1 = 5$"):
        check_routes(routes, rows=range(5, 6), rows_rule="P - start + G - 1 = 5", where="r")
    routes[0, 0] = 9
    with pytest.raises(ValueError, match="expert id 9 is out of range for num_experts=8"):
        check_routes(routes, num_experts=8, rows=range(5, 6))  # the id, not the count, is reported


@pytest.mark.parametrize(
    ("routes", "kwargs", "message"),
    [
        (np.zeros((2, 4), np.uint8), {}, r"expected shape \[rows, num_layers, top_k\], got \[2, 4\]"),
        (np.zeros((2, 0, 2), np.uint8), {}, r"shape \[2, 0, 2\] has 0 on axis 1, expected num_layers >= 1"),
        (np.zeros((2, 3, 0), np.uint8), {}, r"shape \[2, 3, 0\] has 0 on axis 2, expected top_k >= 1"),
        (
            np.zeros((2, 3, 2), np.uint8),
            {"num_layers": 4},
            r"shape \[2, 3, 2\] has 3 on axis 1, expected num_layers=4",
        ),
        (np.zeros((2, 3, 2), np.uint8), {"top_k": 1}, r"shape \[2, 3, 2\] has 2 on axis 2, expected top_k=1"),
        (np.zeros((2, 3, 2), np.float32), {}, r"expected integer expert ids, got dtype float32"),
        (
            np.array([[[2**40, 2**40 + 1]]], np.uint64),
            {},
            r"expert id 1099511627777 is out of range for int32 \(ids < 2\*\*31\)$",
        ),
    ],
)
def test_shape_dtype_and_width_errors(routes, kwargs, message):
    with pytest.raises(MalformedResponseError, match="^f: " + message):
        check_routes(routes, where="f", error=MalformedResponseError, **kwargs)


def test_errors_are_value_errors_of_the_callers_class():
    bad = np.array([[[3, 3]]], np.int16)
    with pytest.raises(ValueError) as caught:
        check_routes(bad)
    assert type(caught.value) is ValueError
    with pytest.raises(
        MalformedResponseError, match=r"routed_experts: row 0 layer 0 repeats an expert: \[3, 3\]"
    ):
        check_routes(bad, error=MalformedResponseError)
    readonly = np.array([[[5, 4]], [[-1, 2]]], dtype=np.int32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="expert id -1 is negative"):
        check_routes(readonly, num_experts=6)
