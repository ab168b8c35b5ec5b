"""The ``RouterReplayBackend`` protocol (the docs' "Modes") and what its backends share."""

import inspect
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

# moved to r3lightning.checks (the job checks it without torch); re-exported here
from r3lightning.checks import check_soft_threshold as check_soft_threshold
from r3lightning.ragged import to_device_async


@runtime_checkable
class RouterReplayBackend(Protocol):
    """What the callback, `record_routes` and `replay_routes` need from a model's routers: install,
    clear and record routes ``[*token_shape, num_layers, top_k]``, and count how they agree.

    ``HFRouterReplay`` and ``MegatronRouterReplay`` implement it; so can a backend of your own
    (a class with these attributes and methods; no base class needed).

    Attributes:
        num_layers: Size of the routes' layer axis: all decoder layers, dense ones included.
        top_k: Experts per token and MoE layer.
        num_experts: Experts per MoE layer.
        moe_layers: Absolute indices of the decoder layers this backend routes, increasing.
    """

    num_layers: int  # size of the routes' layer axis (all decoder layers, dense ones included)
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]  # absolute indices of the layers this backend routes

    def install(
        self, routes: Tensor, replay_mask: Tensor | None = None, *, layers: Sequence[int] | None = None
    ) -> None:
        """Replays routes in the following forwards (and their recompute) until `clear` or the
        next install.

        Args:
            routes: Integer ``[*token_shape, num_layers, top_k]``, or ``[*token_shape,
                len(layers), top_k]`` with ``layers``.
            replay_mask: None, or bool ``[*token_shape]``: False rows keep native routing.
            layers: The decoder layer of each column of layer-sliced routes (covering
                ``moe_layers``); None: one column per decoder layer. A backend whose ``install``
                takes no ``layers`` gets sliced routes widened to ``num_layers`` columns
                (`widen_routes`).
        """

    def clear(self) -> None:
        """Drop installed routes, recording state and routing stats; routers route natively."""

    def start_recording(self) -> None:
        """Capture the experts every router uses in the following forwards."""

    def stop_recording(self) -> Tensor:
        """The experts the recorded forward(s) used, ``[*token_shape, num_layers, top_k]``."""

    def routing_stats(self) -> dict:
        """Counts since `clear` (recompute not counted), on device, no host sync.

        Returns:
            ``layers``, ``top_k`` and int64 ``[len(layers)]`` ``replayed_rows`` and
            ``agreeing_slots`` (optionally ``used_slots``, and ``kept_slots`` under soft replay).
        """


def route_columns(backend: RouterReplayBackend, layers: Sequence[int] | None) -> dict[int, int]:
    """The column of each of ``backend.moe_layers`` in routes whose columns are decoder ``layers``
    (None: one column per decoder layer).

    Args:
        backend: The backend whose routers read the routes.
        layers: The decoder layer of each route column, increasing, or None.

    Returns:
        ``{moe layer: column}``.

    Raises:
        ValueError: ``layers`` is not increasing, names a layer the model lacks, or leaves out one
            of the backend's MoE layers.
    """
    if layers is None:
        return {layer: layer for layer in backend.moe_layers}
    layers = tuple(layers)
    integers = all(isinstance(layer, int) and not isinstance(layer, bool) for layer in layers)
    if not layers or not integers or any(a >= b for a, b in itertools.pairwise(layers)):
        raise ValueError(f"layers must be increasing decoder layer ids, got {list(layers)}")
    if layers[0] < 0 or layers[-1] >= backend.num_layers:
        raise ValueError(
            f"routes on layers {list(layers)} name a layer outside the model's {backend.num_layers} "
            f"decoder layers (ids 0..{backend.num_layers - 1})"
        )
    missing = sorted(set(backend.moe_layers) - set(layers))
    if missing:
        raise ValueError(f"routes on layers {list(layers)} lack MoE layers {missing} of the model")
    column = {layer: i for i, layer in enumerate(layers)}
    return {layer: column[layer] for layer in backend.moe_layers}


def widen_routes(routes: Tensor, layers: Sequence[int], num_layers: int) -> Tensor:
    """Layer-sliced routes on all ``num_layers`` columns, zeros on the others.

    Only for a backend whose ``install`` takes no ``layers``: the backends of this package install
    sliced routes as they are.

    Args:
        routes: ``[*token_shape, len(layers), top_k]``, any integer dtype, any device.
        layers: The decoder layer of each column.
        num_layers: The model's decoder layers.

    Returns:
        ``[*token_shape, num_layers, top_k]`` in the dtype and on the device of ``routes``: one
        allocation of ``num_layers / len(layers)`` times the bytes of ``routes``, no host sync.
    """
    index = to_device_async(torch.tensor(list(layers)), routes.device)
    wide = routes.new_zeros((*routes.shape[:-2], num_layers, routes.shape[-1]))
    return wide.index_copy_(-2, index, routes)


def install_routes(
    backend: RouterReplayBackend, routes: Tensor, replay_mask: Tensor | None, layers: Sequence[int] | None
) -> None:
    """``backend.install`` of routes whose columns are decoder ``layers``.

    Sliced routes go to the backend as they are where its ``install`` takes ``layers`` (every
    backend of this package); a backend without it gets them widened by `widen_routes`.

    Args:
        backend: The backend.
        routes: ``[*token_shape, columns, top_k]``.
        replay_mask: None, or bool ``[*token_shape]``.
        layers: Each column's decoder layer; None: one column per decoder layer.
    """
    if layers is None:
        backend.install(routes, replay_mask)
    elif "layers" in inspect.signature(backend.install).parameters:
        backend.install(routes, replay_mask, layers=tuple(layers))
    else:
        backend.install(widen_routes(routes, layers, backend.num_layers), replay_mask)


def validate_routes_for_install(
    backend: RouterReplayBackend,
    routes: Tensor,
    replay_mask: Tensor | None,
    *,
    token_dims: int | None = None,
    check_ids: bool = True,
    layers: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Checks ``backend.install``'s arguments.

    Args:
        backend: The backend that installs them.
        routes: ``[*token_shape, columns, top_k]`` integer expert ids; ``columns`` is
            ``num_layers``, or ``len(layers)`` for layer-sliced routes.
        replay_mask: None, or bool ``[*token_shape]``.
        token_dims: The number of token dimensions required (None: any, at least one).
        check_ids: Also check that the ids on the MoE layers' columns are in ``[0, num_experts)``
            and distinct per row: host syncs for device routes.
        layers: The decoder layer of each column of layer-sliced routes (see `route_columns`).

    Returns:
        The token shape.

    Raises:
        TypeError: ``routes`` is not an integer tensor.
        ValueError: A shape, a layer list or an id is wrong.
    """
    L = backend.num_layers
    K = backend.top_k
    num_experts = backend.num_experts
    columns = route_columns(backend, layers)
    if not isinstance(routes, Tensor) or routes.is_floating_point() or routes.dtype == torch.bool:
        raise TypeError(f"routes must be an integer tensor, got {getattr(routes, 'dtype', type(routes))}")
    label = {None: "*token_shape", 2: "B, S"}.get(token_dims, f"{token_dims} token dims")
    shape_ok = routes.dim() >= 3 if token_dims is None else routes.dim() == token_dims + 2
    width = L if layers is None else len(layers)
    if not shape_ok or tuple(routes.shape[-2:]) != (width, K):
        if layers is None:
            expected = f"[{label}, num_layers={L}, top_k={K}]"
        else:
            expected = f"[{label}, {width} layers (one per route layer {list(layers)}), top_k={K}]"
        raise ValueError(f"routes must have shape {expected}, got {tuple(routes.shape)}")
    token_shape = tuple(routes.shape[:-2])
    if replay_mask is not None and (replay_mask.dtype != torch.bool or replay_mask.shape != token_shape):
        got = f"{replay_mask.dtype} {tuple(replay_mask.shape)}"
        raise ValueError(f"replay_mask must be a bool tensor of shape {token_shape}, got {got}")
    if check_ids:
        used = routes[..., list(columns.values()), :]  # [*token_shape, moe_layers, top_k]
        if replay_mask is not None:
            used = used[replay_mask]
        if used.numel():
            low = int(used.min())
            high = int(used.max())
            if low < 0 or high >= num_experts:
                got = f"routes hold expert ids in [{low}, {high}] on replayed MoE layers"
                raise ValueError(f"{got}; expected ids in [0, {num_experts - 1}]")
            ordered = used.sort(dim=-1).values
            if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
                raise ValueError("routes repeat an expert within a token's top_k on a replayed MoE layer")
    return token_shape


def agreement_hits(replayed: Tensor, native: Tensor) -> Tensor:
    """Which replayed experts the router also picked natively.

    Args:
        replayed: Expert ids ``[N, K]``.
        native: Expert ids ``[N, K]``, any order, same device.

    Returns:
        bool ``[N, K]``: True where ``replayed[n, k]`` is among ``native[n]``. One ``[N, K, K]``
        comparison; no host sync.
    """
    return (replayed.unsqueeze(-1) == native.unsqueeze(-2)).any(-1)


def agreement_counts(replayed: Tensor, native: Tensor, mask: Tensor | None) -> Tensor:
    """The replayed rows and their slots that agree with native routing, counted on device.

    Args:
        replayed: Expert ids ``[N, K]`` that were installed.
        native: The router's own ids ``[N, K]``.
        mask: bool ``[N]``: the rows replayed (None: all).

    Returns:
        int64 ``[2]`` on the ids' device: (rows ``mask`` keeps, their replayed slots found in
        ``native``). No grad, no host sync.
    """
    with torch.no_grad():
        keep = torch.ones_like(replayed[:, :1], dtype=torch.bool) if mask is None else mask[:, None]
        hits = agreement_hits(replayed, native) & keep
        return torch.stack([keep.sum(), hits.sum()])


def soft_replay_indices(
    replayed: Tensor, native: Tensor, logits: Tensor, threshold: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Soft replay of one layer: keep a replayed expert only where the router finds it likely.

    A replayed slot is kept where the router's own probability of its expert (fp32 softmax of
    ``logits`` over all experts) is at least ``threshold`` and ``mask`` is True; each other slot
    takes, in slot order, the next of the router's native top-k not already kept, so a row keeps
    ``K`` distinct experts, and a row with nothing kept is exactly the native row.

    Args:
        replayed: int64 ``[N, K]``: the installed experts.
        native: int64 ``[N, K]``: the router's own top-k, in its order.
        logits: The router's logits ``[N, E]``.
        threshold: The smallest probability kept.
        mask: bool ``[N]``: the rows replayed (None: all).

    Returns:
        ``(indices [N, K], kept [N, K] bool)`` on the logits' device. No grad; an fp32 softmax
        ``[N, E]`` and two ``[N, K, K]`` comparisons; no host sync.
    """
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
    """Recorded experts of some layers as routes on all layers: what ``stop_recording`` returns.

    Args:
        layer_rows: ``(decoder layer, experts [*token_shape, top_k])`` of each routed layer, at
            least one, all on one device.
        token_shape: The forward's token shape.
        num_layers: The model's decoder layers.
        top_k: Experts per token.

    Returns:
        int32 ``[*token_shape, num_layers, top_k]`` on the experts' device, 0 on the layers not
        given. One allocation and one copy per layer; no host sync.

    Raises:
        ValueError: ``layer_rows`` is empty.
    """
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
