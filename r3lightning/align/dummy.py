"""Placeholder routes for token positions without a captured route, which still need a valid one."""

from __future__ import annotations

import torch

from r3lightning.checks import check_int
from r3lightning.routes import compact_route_dtype

__all__ = ["dummy_routes"]


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
