"""Record and replay routes in custom loops, no Lightning needed (the docs' "Getting started")."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, nn

from r3lightning.replay.backend import RouterReplayBackend, check_soft_threshold, install_routes
from r3lightning.replay.hf.replay import HFRouterReplay


def as_backend(model_or_backend: nn.Module | RouterReplayBackend) -> RouterReplayBackend:
    """The backend itself, the model's own ``router_replay_backend()`` or its Hugging Face one (made once)."""
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
    """Records the experts the block's forwards use.

    Args:
        model_or_backend: The MoE model or its backend.

    Yields:
        A recording whose ``routes`` are set when the block ends: int32 ``[*token_shape,
        num_layers, top_k]`` on the routers' device (several forwards joined along the last token
        axis), no host sync. An exception clears the backend instead.
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
    """Replay ``routes`` in the block's forwards (``replay_mask`` False: native); yields the backend.

    Args:
        model_or_backend: the MoE model or its backend.
        routes: ``[*token_shape, num_layers, top_k]`` expert ids, or ``[*token_shape,
            len(layers), top_k]`` with ``layers``.
        replay_mask: ``[*token_shape]`` bool, False rows route natively (None: all replayed).
        layers: The decoder layer of each column of layer-sliced routes (None: one column per
            layer); installed as they are where the backend takes ``layers``, else widened.
        soft_threshold: soft replay for this block (the backend's own setting is back after it): a
            replayed expert is kept only where the router's probability of it is at least this;
            None: the backend's setting.

    Raises:
        ValueError: ``soft_threshold`` for a backend without soft replay, or not a number >= 0.
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
