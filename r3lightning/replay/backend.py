"""The ``RouterReplayBackend`` protocol (the docs' "Modes") and what its backends share."""

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class RouterReplayBackend(Protocol):
    """Install / clear / record routes ``[*token_shape, num_layers, top_k]`` for one model's routers."""

    num_layers: int  # size of the routes' layer axis (all decoder layers, dense ones included)
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]  # absolute indices of the layers this backend routes

    def install(self, routes: Tensor, replay_mask: Tensor | None = None) -> None:
        """Replay ``routes`` in the following forwards (and their recompute) until :meth:`clear` or
        the next install; ``replay_mask [*token_shape]`` False rows keep native routing."""

    def clear(self) -> None:
        """Drop installed routes, recording state and routing stats; routers route natively."""

    def start_recording(self) -> None:
        """Capture the experts every router uses in the following forwards."""

    def stop_recording(self) -> Tensor:
        """The experts the recorded forward(s) used, ``[*token_shape, num_layers, top_k]``."""

    def routing_stats(self) -> dict:
        """``layers``, ``top_k`` and int64 ``[len(layers)]`` ``replayed_rows``, ``agreeing_slots`` (optionally
        ``used_slots``, and ``kept_slots`` under soft replay) since :meth:`clear` (recompute not
        counted), on device, no host sync."""


def validate_routes_for_install(
    backend: RouterReplayBackend,
    routes: Tensor,
    replay_mask: Tensor | None,
    *,
    token_dims: int | None = None,
    check_ids: bool = True,
) -> tuple[int, ...]:
    """Check ``backend.install``'s arguments and return the token shape; ``check_ids``: replayed ids in
    ``[0, num_experts)``, distinct per row (host syncs for device routes)."""
    L, K, num_experts = backend.num_layers, backend.top_k, backend.num_experts
    if not isinstance(routes, Tensor) or routes.is_floating_point() or routes.dtype == torch.bool:
        raise TypeError(f"routes must be an integer tensor, got {getattr(routes, 'dtype', type(routes))}")
    label = {None: "*token_shape", 2: "B, S"}.get(token_dims, f"{token_dims} token dims")
    shape_ok = routes.dim() >= 3 if token_dims is None else routes.dim() == token_dims + 2
    if not shape_ok or tuple(routes.shape[-2:]) != (L, K):
        expected = f"[{label}, num_layers={L}, top_k={K}]"
        raise ValueError(f"routes must have shape {expected}, got {tuple(routes.shape)}")
    token_shape = tuple(routes.shape[:-2])
    if replay_mask is not None and (replay_mask.dtype != torch.bool or replay_mask.shape != token_shape):
        got = f"{replay_mask.dtype} {tuple(replay_mask.shape)}"
        raise ValueError(f"replay_mask must be a bool tensor of shape {token_shape}, got {got}")
    if check_ids:
        used = routes[..., list(backend.moe_layers), :]  # [*token_shape, moe_layers, top_k]
        if replay_mask is not None:
            used = used[replay_mask]
        if used.numel():
            low, high = int(used.min()), int(used.max())
            if low < 0 or high >= num_experts:
                got = f"routes hold expert ids in [{low}, {high}] on replayed MoE layers"
                raise ValueError(f"{got}; expected ids in [0, {num_experts - 1}]")
            ordered = used.sort(dim=-1).values
            if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
                raise ValueError("routes repeat an expert within a token's top_k on a replayed MoE layer")
    return token_shape


def agreement_hits(replayed: Tensor, native: Tensor) -> Tensor:
    """bool ``[N, K]``: replayed slots whose id is in the native top-k (an ``[N, K, K]`` comparison)."""
    return (replayed.unsqueeze(-1) == native.unsqueeze(-2)).any(-1)


def agreement_counts(replayed: Tensor, native: Tensor, mask: Tensor | None) -> Tensor:
    """int64 ``[2]`` on device: rows ``mask`` keeps (None: all) and their replayed slots in ``native``."""
    with torch.no_grad():
        keep = torch.ones_like(replayed[:, :1], dtype=torch.bool) if mask is None else mask[:, None]
        hits = agreement_hits(replayed, native) & keep
        return torch.stack([keep.sum(), hits.sum()])


def check_soft_threshold(threshold: float | None) -> float | None:
    """``soft_threshold`` as a float: None (plain replay) or a number >= 0, a router probability (above
    every probability, e.g. above 1, nothing is kept: native routing)."""
    if threshold is None:
        return None
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not threshold >= 0:
        raise ValueError(
            f"soft_threshold must be null or a number >= 0 (a router probability), got {threshold!r}"
        )
    return float(threshold)


def soft_replay_indices(
    replayed: Tensor, native: Tensor, logits: Tensor, threshold: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Soft replay of one layer: ``(indices [N, K], kept [N, K] bool)``. A replayed slot is kept where
    the router's own probability of its expert (fp32 softmax of ``logits [N, E]`` over all experts)
    is at least ``threshold`` (and ``mask [N]`` is True); each other slot takes, in slot order, the
    next of the router's native top-k (``native [N, K]``, in its order) not already kept, so a row
    keeps ``K`` distinct experts; a row with nothing kept is exactly the native row."""
    with torch.no_grad():
        probs = logits.float().softmax(dim=-1)  # [N, E]
        kept = probs.gather(-1, replayed) >= threshold  # [N, K]
        if mask is not None:
            kept &= mask[:, None]
        # native slots whose expert is already among the kept ones: not free to fill with
        taken = ((native[:, :, None] == replayed[:, None, :]) & kept[:, None, :]).any(-1)  # [N, K]
        dropped_rank = (~kept).long().cumsum(-1) - 1  # [N, K]: j-th dropped slot of the row
        free_rank = (~taken).long().cumsum(-1) - 1  # [N, K]: j-th free native slot
        match = (
            (~kept)[:, :, None] & (~taken)[:, None, :] & (dropped_rank[:, :, None] == free_rank[:, None, :])
        )
        fill = (match.long() * native[:, None, :]).sum(-1)  # [N, K]: one match per dropped slot
        return torch.where(kept, replayed, fill), kept


def routes_on_all_layers(
    layer_rows: Iterable[tuple[int, Tensor]], token_shape: Sequence[int], num_layers: int, top_k: int
) -> Tensor:
    """int32 ``[*token_shape, num_layers, top_k]`` from ``(layer, experts [*token_shape, top_k])`` of
    each routed layer (at least one), 0 on the others: what ``stop_recording`` returns."""
    pairs = list(layer_rows)
    if not pairs:
        raise ValueError("routes_on_all_layers needs the rows of at least one routed layer")
    out = torch.zeros((*token_shape, num_layers, top_k), dtype=torch.int32, device=pairs[0][1].device)
    for layer, rows in pairs:
        out[..., layer, :] = rows
    return out


# private but stable since torch 2.0; without it recompute passes would be counted/recorded twice
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def in_recompute() -> bool:
    """True inside autograd's backward (activation recompute): replay again, record / count nothing."""
    return _graph_task_id() != -1
