"""Record and replay routes in custom loops, no Lightning needed (the docs' "Getting started")."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, nn

from r3lightning.replay.backend import RouterReplayBackend, check_soft_threshold, install_routes
from r3lightning.replay.hf.replay import HFRouterReplay


def as_backend(model_or_backend: nn.Module | RouterReplayBackend) -> RouterReplayBackend:
    """The replay backend of a model, or the backend itself.

    Args:
        model_or_backend: A ``RouterReplayBackend`` (returned as it is), or an MoE model: its own
            ``router_replay_backend()`` if it has one, else its Hugging Face backend
            (``HFRouterReplay.for_model``: the one attached to its routers, or a new one).

    Returns:
        The backend.

    Raises:
        TypeError: Neither an ``nn.Module`` nor a backend.
        ValueError: A model without a router the Hugging Face backend knows.
    """
    if isinstance(model_or_backend, RouterReplayBackend):
        return model_or_backend
    if not isinstance(model_or_backend, nn.Module):
        got = type(model_or_backend).__name__
        raise TypeError(f"expected an nn.Module MoE model or a RouterReplayBackend, got {got}")
    own = getattr(model_or_backend, "router_replay_backend", None)
    return own() if callable(own) else HFRouterReplay.for_model(model_or_backend)


@dataclass
class RouteRecording:
    """``routes [*token_shape, num_layers, top_k]``, set when the ``record_routes`` block exits."""

    routes: Tensor | None = None


@contextmanager
def record_routes(model_or_backend: nn.Module | RouterReplayBackend) -> Iterator[RouteRecording]:
    """Records the experts the block's forwards use (after any replay), without Lightning.

    Example: ``with record_routes(model) as rec: model(input_ids)`` leaves ``rec.routes``.

    Args:
        model_or_backend: The MoE model or its backend (see `as_backend`).

    Yields:
        A recording whose ``routes`` are set when the block ends: int32 ``[*token_shape,
        num_layers, top_k]`` on the routers' device, 0 on layers the backend does not route.
        Several forwards of the HF backend (``generate``) are joined along the last token axis;
        the megatron backend returns its last forward's. No host sync (megatron under sequence
        parallelism: one all-gather over the TP group). An exception clears the backend instead.

    Raises:
        TypeError: ``model_or_backend`` is neither a model nor a backend.
        RuntimeError: No forward of the routed layers ran in the block.
    """
    backend = as_backend(model_or_backend)
    recording = RouteRecording()
    backend.start_recording()
    try:
        yield recording
    except BaseException:
        backend.clear()
        raise
    recording.routes = backend.stop_recording()


@contextmanager
def replay_routes(
    model_or_backend: nn.Module | RouterReplayBackend,
    routes: Tensor,
    replay_mask: Tensor | None = None,
    *,
    layers: Sequence[int] | None = None,
    soft_threshold: float | None = None,
) -> Iterator[RouterReplayBackend]:
    """Replays routes in the block's forwards, without Lightning; the backend is cleared on exit.

    Example: ``with replay_routes(model, routes, mask): loss = model(input_ids).loss``.

    Args:
        model_or_backend: The MoE model or its backend (see `as_backend`).
        routes: Integer expert ids aligned to the tokens the model is fed: ``[*token_shape,
            num_layers, top_k]`` (``[B, S]`` or ``[1, T]`` token shapes; megatron: ``[B, S]``), or
            ``[*token_shape, len(layers), top_k]`` with ``layers``. Any integer dtype and device:
            the backend widens each layer's column to int64 on the routers' device as it is used.
        replay_mask: bool ``[*token_shape]``: False rows route natively (None: all replayed).
        layers: The decoder layer of each column of layer-sliced routes (None: one column per
            layer), covering the backend's MoE layers; installed as they are where the backend
            takes ``layers``, else widened to all layers.
        soft_threshold: Soft replay for this block only (the backend's own setting is back after
            it): a replayed expert is kept only where the router's probability of it is at least
            this. None: the backend's setting.

    Yields:
        The backend, with the routes installed.

    Raises:
        TypeError: ``model_or_backend`` is neither a model nor a backend, or ``routes`` is not an
            integer tensor.
        ValueError: ``soft_threshold`` for a backend without soft replay, or not a number >= 0;
            routes or mask of the wrong shape (and, when the backend validates, bad expert ids).
    """
    backend = as_backend(model_or_backend)
    threshold = check_soft_threshold(soft_threshold)
    if threshold is not None and not hasattr(backend, "soft_threshold"):
        raise ValueError(
            f"soft_threshold needs a backend with soft replay (hf), got {type(backend).__name__}"
        )
    before = getattr(backend, "soft_threshold", None)
    if threshold is not None:
        backend.soft_threshold = threshold
    install_routes(backend, routes, replay_mask, layers)
    try:
        yield backend
    finally:
        backend.clear()
        if threshold is not None:
            backend.soft_threshold = before
