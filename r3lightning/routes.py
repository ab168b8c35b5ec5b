"""Route dtypes and route layer ids: routes live on the host and the wire in the smallest of
uint8 / int16 / int32 that holds the largest expert id, widened to what a router needs at install.
The wire also carries vLLM's uint16, decoded to int16 as torch's uint16 lacks most operations."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

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
    """Smallest dtype that holds ids ``0..max_id``: uint8, int16, int32 (``signed``: int8, int16,
    int32, which also hold `MISSING_ROUTE_ID`)."""
    for dtype in _SIGNED_COMPACT_DTYPES if signed else _COMPACT_DTYPES:
        if max_id <= np.iinfo(dtype).max:
            return dtype
    raise ValueError(f"expert id {max_id} does not fit in int32")


def compact_route_dtype(max_expert_id: int, *, signed: bool = False) -> torch.dtype:
    """`compact_dtype` as a torch dtype: uint8 up to 255, int16 up to 32767, int32 above
    (``signed``: int8 up to 127)."""
    if isinstance(max_expert_id, bool) or not isinstance(max_expert_id, int) or max_expert_id < 0:
        raise ValueError(f"max_expert_id must be a non-negative int, got {max_expert_id!r}")
    import torch

    return torch.from_numpy(np.empty(0, dtype=compact_dtype(max_expert_id, signed=signed))).dtype


def compact_routes(routes: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """``routes`` in `compact_route_dtype` of their largest id (signed when some row is
    missing): a ``min``, a ``max``, a cast."""
    if not routes.numel():
        return routes.to(compact_route_dtype(0), copy=copy)
    signed = bool(routes.min() < 0)
    return routes.to(compact_route_dtype(max(int(routes.max()), 0), signed=signed), copy=copy)


def missing_rows(routes: np.ndarray) -> np.ndarray:
    """bool ``[rows]``: route rows ``[rows, L, K]`` holding `MISSING_ROUTE_ID` (any negative id)
    in any slot; all False at no cost for an unsigned dtype."""
    if routes.dtype.kind != "i" or routes.shape[0] == 0:
        return np.zeros(routes.shape[0], dtype=bool)
    return (routes.reshape(routes.shape[0], -1) < 0).any(axis=1)


def mark_missing(routes: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """``routes`` with every id of the ``missing`` rows set to `MISSING_ROUTE_ID`, in a signed
    dtype (a copy when anything changes)."""
    if not missing.any():
        return routes
    high = int(routes.max()) if routes.size else 0
    out = routes.astype(compact_dtype(max(high, 0), signed=True), copy=True)
    out[missing] = MISSING_ROUTE_ID
    return out


def widest_route_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype that holds routes of all ``dtypes`` (at least one): uint8 and int16 -> int16."""
    import torch

    return functools.reduce(torch.promote_types, dtypes)


def check_layers(name: str, layers: Iterable[int] | None) -> tuple[int, ...] | None:
    """``layers`` as a tuple of absolute decoder-layer ids (sorted, unique, ``>= 0``, at least one)
    or None (every layer); else ``ValueError`` naming ``name``."""
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
