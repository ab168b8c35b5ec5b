"""Router replay metrics from on-device counts: the math behind ``router_replay/...``.

Counts are int64 tables ``[4, layers]`` (rows :data:`COUNT_KEYS`) kept on the device where they
were counted; ratios are taken only after summing over forwards, micro-batches and ranks, so
each metric is an exact ratio of sums (<= 1), never a mean of ratios. Nothing here syncs with
the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from r3lightning.ragged import to_device_async
from r3lightning.replay.backend import agreement_hits

__all__ = ["COUNT_KEYS", "comparison_counts", "stats_counts", "step_metrics", "sum_over_ranks"]

# route_rows: rows with a route row (per forward and layer); replayed_rows: those replayed;
# native_hits / used_hits: route experts the router picked natively / the forward used
COUNT_KEYS = ("route_rows", "replayed_rows", "native_hits", "used_hits")
_ROUTE_ROWS, _REPLAYED_ROWS, _NATIVE_HITS, _USED_HITS = range(4)


def stats_counts(stats: dict, top_k: int, device: torch.device) -> Tensor:
    """``[4, len(layers)]`` counts of a replaying backend's ``routing_stats()`` on ``device``.

    Every route row a replaying backend sees is replayed; a backend without ``used_slots``
    replays exactly what it installed (every slot used). Host zeros (nothing counted yet) are
    staged through page-locked memory: never a blocking copy.
    """
    replayed, native = stats["replayed_rows"], stats["agreeing_slots"]
    used = stats.get("used_slots")
    if used is None:
        used = replayed * top_k
    return torch.stack([to_device_async(t, device).long() for t in (replayed, replayed, native, used)])


def comparison_counts(routes: Tensor, mask: Tensor, used: Tensor, layers: Tensor) -> Tensor | None:
    """``[4, len(layers)]`` counts comparing recorded experts with routes nothing replayed.

    ``routes`` ``[*token_shape, L, K]`` and ``mask`` ``[*token_shape]`` (True: a route row), and
    ``used`` ``[*shape, L, K]`` from ``stop_recording`` (several forwards joined along the last
    token axis); ``layers`` int64 MoE layer indices on ``used``'s device. None when ``used`` is
    not whole forwards of ``token_shape`` (a probe of another shape). One ``[..., K, K]``
    comparison on device.
    """
    token_shape = tuple(routes.shape[:-2])
    lead, width = token_shape[:-1], token_shape[-1]
    shape = tuple(used.shape[:-2])
    if shape[:-1] != lead or width == 0 or shape[-1] % width:
        return None
    forwards = shape[-1] // width
    used = used.reshape(*lead, forwards, width, *used.shape[-2:]).movedim(len(lead), 0)
    routes = routes.to(used.device).index_select(-2, layers)  # [*token_shape, L_moe, K]
    keep = mask.to(used.device)[..., None, None]
    hits = (agreement_hits(routes, used.index_select(-2, layers)) & keep).sum(
        dim=(*range(used.dim() - 2), -1)
    )  # [L_moe] over all forwards
    rows = keep.sum().expand(len(layers)) * forwards
    return torch.stack([rows, torch.zeros_like(rows), hits, hits])


def sum_over_ranks(vector: Tensor) -> Tensor:
    """``vector`` summed over all ranks of the default group (in place; one ``all_reduce``, no
    host sync); unchanged without a multi-rank process group."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(vector)
    return vector


def step_metrics(table: Tensor, *, top_k: int, layers: tuple[int, ...] | None) -> dict[str, Tensor]:
    """The step's ratios from counts ``[4, num_layers]`` by absolute layer (float64, on device).

    ``replayed_fraction`` (0 without route rows), ``native_agreement``, ``used_agreement`` and,
    for ``layers``, ``native_agreement/layer_XX`` (NaN without route rows: nothing to compare).
    """
    route_rows = table[_ROUTE_ROWS].sum()
    slots = route_rows * top_k
    metrics = {
        "replayed_fraction": torch.where(
            route_rows > 0, table[_REPLAYED_ROWS].sum() / route_rows.clamp(min=1), 0.0
        ),
        "native_agreement": table[_NATIVE_HITS].sum() / slots,
        "used_agreement": table[_USED_HITS].sum() / slots,
    }
    if layers:
        per_layer = table[_NATIVE_HITS] / (table[_ROUTE_ROWS] * top_k)  # [num_layers]
        for layer in layers:
            metrics[f"native_agreement/layer_{layer:02d}"] = per_layer[layer]
    return metrics
