"""Route validation (range and distinct experts per row) against plain-Python references.

The compiled kernel covers C-contiguous 1, 2 and 4-byte ids with a power-of-two top_k; numpy
covers the rest. Both must raise exactly what the set-based reference says, on the same rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from route_samples import distinct_routes

from r3lightning import MalformedResponseError
from r3lightning.wire import route_check, route_kernels
from r3lightning.wire.route_check import check_unique_rows, validate_routes


def naive_validation_error(
    routes: np.ndarray, num_experts: int | None, check_unique: bool = True
) -> str | None:
    """The message validate_routes must raise, from plain Python loops (None: valid)."""
    ids = routes.astype(np.int64)
    if ids.size and routes.dtype.kind == "i" and ids.min() < 0:
        return f"routed_experts: expert id {ids.min()} is negative"
    if ids.size and num_experts is not None and ids.max() >= num_experts:
        return f"routed_experts: expert id {ids.max()} is out of range for num_experts={num_experts}"
    for row in range(routes.shape[0] if check_unique else 0):
        for layer in range(routes.shape[1]):
            experts = ids[row, layer].tolist()
            if len(set(experts)) < len(experts) and any(experts):
                return f"routed_experts: row {row} layer {layer} repeats an expert: {experts}"
    return None


def first_repeat_reference(routes: np.ndarray) -> tuple[int, int] | None:
    """(row, layer) of the first non-zero [top_k] row holding a repeated id, by sets."""
    flat = routes.reshape(-1, routes.shape[2]).tolist()
    for index, experts in enumerate(flat):
        if any(experts) and len(set(experts)) < len(experts):
            return divmod(index, routes.shape[1])
    return None


@settings(max_examples=120, deadline=None)
@given(
    rows=st.integers(0, 9),
    layers=st.integers(1, 3),
    top_k=st.sampled_from([1, 2, 3, 4, 5, 6, 8, 10, 16]),
    dtype=st.sampled_from(["<u1", "<i2", "<i4", "<i8", ">i4", "<u2"]),
    num_experts=st.sampled_from([None, 6, 16, 128, 129, 255, 256, 300, 32_768, 40_000]),
    block=st.sampled_from([1, 2, 5, 1 << 15]),
    seed=st.integers(0, 2**16),
    edits=st.lists(st.sampled_from(["repeat", "zero", "negative", "large", "big_negative"]), max_size=3),
    check_unique=st.booleans(),
)
def test_validation_matches_a_naive_reference(
    rows, layers, top_k, dtype, num_experts, block, seed, edits, check_unique
):
    rng = np.random.default_rng(seed)
    routes = distinct_routes(rows, layers, top_k, max(6, top_k), seed).astype(dtype)
    info = np.iinfo(routes.dtype)
    for edit in edits if routes.size else []:
        row, layer = rng.integers(rows), rng.integers(layers)
        lane = rng.integers(top_k)
        if edit == "repeat" and top_k > 1:
            routes[row, layer, (lane + 1) % top_k] = routes[row, layer, lane]
        elif edit == "zero":
            routes[row, layer] = 0  # dense-layer filler: allowed
        elif edit == "negative" and info.min < 0:
            routes[row, layer, lane] = -1
        elif edit == "big_negative" and info.min < 0:  # unsigned image below 40_000 for int16
            routes[row, layer, lane] = max(info.min, -30_000)
        elif edit == "large":
            routes[row, layer, lane] = min(info.max, 35_000)
    before = routes.copy()
    expected = naive_validation_error(routes, num_experts, check_unique)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(route_check, "_UNIQUE_BLOCK", block)
        for view in (routes, routes[:, ::-1]):  # contiguous (kernel) and strided (numpy) inputs
            want = expected if view is routes else naive_validation_error(view, num_experts, check_unique)
            if want is None:
                validate_routes(view, num_experts=num_experts, check_unique=check_unique)
            else:
                with pytest.raises(MalformedResponseError) as caught:
                    validate_routes(view, num_experts=num_experts, check_unique=check_unique)
                assert str(caught.value) == want
    np.testing.assert_array_equal(routes, before)  # never modified


def test_negative_ids_are_found_whatever_num_experts_is():
    routes = np.array([[[1, 2]], [[3, -30_000]]], dtype=np.int16)  # unsigned image: 35536
    with pytest.raises(MalformedResponseError, match="expert id -30000 is negative"):
        validate_routes(routes, num_experts=40_000)
    with pytest.raises(MalformedResponseError, match="expert id -30000 is negative"):
        validate_routes(routes)
    readonly = np.array([[[5, 5]]], dtype=np.int32)
    readonly.flags.writeable = False
    with pytest.raises(MalformedResponseError, match=r"row 0 layer 0 repeats an expert: \[5, 5\]"):
        validate_routes(readonly, num_experts=6)


def test_first_repeat_is_reported_across_blocks(monkeypatch):
    monkeypatch.setattr(route_check, "_UNIQUE_BLOCK", 4)
    routes = distinct_routes(7, 2, 3, 10, seed=5)  # 14 [top_k] rows: blocks of 4
    routes[1, 0] = 0  # filler, first block
    routes[4, 1] = 0  # filler, third block (flat rows 8-11)
    routes[5, 0] = [7, 1, 7]  # flat row 10: the first repeat
    routes[5, 1] = [2, 2, 3]  # flat row 11, same block
    routes[6, 0] = [4, 4, 3]  # flat row 12, next block
    for layout in (np.asfortranarray(routes), routes):  # numpy (not C-ordered), the pairwise kernel
        with pytest.raises(MalformedResponseError, match=r"row 5 layer 0 repeats an expert: \[7, 1, 7\]"):
            validate_routes(layout)


# ------------------------------------------------------------------ the compiled kernels at scale

KERNEL_DTYPES = ["<u1", "<u2", "<i2", "<i4"]
KERNEL_TOP_K = [2, 4, 8, 16]  # power-of-two: the vector and SWAR kernels
ANY_TOP_K = [2, 3, 4, 6, 8, 10, 16]  # 3, 6 and 10: the pairwise kernel's
ROWS, LAYERS = 700, 5  # 3500 [top_k] rows: several kernel blocks and a ragged last one


def kernel_routes(dtype: str, top_k: int, num_experts: int, seed: int) -> np.ndarray:
    """Distinct ids per row drawn from [0, num_experts) (high ids included), a third of the rows
    all-zero dense filler."""
    rng = np.random.default_rng(seed)
    pool = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(97)])
    routes = pool[rng.integers(0, len(pool), (ROWS, LAYERS))].astype(dtype)
    routes[rng.random((ROWS, LAYERS)) < 0.3] = 0
    return routes


@pytest.mark.parametrize("top_k", KERNEL_TOP_K)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_kernel_covers_the_layout(dtype, top_k):
    routes = kernel_routes(dtype, top_k, 64, seed=0)
    layout = route_kernels.word_layout(routes)
    row_bytes = top_k * np.dtype(dtype).itemsize
    assert layout == (
        min(row_bytes, 8),
        min(row_bytes, 8) // np.dtype(dtype).itemsize,
        max(1, row_bytes // 8),
    )
    assert route_kernels.word_layout(routes[:, ::-1]) is None  # strided: numpy
    odd = np.concatenate([routes, routes[..., :1]], axis=-1)  # top_k + 1: not a power of two
    assert route_kernels.word_layout(odd) is None


@pytest.mark.parametrize("top_k", KERNEL_TOP_K)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_vector_kernel_takes_rows_of_8_to_64_bytes(dtype, top_k):
    routes = kernel_routes(dtype, top_k, 64, seed=0)
    assert route_kernels.vector_covers(routes) == (8 <= top_k * np.dtype(dtype).itemsize <= 64)
    odd = np.concatenate([routes, routes[..., :1]], axis=-1)  # top_k + 1: not a power of two
    assert not route_kernels.vector_covers(odd)


def test_numpy_checks_what_no_kernel_covers():
    routes = kernel_routes("<u1", 16, 64, seed=0)
    check = route_kernels.compiled_check
    assert check(routes, 64, range_check=True, unique=True) is not None  # the vector kernel
    assert check(routes[..., :10], 64, range_check=True, unique=True) is None  # strided
    wide = np.concatenate([routes, routes[..., :1]], axis=-1)  # top_k 17: too many pairs
    assert check(wide, 64, range_check=True, unique=True) is None
    assert check(np.ascontiguousarray(routes[..., :10]), 64, range_check=True, unique=True) is not None


@pytest.mark.parametrize("top_k", ANY_TOP_K)
@pytest.mark.parametrize("dtype", [*KERNEL_DTYPES, "<i8"])
def test_kernel_reports_the_first_repeat_wherever_it_is(dtype, top_k):
    info = np.iinfo(np.dtype(dtype))
    num_experts = int(min(info.max, 300))
    rng = np.random.default_rng(top_k)
    for trial in range(6):
        routes = kernel_routes(dtype, top_k, num_experts, seed=trial)
        validate_routes(routes, num_experts=num_experts)  # distinct and zero rows: valid
        # the kernel's own flag is exact: a false alarm would only cost a numpy pass
        assert route_kernels.compiled_check(routes, num_experts, range_check=True, unique=True) == (-1, False)
        repeats = []
        for _ in range(rng.integers(1, 4)):
            row, layer = int(rng.integers(ROWS)), int(rng.integers(LAYERS))
            a, b = rng.choice(top_k, 2, replace=False)
            if not routes[row, layer].any():
                routes[row, layer] = np.arange(1, top_k + 1)
            routes[row, layer, b] = routes[row, layer, a]
            repeats.append((row, layer))
        row, layer = first_repeat_reference(routes)
        assert (row, layer) == min(repeats)
        first_block = (row * LAYERS + layer) // route_kernels.KERNEL_BLOCK * route_kernels.KERNEL_BLOCK
        assert (
            route_kernels.compiled_check(routes, num_experts, range_check=True, unique=True)[0] == first_block
        )
        message = f"row {row} layer {layer} repeats an expert: {routes[row, layer].tolist()}"
        with pytest.raises(MalformedResponseError) as caught:
            validate_routes(routes, num_experts=num_experts)
        assert str(caught.value) == f"routed_experts: {message}"
        with pytest.raises(MalformedResponseError, match=message.replace("[", r"\[")):
            check_unique_rows(routes, "routed_experts")


def range_limits(dtype: str) -> list[int | None]:
    bits = 8 * np.dtype(dtype).itemsize
    edges = [1, 2, 8, 16, 127, 128, 129, 255, 256, 32_767, 32_768, 32_769, 65_535, 65_536, 70_000, None]
    return [e for e in edges if e is None or e <= 1 << bits]


@pytest.mark.parametrize("top_k", [2, 3, 8, 10])
@pytest.mark.parametrize("dtype", [*KERNEL_DTYPES, "<i8"])
def test_kernel_range_check_at_every_edge(dtype, top_k):
    """Every num_experts edge (half and full lane range, one either side) with the largest id
    just inside and just outside, and negative ids for signed dtypes."""
    info = np.iinfo(np.dtype(dtype))
    for num_experts in range_limits(dtype):
        top = int(info.max) if num_experts is None else min(num_experts, int(info.max) + 1)
        for bad_id in {top - 1, top, info.max, info.min, -1, 0}:
            if not info.min <= bad_id <= info.max:
                continue
            routes = np.zeros((40, 3, top_k), dtype=dtype)
            routes[..., :] = np.arange(1, top_k + 1) % max(2, min(top, top_k + 1))
            routes[17, 2] = np.arange(top_k)
            routes[17, 2, top_k - 1] = bad_id
            if len(set(routes[17, 2].tolist())) < top_k:
                routes[17, 2, 0] = (bad_id + 1) % (top + 1) if bad_id != 1 else 2
            for row in range(40):  # keep every other row distinct whatever top is
                for layer in range(3):
                    if (row, layer) != (17, 2):
                        routes[row, layer] = 0
            want = naive_validation_error(routes, num_experts)
            # the kernel's own flag, exact both ways (a false alarm costs a numpy pass)
            for unique in (True, False):  # with the distinct-experts test and without
                checked = route_kernels.compiled_check(routes, num_experts, range_check=True, unique=unique)
                flagged = checked[1]
                assert flagged == (want is not None and "repeats" not in want), (num_experts, bad_id)
            if want is None:
                validate_routes(routes, num_experts=num_experts)
            else:
                with pytest.raises(MalformedResponseError) as caught:
                    validate_routes(routes, num_experts=num_experts)
                assert str(caught.value) == want, (num_experts, bad_id)


def test_all_zero_rows_are_exempt_but_a_zero_repeat_is_not():
    routes = np.zeros((3000, 2, 8), dtype=np.uint8)
    validate_routes(routes, num_experts=1)
    routes[2500, 1] = [0, 0, 0, 0, 0, 0, 0, 9]  # dense filler does not hold a 9: a real repeat of 0
    with pytest.raises(MalformedResponseError, match=r"row 2500 layer 1 repeats an expert"):
        validate_routes(routes, num_experts=10)
    with pytest.raises(MalformedResponseError, match="expert id 9 is out of range for num_experts=9"):
        validate_routes(routes, num_experts=9)  # range is reported before repeats


def test_a_bad_id_after_the_first_repeat_is_reported_first():
    """The kernel stops at the first block with a repeat; the range error later on still wins,
    as in the numpy order (range first)."""
    routes = kernel_routes("<u1", 8, 100, seed=3)
    routes[0, 0] = [1, 1, 2, 3, 4, 5, 6, 7]
    routes[ROWS - 1, LAYERS - 1, 3] = 200
    with pytest.raises(MalformedResponseError, match="expert id 200 is out of range for num_experts=100"):
        validate_routes(routes, num_experts=100)


VECTOR_LAYOUTS = [
    ("<u1", 8),
    ("<u2", 4),
    ("<i4", 2),
    ("<u1", 16),
    ("<i2", 8),
    ("<i4", 8),
    ("<u1", 64),
    ("<i4", 16),
]


@pytest.mark.parametrize(("dtype", "top_k"), VECTOR_LAYOUTS)
def test_vector_kernel_checks_the_rows_past_the_last_full_vector(dtype, top_k):
    """Rows go through 64-byte vectors; the last few rows are checked padded with exempt
    all-zero rows, and a repeat there is flagged in its block."""
    for rows in (1, 7, 8 * 130 + 5, 8 * 387 + 7):  # fewer than a vector; tails inside a later block
        routes = kernel_routes(dtype, top_k, 100, seed=rows)[: rows // LAYERS + 1].reshape(-1, 1, top_k)[
            :rows
        ]
        routes = np.ascontiguousarray(routes)
        routes[-1] = np.arange(1, top_k + 1)
        assert route_kernels.compiled_check(routes, 100, range_check=True, unique=True) == (-1, False)
        for last in range(max(0, rows - 7), rows):
            bad = routes.copy()
            bad[last, 0] = np.arange(1, top_k + 1)
            bad[last, 0, top_k - 1] = 1
            first = last // route_kernels.KERNEL_BLOCK * route_kernels.KERNEL_BLOCK
            assert route_kernels.compiled_check(bad, 100, range_check=True, unique=True) == (first, False)
            bad[last, 0, top_k - 1] = 100  # out of range instead of a repeat
            assert route_kernels.compiled_check(bad, 100, range_check=True, unique=True) == (-1, True)


@pytest.mark.parametrize(
    ("dtype", "top_k"), [(d, k) for d, k in VECTOR_LAYOUTS if k * np.dtype(d).itemsize > 8]
)
def test_vector_kernel_exempts_whole_zero_rows_only(dtype, top_k):
    """A row of several 64-bit words is dense filler only when every word is zero: zeros
    filling one word of a row are a repeat (of expert 0)."""
    routes = kernel_routes(dtype, top_k, 100, seed=1)
    assert route_kernels.compiled_check(routes, 100, range_check=True, unique=True) == (-1, False)
    lanes_per_word = 8 // np.dtype(dtype).itemsize
    words = [(w * lanes_per_word, (w + 1) * lanes_per_word) for w in range(top_k // lanes_per_word)]
    zeroed = [*words, (0, top_k // 2), (top_k // 2, top_k)]  # each word, and each half of the row
    for low, high in zeroed:
        for row, layer in ((0, 0), (ROWS // 2, 3), (ROWS - 1, LAYERS - 1)):
            bad = routes.copy()
            bad[row, layer] = np.arange(1, top_k + 1)
            bad[row, layer, low:high] = 0
            flat = row * LAYERS + layer
            first = flat // route_kernels.KERNEL_BLOCK * route_kernels.KERNEL_BLOCK
            assert route_kernels.compiled_check(bad, 100, range_check=True, unique=True) == (first, False)
