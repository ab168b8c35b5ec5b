"""Route dtypes and route layer ids: routes live on the host and the wire in the smallest of
uint8 / int16 / int32 that holds the largest expert id, widened to what a router needs at install.
The wire also carries vLLM's uint16, decoded to int16 as torch's uint16 lacks most operations."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import numpy as np
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
# what routes are compacted to on the host (uint16 is decoded, never produced)
_COMPACT_DTYPES = (WIRE_DTYPES["uint8"], WIRE_DTYPES["int16"], WIRE_DTYPES["int32"])


def compact_dtype(max_id: int) -> np.dtype:
    """Smallest wire dtype (uint8, int16, int32) that holds ids ``0..max_id``."""
    for dtype in _COMPACT_DTYPES:
        if max_id <= np.iinfo(dtype).max:
            return dtype
    raise ValueError(f"expert id {max_id} does not fit in int32")


def compact_route_dtype(max_expert_id: int) -> torch.dtype:
    """:func:`compact_dtype` as a torch dtype: uint8 up to 255, int16 up to 32767, int32 above."""
    if isinstance(max_expert_id, bool) or not isinstance(max_expert_id, int) or max_expert_id < 0:
        raise ValueError(f"max_expert_id must be a non-negative int, got {max_expert_id!r}")
    return torch.from_numpy(np.empty(0, dtype=compact_dtype(max_expert_id))).dtype


def compact_routes(routes: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """``routes`` (ids >= 0) in :func:`compact_route_dtype` of their largest id: a ``max``, a cast."""
    return routes.to(compact_route_dtype(int(routes.max()) if routes.numel() else 0), copy=copy)


def widest_route_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype that holds routes of all ``dtypes`` (at least one): uint8 and int16 -> int16."""
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
