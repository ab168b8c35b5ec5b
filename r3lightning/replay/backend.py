"""The interface every router replay backend implements.

A backend owns the MoE routers of one model (or one pipeline stage of it) and can

* replay: force each router to use installed expert ids while the gate weights are still
  computed from the router's live logits (so the router keeps receiving gradients), and
* record: capture the expert ids each router actually used in a forward pass.

Routes are integer tensors ``[*token_shape, num_layers, top_k]`` whose layer axis is the
absolute decoder-layer index (dense layers included; their entries are ignored on install and
filled with 0 when recording). ``token_shape`` is the shape of the token tensor the model sees:
``[B, S']`` for a padded batch, ``[1, T]`` for a packed one (for megatron: this context-parallel
rank's ``[1, T_local]``, before the sequence-parallel split, which the backend applies itself).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "RouterReplayBackend",
    "agreement_hits",
    "in_recompute",
    "routes_on_all_layers",
    "validate_routes_for_install",
]


@runtime_checkable
class RouterReplayBackend(Protocol):
    """Install / clear / record routes for the MoE routers of one model."""

    num_layers: int  # size of the routes' layer axis (all decoder layers, dense ones included)
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]  # absolute indices of the layers this backend routes

    def install(self, routes: Tensor, replay_mask: Tensor | None = None) -> None:
        """Replay ``routes`` ``[*token_shape, num_layers, top_k]`` in the following forwards.

        ``replay_mask`` bool ``[*token_shape]``: False rows keep native routing (padding,
        uncaptured suffix tokens). ``None`` replays every row. Routes stay installed (and are
        reused by activation-checkpoint recomputation) until :meth:`clear` or the next install,
        which replaces them (one install per micro-batch); routing stats keep accumulating.
        """
        ...

    def clear(self) -> None:
        """Drop installed routes, recording state and routing stats; routers route natively."""
        ...

    def start_recording(self) -> None:
        """Capture the experts every router uses in the following forwards."""
        ...

    def stop_recording(self) -> Tensor:
        """Stop capturing; return ``[*token_shape, num_layers, top_k]`` of the recorded forward.

        Dense layers hold 0. Backends may join several forwards along the token axis (the
        Hugging Face backend does, for KV-cache generation).
        """
        ...

    def routing_stats(self) -> dict:
        """Native-vs-replayed agreement of the forwards since the last :meth:`clear` (every
        install in between).

        Keys: ``"layers"`` (tuple of absolute layer indices), ``"replayed_rows"`` (int64
        ``[len(layers)]``: token rows replayed per layer), ``"agreeing_slots"`` (int64
        ``[len(layers)]``: expert slots whose replayed id is in the native top-k set), and
        ``"top_k"``; optionally ``"used_slots"`` (replayed expert slots the forward actually
        used; a backend without it replays exactly what it installed). Agreement of layer ``i`` =
        ``agreeing_slots[i] / (replayed_rows[i] * top_k)``. Activation-checkpoint recomputation is
        not counted twice. Tensors on the routers' device, no host sync (before any forward they
        may be host zeros).
        """
        ...


def validate_routes_for_install(
    backend: RouterReplayBackend,
    routes: Tensor,
    replay_mask: Tensor | None,
    *,
    token_dims: int | None = None,
    check_ids: bool = True,
) -> tuple[int, ...]:
    """Check the arguments of ``backend.install(routes, replay_mask)``; returns the token shape.

    ``routes`` must be an integer ``[*token_shape, num_layers, top_k]`` tensor (``token_dims=2``:
    exactly ``[B, S, num_layers, top_k]``) and ``replay_mask`` None or bool ``[*token_shape]``.
    With ``check_ids`` the expert ids of the replayed rows on ``backend.moe_layers`` must lie in
    ``[0, num_experts)`` and be distinct within a row: one pass over those rows and, for device
    routes, device->host syncs (the masked selection, the min/max and the repeat test). Raises
    ``TypeError`` / ``ValueError``; nothing is kept.
    """
    num_layers, top_k, num_experts = backend.num_layers, backend.top_k, backend.num_experts
    if not isinstance(routes, Tensor) or routes.is_floating_point() or routes.dtype == torch.bool:
        raise TypeError(f"routes must be an integer tensor, got {getattr(routes, 'dtype', type(routes))}")
    label = (
        "*token_shape" if token_dims is None else "B, S" if token_dims == 2 else f"{token_dims} token dims"
    )
    shape_ok = routes.dim() >= 3 if token_dims is None else routes.dim() == token_dims + 2
    if not shape_ok or tuple(routes.shape[-2:]) != (num_layers, top_k):
        raise ValueError(
            f"routes must have shape [{label}, num_layers={num_layers}, top_k={top_k}], got {tuple(routes.shape)}"
        )
    token_shape = tuple(routes.shape[:-2])
    if replay_mask is not None and (
        replay_mask.dtype != torch.bool or tuple(replay_mask.shape) != token_shape
    ):
        raise ValueError(
            f"replay_mask must be a bool tensor of shape {token_shape}, "
            f"got {replay_mask.dtype} {tuple(replay_mask.shape)}"
        )
    if check_ids:
        used = routes[..., list(backend.moe_layers), :]  # [*token_shape, moe_layers, top_k]
        if replay_mask is not None:
            used = used[replay_mask]
        if used.numel():
            low, high = int(used.min()), int(used.max())
            if low < 0 or high >= num_experts:
                raise ValueError(
                    f"routes hold expert ids in [{low}, {high}] on replayed MoE layers; "
                    f"expected ids in [0, {num_experts - 1}]"
                )
            ordered = used.sort(dim=-1).values
            if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
                raise ValueError("routes repeat an expert within a token's top_k on a replayed MoE layer")
    return token_shape


def agreement_hits(replayed: Tensor, native: Tensor) -> Tensor:
    """bool ``[N, K]``: replayed expert slot whose id is in the router's native top-k set.

    ``replayed`` / ``native`` are ``[N, K]`` expert ids on one device; an ``[N, K, K]``
    comparison, no host sync. Summed per layer, these are the ``agreeing_slots`` of
    :meth:`RouterReplayBackend.routing_stats`.
    """
    return (replayed.unsqueeze(-1) == native.unsqueeze(-2)).any(-1)


def routes_on_all_layers(
    layer_rows: Iterable[tuple[int, Tensor]], token_shape: Sequence[int], num_layers: int, top_k: int
) -> Tensor:
    """Recorded routes as :meth:`RouterReplayBackend.stop_recording` returns them.

    ``layer_rows``: ``(absolute layer, experts [*token_shape, top_k])`` of each routed layer (at
    least one; all on one device). Returns int32 ``[*token_shape, num_layers, top_k]`` there, 0 on
    every other layer (dense layers, other pipeline stages). One zero fill and one copy per layer.
    """
    out: Tensor | None = None
    for layer, rows in layer_rows:
        if out is None:
            out = torch.zeros((*token_shape, num_layers, top_k), dtype=torch.int32, device=rows.device)
        out[..., layer, :] = rows
    if out is None:
        raise ValueError("routes_on_all_layers needs the rows of at least one routed layer")
    return out


# private but stable since torch 2.0; without it recompute passes would be counted/recorded twice
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def in_recompute() -> bool:
    """True while autograd runs a backward pass, i.e. during activation-checkpoint recomputation
    (reentrant or not: both recompute inside the backward's graph task). Backends replay there
    what the forward replayed, and neither record nor count it again."""
    return _graph_task_id() != -1
