"""Route dtypes, route layer ids and placeholder routes: routes live on the host and the wire in the
smallest of uint8 / int16 / int32 that holds the largest expert id, widened to what a router needs
at install. The wire also carries vLLM's uint16, decoded to int16 as torch's uint16 lacks most
operations."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from r3lightning.checks import check_int

if TYPE_CHECKING:  # imported where a tensor is made: the job's config checks import this module
    import torch

# the server flag of vLLM, SGLang (and SkyRL's vLLM-backed server) that turns route capture on:
# named by the client's error when routes are missing and by replay's when a batch has none
ENGINE_ROUTES_FLAG = "--enable-return-routed-experts"

# wire name -> little-endian numpy dtype, narrowest first
WIRE_DTYPES: dict[str, np.dtype] = {
    "uint8": np.dtype("<u1"),
    "int16": np.dtype("<i2"),
    "uint16": np.dtype("<u2"),
    "int32": np.dtype("<i4"),
}
# what routes are compacted to on the host (uint16 is decoded, never produced); signed ones when
# rows are marked missing
_COMPACT_DTYPES = (WIRE_DTYPES["uint8"], WIRE_DTYPES["int16"], WIRE_DTYPES["int32"])
_SIGNED_COMPACT_DTYPES = (np.dtype("i1"), WIRE_DTYPES["int16"], WIRE_DTYPES["int32"])
# an id a route row holds (in any slot) when the engine lost that row: the token routes natively
MISSING_ROUTE_ID = -1


def compact_dtype(max_id: int, *, signed: bool = False) -> np.dtype:
    """Smallest numpy dtype that holds expert ids ``0..max_id``.

    Args:
        max_id: The largest expert id, >= 0.
        signed: Choose from int8 / int16 / int32, which also hold `MISSING_ROUTE_ID`, instead of
            uint8 / int16 / int32.

    Returns:
        A little-endian numpy dtype.

    Raises:
        ValueError: ``max_id`` above int32's range.
    """
    for dtype in _SIGNED_COMPACT_DTYPES if signed else _COMPACT_DTYPES:
        if max_id <= np.iinfo(dtype).max:
            return dtype
    raise ValueError(f"expert id {max_id} does not fit in int32")


def compact_route_dtype(max_expert_id: int, *, signed: bool = False) -> torch.dtype:
    """`compact_dtype` as a torch dtype: uint8 up to 255, int16 up to 32767, int32 above.

    Args:
        max_expert_id: The largest expert id, an int >= 0.
        signed: int8 up to 127 instead of uint8, to hold `MISSING_ROUTE_ID`.

    Returns:
        The torch dtype.

    Raises:
        ValueError: ``max_expert_id`` not an int >= 0, or above int32's range.
    """
    if isinstance(max_expert_id, bool) or not isinstance(max_expert_id, int) or max_expert_id < 0:
        raise ValueError(f"max_expert_id must be a non-negative int, got {max_expert_id!r}")
    import torch

    return torch.from_numpy(np.empty(0, dtype=compact_dtype(max_expert_id, signed=signed))).dtype


def compact_routes(routes: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """``routes`` cast to the `compact_route_dtype` of their largest id, signed when some row is
    missing. Costs a ``min``, a ``max`` (a sync each for device routes) and a cast.

    Args:
        routes: Integer ``[rows, L, K]`` expert ids (negative: a missing row).
        copy: Copy even when the dtype is already compact.

    Returns:
        ``routes`` in the compact dtype, same shape and device.
    """
    if not routes.numel():
        return routes.to(compact_route_dtype(0), copy=copy)
    signed = bool(routes.min() < 0)
    return routes.to(compact_route_dtype(max(int(routes.max()), 0), signed=signed), copy=copy)


def missing_rows(routes: np.ndarray) -> np.ndarray:
    """Which route rows the engine lost: rows holding `MISSING_ROUTE_ID` (any negative id) in a slot.

    Args:
        routes: ``[rows, L, K]`` expert ids.

    Returns:
        bool ``[rows]``; all False at no cost for an unsigned dtype.
    """
    if routes.dtype.kind != "i" or routes.shape[0] == 0:
        return np.zeros(routes.shape[0], dtype=bool)
    return (routes.reshape(routes.shape[0], -1) < 0).any(axis=1)


def mark_missing(routes: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """``routes`` with every id of the ``missing`` rows set to `MISSING_ROUTE_ID`.

    Args:
        routes: ``[rows, L, K]`` expert ids.
        missing: bool ``[rows]``.

    Returns:
        ``routes`` itself when nothing is missing, else a copy in the signed compact dtype.
    """
    if not missing.any():
        return routes
    high = int(routes.max()) if routes.size else 0
    out = routes.astype(compact_dtype(max(high, 0), signed=True), copy=True)
    out[missing] = MISSING_ROUTE_ID
    return out


def widest_route_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype that holds routes of all ``dtypes``: uint8 and int16 give int16.

    Args:
        dtypes: At least one torch integer dtype.

    Returns:
        ``torch.promote_types`` folded over ``dtypes``.
    """
    import torch

    return functools.reduce(torch.promote_types, dtypes)


def dummy_routes(
    num_rows: int,
    num_layers: int,
    top_k: int,
    num_experts: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Valid placeholder routes for positions without a captured route.

    Row ``r`` uses experts ``(r * top_k + k) % num_experts`` on every layer: distinct within a row,
    so a router accepts them; the replay mask keeps them from being replayed.

    Args:
        num_rows: Rows to make (0 allowed).
        num_layers: Route columns per row.
        top_k: Experts per row and layer.
        num_experts: Experts of the model (at least ``top_k``).
        dtype: An integer dtype that holds ``num_experts - 1`` (default: the compact one).
        device: Where to make them.

    Returns:
        ``[num_rows, num_layers, top_k]`` in ``dtype`` on ``device``.

    Raises:
        ValueError: A count below its minimum, ``top_k > num_experts``, or a dtype that cannot
            hold the ids.
    """
    import torch

    check_int("num_rows", num_rows, 0)
    check_int("num_layers", num_layers, 1)
    check_int("top_k", top_k, 1)
    check_int("num_experts", num_experts, 1)
    if top_k > num_experts:
        raise ValueError(
            f"top_k ({top_k}) must be <= num_experts ({num_experts}): a row needs top_k distinct experts"
        )
    if dtype is None:
        dtype = compact_route_dtype(num_experts - 1)
    elif dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"dtype must be an integer dtype, got {dtype}")
    elif num_experts - 1 > torch.iinfo(dtype).max:
        raise ValueError(f"dtype {dtype} cannot hold expert id {num_experts - 1}")
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)
    experts = (rows[:, None] * top_k + torch.arange(top_k, device=device)) % num_experts  # [rows, top_k]
    return experts[:, None, :].expand(num_rows, num_layers, top_k).to(dtype).contiguous()


def check_layers(name: str, layers: Iterable[int] | None) -> tuple[int, ...] | None:
    """Validates a selection of decoder layers.

    Args:
        name: The setting's name, for the error.
        layers: Absolute decoder-layer ids (sorted, unique, >= 0, at least one), or None for every
            layer. A mapping or a string is refused.

    Returns:
        ``layers`` as a tuple, or None.

    Raises:
        ValueError: Anything else, naming ``name``.
    """
    if layers is None:
        return None
    # a mapping would give its keys, which may not be what its author meant by the values
    ids = (
        tuple(layers)
        if isinstance(layers, Iterable) and not isinstance(layers, str | bytes | Mapping)
        else ()
    )
    if not ids or any(type(i) is not int or i < 0 for i in ids) or list(ids) != sorted(set(ids)):
        raise ValueError(f"{name} must be None or sorted, unique decoder-layer ids >= 0, got {layers!r}")
    return ids
