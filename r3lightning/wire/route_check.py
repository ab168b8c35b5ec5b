"""Route validation: expert ids in range and distinct within each ``[top_k]`` row.

Decoded routes ``[rows, num_layers, top_k]`` are checked once, on the client, before they enter
the replay buffer. A compiled kernel (:mod:`.route_kernels`, one per row layout) checks range
and distinctness in one pass without the GIL and without a copy: about 0.5 ms on one core for
32k x 48 x 8 uint8 ids. Layouts no kernel covers (strided or big-endian arrays, ``top_k`` above
16) use numpy: a cache-blocked transpose and ``top_k*(top_k-1)/2`` contiguous comparisons
(about 10 ms for 32k x 48 x 8). numpy also finds the exact row or id behind a kernel's flag,
for the message. Splitting a check across threads did not pay on 2 cores.

Where the client decoded a payload with this check fused into the decode
(:mod:`.route_decode`), the wire decoders call only :func:`check_shape`.

All-zero rows (the filler of a dense layer) are exempt from the distinct-experts rule; errors
are :class:`MalformedResponseError` naming the field, the row and the layer.
"""

from __future__ import annotations

import numpy as np

from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.route_kernels import KERNEL_BLOCK, compiled_check

__all__ = ["check_range", "check_shape", "check_unique_rows", "validate_routes"]

# Rows per block of the numpy distinct-experts check: a block's columns ([top_k, block] in the
# wire dtype) and its pairwise comparisons ([top_k*(top_k-1)/2, block] bools) stay in L2 cache.
_UNIQUE_BLOCK = 1 << 15


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
    checks range and distinctness together: about 0.5 ms on one core for 32k x 48 x 8 uint8
    ids, 1.3 ms for int16); layouts no kernel covers use numpy (about 10 ms). The first call for
    a new row layout compiles its kernel (about 0.3 s). Never modifies ``routes``.
    """
    check_shape(routes, num_layers, top_k, field)
    if routes.size == 0:
        return
    unique = check_unique and routes.shape[2] > 1
    if (compiled := compiled_check(routes, num_experts, range_check=True, unique=unique)) is not None:
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


def check_shape(routes: np.ndarray, num_layers: int | None, top_k: int | None, field: str) -> None:
    """``routes`` must be ``[rows, num_layers, top_k]`` (``None`` takes any size on that axis)."""
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
    if (compiled := compiled_check(routes, None, range_check=False, unique=True)) is not None:
        _raise_first_repeat(routes, compiled[0], field)
    else:
        _raise_first_repeat(routes, 0, field, block=routes.size)


def _raise_first_repeat(routes: np.ndarray, first: int, field: str, block: int = KERNEL_BLOCK) -> None:
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
