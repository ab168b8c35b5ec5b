"""Route validation: expert ids in range and distinct within each ``[top_k]`` row.

Decoded routes ``[rows, num_layers, top_k]`` are checked once, on the client, before they enter
the replay buffer. Three implementations of the one check, the first that covers the routes:

- a SWAR kernel (numba, built lazily per row layout) for power-of-two ``top_k`` of native-order
  1, 2 or 4-byte ids. A row is read as one to eight machine words whose lanes are its ids:
  xoring a word with its own rotations by whole lanes puts every pair of ids of the row side by
  side, and a zero lane in the xor, found with the classic ``(y - 0x01..) & ~y & 0x80..`` test,
  is a repeat. The range test is fused into the same pass with one add per word. Cost: one pass
  over the routes without the GIL, no copy: about 0.65 ms on one core for 32k x 48 x 8 uint8
  ids (1.3 ms for int16), 0.2 ms for the range alone. Splitting it across threads did not pay
  on 2 cores (the routes were just decoded: the pass is bound by memory);
- a pairwise kernel for any other ``top_k`` up to 16 (DeepSeek-V2's 6, Qwen3-Next's 10) and
  8-byte ids: each pair of a row's ids compared directly, unrolled (0.5 ms for top-6 uint8 ids,
  4 ms for top-10);
- numpy for the rest (strided or big-endian arrays, ``top_k`` above 16): a cache-blocked
  transpose and ``top_k*(top_k-1)/2`` contiguous comparisons (about 10 ms for 32k x 48 x 8).

Both exempt all-zero rows (the filler of a dense layer) from the distinct-experts rule and raise
:class:`MalformedResponseError` naming the field, the row and the layer.
"""

from __future__ import annotations

import functools

import numpy as np

from .errors import MalformedResponseError

__all__ = ["validate_routes"]

# Rows per block of the numpy distinct-experts check: a block's columns ([top_k, block] in the
# wire dtype) and its pairwise comparisons ([top_k*(top_k-1)/2, block] bools) stay in L2 cache.
_UNIQUE_BLOCK = 1 << 15
# Rows per block of the compiled kernel: it reports the first block with a repeat, which numpy
# then searches for the exact row (only on the error path).
_KERNEL_BLOCK = 1 << 10


def validate_routes(
    routes: np.ndarray,
    *,
    num_experts: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    check_unique: bool = True,
    field: str = "routed_experts",
) -> None:
    """Check a route array ``[rows, num_layers, top_k]``; raise ``MalformedResponseError`` if bad.

    Ids must be non-negative and, when ``num_experts`` is given, below it. With ``check_unique``
    the ``top_k`` ids of a row must be distinct (dispatch assumes it); an all-zero row is the
    filler of a dense layer and is allowed. Cost: one pass over the routes (the compiled kernel
    checks range and distinctness together: about 0.65 ms on one core for 32k x 48 x 8 uint8
    ids, 1.3 ms for int16); layouts no kernel covers use numpy (about 10 ms). The first call for
    a new row layout compiles its kernel (about 0.3 s). Never modifies ``routes``.
    """
    if routes.ndim != 3:
        raise MalformedResponseError(
            f"{field}: expected shape [rows, num_layers, top_k], got {list(routes.shape)}"
        )
    for axis, expected, name in ((1, num_layers, "num_layers"), (2, top_k, "top_k")):
        if expected is not None and routes.shape[axis] != expected:
            raise MalformedResponseError(
                f"{field}: shape {list(routes.shape)} has {routes.shape[axis]} on axis {axis}, "
                f"expected {name}={expected}"
            )
    if routes.size == 0:
        return
    unique = check_unique and routes.shape[2] > 1
    if (compiled := _compiled_check(routes, num_experts, range_check=True, unique=unique)) is not None:
        first_block, out_of_range = compiled
        if out_of_range or first_block >= 0:
            # the kernel stops at the first repeat: a bad id anywhere is reported first, as numpy
            # does, with the exact min or max
            check_range(routes, num_experts, field)
        _raise_first_repeat(routes, first_block, field)
        return
    check_range(routes, num_experts, field)
    if unique:
        _raise_first_repeat(routes, 0, field, block=routes.size)


def check_range(routes: np.ndarray, num_experts: int | None, field: str) -> int | None:
    """Ids must be non-negative and below ``num_experts``; one pass over a non-empty ``routes``
    when they are. Returns the largest id when that pass computed it (else None).

    Signed ids are viewed as unsigned of the same width, where a negative id is at least
    ``2**(bits-1)``: a single max then bounds both ends. The exact min/max (for the message) are
    only computed once a bad id is known to exist.
    """
    signed = routes.dtype.kind == "i"
    if signed:
        bound = 1 << (8 * routes.dtype.itemsize - 1)  # unsigned images of negatives are >= this
        limit = bound if num_experts is None else min(num_experts, bound)
        as_unsigned = routes.view(routes.dtype.str.replace("i", "u"))
        if (high := int(as_unsigned.max())) < limit:
            return high
    elif num_experts is None:
        return None
    if signed and (low := int(routes.min())) < 0:
        raise MalformedResponseError(f"{field}: expert id {low} is negative")
    high = int(routes.max())
    if num_experts is not None and high >= num_experts:
        raise MalformedResponseError(
            f"{field}: expert id {high} is out of range for num_experts={num_experts}"
        )
    return high


def check_unique_rows(routes: np.ndarray, field: str) -> None:
    """Raise for the first ``[top_k]`` row of ``routes`` ``[rows, L, K]`` that repeats an expert
    (all-zero rows exempt). Uses a compiled kernel where the layout allows, else numpy."""
    if routes.size == 0 or routes.shape[2] < 2:
        return
    if (compiled := _compiled_check(routes, None, range_check=False, unique=True)) is not None:
        _raise_first_repeat(routes, compiled[0], field)
    else:
        _raise_first_repeat(routes, 0, field, block=routes.size)


def _raise_first_repeat(routes: np.ndarray, first: int, field: str, block: int = _KERNEL_BLOCK) -> None:
    """Raise for the first repeating ``[top_k]`` row among the ``block`` flat rows from
    ``first`` (a kernel's flagged block, or every row), found by numpy; nothing if ``first`` < 0
    or no row repeats."""
    if first < 0:
        return
    index = _first_repeat(routes.reshape(-1, routes.shape[2])[first : first + block])
    if index < 0:
        return
    row, layer = divmod(first + index, routes.shape[1])
    raise MalformedResponseError(
        f"{field}: row {row} layer {layer} repeats an expert: {routes[row, layer].tolist()}"
    )


def _first_repeat(routes: np.ndarray) -> int:
    """Flat ``row * num_layers + layer`` index of the first ``[top_k]`` row repeating an expert,
    or -1. All-zero rows do not count.

    Works block by block: each block of rows is transposed into contiguous columns (the dominant
    cost, one strided copy) and every column is compared with the columns after it in one
    broadcast call, all within cache.
    """
    k = routes.shape[-1]
    rows = routes.reshape(-1, k)  # [rows*layers, top_k]
    block = min(_UNIQUE_BLOCK, rows.shape[0])
    columns = np.empty((k, block), dtype=rows.dtype)  # [top_k, block]
    pairs = np.empty((k * (k - 1) // 2, block), dtype=bool)  # [pair, block]
    for first in range(0, rows.shape[0], block):
        chunk = rows[first : first + block]
        n = chunk.shape[0]
        cols, equal = columns[:, :n], pairs[:, :n]
        np.copyto(cols, chunk.T)
        offset = 0
        for i in range(k - 1):
            np.equal(cols[i + 1 :], cols[i], out=equal[offset : offset + k - 1 - i])
            offset += k - 1 - i
        repeated = np.logical_or.reduce(equal, axis=0)  # [block]
        if repeated.any():
            repeated &= cols.any(axis=0)
            if repeated.any():
                return first + int(np.flatnonzero(repeated)[0])
    return -1


# --------------------------------------------------------------------------- compiled kernels

# Largest top_k the pairwise kernel unrolls (top_k*(top_k-1)/2 comparisons per row).
_PAIRWISE_MAX_TOP_K = 16


def _compiled_check(
    routes: np.ndarray, num_experts: int | None, *, range_check: bool, unique: bool
) -> tuple[int, bool] | None:
    """``(first flat row of the first block with a repeat or -1, whether an id is out of range)``
    from a compiled kernel, or None when neither covers ``routes`` (numpy then checks it): the
    SWAR kernel for power-of-two ``top_k``, the pairwise one for other ``top_k`` up to 16."""
    if routes.dtype.kind not in "iu" or not routes.dtype.isnative or not routes.flags.c_contiguous:
        return None  # numba takes native byte order only; the SWAR words need C order
    if (layout := _word_layout(routes)) is not None:
        return _run_kernel(routes, layout, num_experts, range_check=range_check, unique=unique)
    top_k = routes.shape[2]
    if top_k > _PAIRWISE_MAX_TOP_K:
        return None
    info = np.iinfo(routes.dtype)
    limit = num_experts if range_check and num_experts is not None and num_experts <= info.max else None
    signed = range_check and routes.dtype.kind == "i"
    kernel = _compiled_pairwise(top_k, limit is not None, signed, unique)
    first_block, bad = kernel(routes.reshape(-1), routes.dtype.type(limit or 0))
    return int(first_block), bool(bad)


@functools.cache
def _compiled_pairwise(top_k: int, has_limit: bool, signed: bool, unique: bool):
    """The kernel for any ``top_k``: every pair of a row's ids compared directly (LLVM unrolls
    the pairs and vectorises across rows: about 0.55 ms for 32k x 48 x 6 uint8 ids, 4.4 ms for
    top-10, against 8 and 13 ms in numpy). Ids are flagged when negative (``signed``) or at least
    ``limit`` (``has_limit``); numba specialises it per dtype on first call."""
    import numba

    u64 = np.uint64
    width, block = u64(top_k), u64(_KERNEL_BLOCK)

    @numba.njit(nogil=True, cache=False)
    def kernel(flat, limit):  # flat: [rows * top_k] ids; unsigned indices, as in the SWAR kernel
        n = u64(flat.shape[0]) // width
        bad = False
        start = u64(0)
        while start < n:
            stop = min(start + block, n)
            repeats = False
            for r in range(start, stop):
                base = r * width
                nonzero = False
                hits = False
                for i in range(top_k):
                    x = flat[base + u64(i)]
                    nonzero |= x != 0
                    if signed:
                        bad |= x < 0
                    if has_limit:
                        bad |= x >= limit
                    if unique:
                        for j in range(i + 1, top_k):
                            hits |= x == flat[base + u64(j)]
                repeats |= hits & nonzero  # all-zero rows (dense-layer filler) are exempt
            if repeats:
                return np.int64(start), bad
            start = stop
        return np.int64(-1), bad

    return kernel


def _word_layout(routes: np.ndarray) -> tuple[int, int, int] | None:
    """``(word_bytes, lanes per word, words per row)`` when the kernel covers ``routes``: a
    C-contiguous array of native-order 1, 2 or 4-byte ids whose ``top_k`` is a power of two with rows of at
    most 64 bytes. Rows up to 8 bytes are one word; longer rows are 2, 4 or 8 uint64 words."""
    k, size = routes.shape[2], routes.dtype.itemsize
    if routes.dtype.kind not in "iu" or not routes.dtype.isnative or size not in (1, 2, 4) or k & (k - 1):
        return None
    if not routes.flags.c_contiguous or k * size > 64:
        return None
    row_bytes = k * size
    word = min(row_bytes, 8)
    return word, word // size, row_bytes // word


# Range tests the kernel is compiled with (see _range_test)
_NO_RANGE, _RANGE_LOW, _RANGE_HIGH = 0, 1, 2


def _range_test(routes: np.ndarray, num_experts: int | None) -> tuple[int, int]:
    """``(test, add)``: how the kernel flags the lanes holding an id outside ``[0, num_experts)``,
    with ``t = (x & ~H) + add`` per word (H: each lane's top bit, ``add`` repeated per lane).

    ``_RANGE_LOW``, for ``E = num_experts`` no larger than half the lane range: ``add =
    2**(b-1) - E`` and the flag is ``(t | x) & H``: the low bits plus ``add`` reach the top bit
    exactly when they are ``>= E``, and a set top bit (a negative id, or one >= half the range)
    is bad anyway. ``_RANGE_HIGH``, for a larger E (unsigned ids only): ``add = 2**b - E`` and
    the flag is ``t & x & H``: only lanes with the top bit set can be bad, and they are when
    their low bits reach ``E - 2**(b-1)``. Neither sum carries into the next lane."""
    bits = 8 * routes.dtype.itemsize
    half = 1 << (bits - 1)
    limit = num_experts if num_experts is not None else 1 << bits
    if routes.dtype.kind == "i":
        limit = min(limit, half)  # a negative id has the top bit set
    if limit >= 1 << bits:
        return _NO_RANGE, 0  # every unsigned id is in range
    if limit <= half:
        return _RANGE_LOW, half - limit
    return _RANGE_HIGH, (1 << bits) - limit


def _run_kernel(
    routes: np.ndarray,
    layout: tuple[int, int, int],
    num_experts: int | None,
    *,
    range_check: bool = True,
    unique: bool = True,
) -> tuple[int, bool]:
    """``(first flat row of the first block with a repeat or -1, whether an id is out of range)``;
    ``unique=False`` checks the range only (the first value is then -1)."""
    word, lanes, words = layout
    test, add = _range_test(routes, num_experts) if range_check else (_NO_RANGE, 0)
    lane_bits = 8 * word // lanes
    spread = sum(1 << (i * lane_bits) for i in range(lanes))  # 1 in every lane
    add = np.uint64(add * spread)
    view = routes.reshape(-1).view(f"=u{word}")  # [rows * words]
    first_block, bad = _compiled_kernel(8 * word, lanes, words, test, unique)(view, add)
    return int(first_block), bool(bad)


@functools.cache
def _compiled_kernel(word_bits: int, lanes: int, words: int, range_test: int, unique: bool):
    """The kernel for rows of ``words`` words of ``word_bits`` bits, ``lanes`` ids per word, one
    of the range tests of :func:`_range_test`, and the distinct-experts test if ``unique``.

    Everything that depends on the layout is a closure constant, so numba specialises the
    rotations and LLVM unrolls the lane loops and vectorises across rows. Numba is imported
    here: a process that never validates routes never loads it."""
    import numba

    u64 = np.uint64
    lane_bits = word_bits // lanes
    full = u64((1 << word_bits) - 1)
    low = u64(sum(1 << (i * lane_bits) for i in range(lanes)))  # 1 in every lane
    high = u64(int(low) << (lane_bits - 1))  # top bit of every lane
    not_high = u64(int(full) & ~int(high))
    zero = u64(0)
    # a word against itself: rotations by 1 .. lanes/2 lanes pair every two of its ids
    inner = tuple(u64(r * lane_bits) for r in range(1, lanes // 2 + 1))
    inner_back = tuple(u64(word_bits - int(s)) for s in inner)
    # a word against a later word of the row: rotations by 0 .. lanes-1 lanes
    cross = tuple(u64(r * lane_bits) for r in range(1, lanes))
    cross_back = tuple(u64(word_bits - int(s)) for s in cross)
    if not unique:  # no pairs to compare: the loops below compile away
        inner, inner_back, cross, cross_back = (u64(0),), (u64(0),), (u64(0),), (u64(0),)
    n_inner, n_cross = (len(inner), len(cross)) if unique else (0, 0)
    block, width, pairs_across = u64(_KERNEL_BLOCK), u64(words), words if unique else 1

    @numba.njit(nogil=True, cache=False)
    def kernel(view, add):  # view: [rows * words] unsigned words
        # unsigned indices: numba then emits no negative-index wraparound, which would turn the
        # loads into gathers and stop LLVM from vectorising across rows
        n = u64(view.shape[0]) // width
        bad = zero  # only the lanes' top bits count (masked once, at the end)
        start = zero
        while start < n:
            stop = min(start + block, n)
            repeats = zero
            for r in range(start, stop):
                base = r * width
                nonzero = zero
                hits = zero  # a lane whose top bit ends up set held a zero xor: a repeat
                for i in range(words):
                    x = u64(view[base + u64(i)])
                    nonzero |= x
                    if range_test == 1:
                        bad |= ((x & not_high) + add) | x
                    elif range_test == 2:
                        bad |= ((x & not_high) + add) & x
                    for j in range(n_inner):
                        y = x ^ (((x << inner[j]) | (x >> inner_back[j])) & full)
                        hits |= (y - low) & ~y
                    for i2 in range(i + 1, pairs_across):
                        x2 = u64(view[base + u64(i2)])
                        y = x ^ x2
                        hits |= (y - low) & ~y
                        for j in range(n_cross):
                            y = x ^ (((x2 << cross[j]) | (x2 >> cross_back[j])) & full)
                            hits |= (y - low) & ~y
                if nonzero != zero:  # all-zero rows (dense-layer filler) are exempt
                    repeats |= hits
            if repeats & high != zero:
                return np.int64(start), bad & high != zero
            start = stop
        return np.int64(-1), bad & high != zero

    return kernel
