"""The route check that every path creating routes goes through (a parsed response, a user's
``Trajectory``, a restored buffer). Its distinct-experts part costs several base64 decodes of the
same ids, so a parse runs it only on request; every ``Trajectory`` runs it."""

from __future__ import annotations

import numpy as np

from r3lightning.routes import MISSING_ROUTE_ID, missing_rows

__all__ = ["MAX_EXPERT_ID", "check_distinct", "check_routes"]

MAX_EXPERT_ID = 2**31 - 1  # routes are int32 at the widest
# [top_k] rows per block of the distinct check: its columns and pair flags stay in L2 cache
_BLOCK = 1 << 15


def check_routes(
    routes: np.ndarray,
    *,
    num_experts: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    rows: range | None = None,
    rows_rule: str = "",
    distinct: bool = True,
    where: str = "routed_experts",
    error: type[ValueError] = ValueError,
    layers: tuple[int, ...] | None = None,
    missing: bool = False,
) -> int:
    """The route check every path creating routes goes through.

    Args:
        routes: ``[rows, num_layers, top_k]`` integer expert ids.
        num_experts, num_layers, top_k: The model's sizes (None: unknown, unchecked).
        rows: The allowed row counts (None: any).
        rows_rule: How ``rows`` was derived, for the error.
        distinct: Refuse a row that repeats an expert (`check_distinct`; all-zero rows exempt).
        where: The routes' name or path, first in the error.
        error: The exception class raised.
        layers: The absolute layer id of each column, for the error.
        missing: Allow rows holding `MISSING_ROUTE_ID` (-1), exempt from the distinct check; other
            negative ids stay refused.

    Returns:
        The largest id (0 when empty). Cost: one ``max`` over the ids (0.2 ms for 32k x 48 x 8
        uint8); a ``min`` more for signed ids.

    Raises:
        ValueError: ``error``, for a wrong shape, dtype, id or row count.
    """
    shape = list(routes.shape)
    if routes.ndim != 3:
        raise error(f"{where}: expected shape [rows, num_layers, top_k], got {shape}")
    if routes.dtype.kind not in "iu":
        raise error(f"{where}: expected integer expert ids, got dtype {routes.dtype}")
    for axis, expected, name in ((1, num_layers, "num_layers"), (2, top_k, "top_k")):
        if shape[axis] < 1 or (expected is not None and shape[axis] != expected):
            wanted = f"expected {name}={expected}" if expected is not None else f"expected {name} >= 1"
            raise error(f"{where}: shape {shape} has {shape[axis]} on axis {axis}, {wanted}")
    # viewed unsigned, a negative id is at least 2**(bits - 1)
    high = int(routes.view(routes.dtype.str.replace("i", "u")).max()) if routes.size else 0
    absent = None
    if routes.dtype.kind == "i" and high >> (8 * routes.dtype.itemsize - 1):
        low = int(routes.min())
        if not missing or low != MISSING_ROUTE_ID:
            hint = ""
            if low == MISSING_ROUTE_ID:
                hint = " (-1 marks a missing row: allowed with missing_rows native or drop_trajectory)"
            raise error(f"{where}: expert id {low} is negative{hint}")
        high = max(int(routes.max()), 0)
        absent = missing_rows(routes)
    if high >= (num_experts if num_experts is not None else MAX_EXPERT_ID + 1):
        bound = f"num_experts={num_experts}" if num_experts is not None else "int32 (ids < 2**31)"
        raise error(f"{where}: expert id {high} is out of range for {bound}")
    if distinct:
        check_distinct(routes if absent is None else routes[~absent], where, error, layers)
    if rows is not None and shape[0] not in rows:  # after the ids: a bad id is the likelier story
        raise error(f"{where}: {shape[0]} route rows, expected {rows_rule or rows}")
    return high


def check_distinct(
    routes: np.ndarray,
    where: str,
    error: type[ValueError] = ValueError,
    layers: tuple[int, ...] | None = None,
) -> None:
    """Refuses the first ``[top_k]`` row that repeats an expert; all-zero rows (a dense layer's) are
    exempt. Cost: per block of rows a transposing copy and ``K*(K-1)/2`` column comparisons (about
    10 ms for 32k x 48 x 8 uint8 ids).

    Args:
        routes: ``[rows, L, K]`` integer expert ids.
        where: The routes' name, for the error.
        error: The exception class raised.
        layers: The absolute layer id of each column, for the error.

    Raises:
        ValueError: ``error``, naming the row, the layer and its ids.
    """
    k = routes.shape[2]
    if routes.size == 0 or k < 2:
        return
    flat = routes.reshape(-1, k)  # [rows * layers, top_k]
    for first in range(0, flat.shape[0], _BLOCK):
        columns = np.ascontiguousarray(flat[first : first + _BLOCK].T)  # [top_k, block]
        repeated = np.zeros(columns.shape[1], dtype=bool)  # [block]
        for i in range(k - 1):
            repeated |= (columns[i + 1 :] == columns[i]).any(axis=0)
        if repeated.any():
            repeated &= columns.any(axis=0)  # an all-zero row (a dense layer's) repeats 0 but is no repeat
        if repeated.any():
            row, column = divmod(first + int(np.flatnonzero(repeated)[0]), routes.shape[1])
            layer = column if layers is None else layers[column]
            raise error(f"{where}: row {row} layer {layer} repeats an expert: {routes[row, column].tolist()}")
