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

from typing import Protocol, runtime_checkable

from torch import Tensor


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
        reused by activation-checkpoint recomputation) until :meth:`clear`.
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
        """Native-vs-replayed agreement since the last :meth:`clear`.

        Keys: ``"layers"`` (tuple of absolute layer indices), ``"replayed_rows"`` (int64
        ``[len(layers)]``: token rows replayed per layer), ``"agreeing_slots"`` (int64
        ``[len(layers)]``: expert slots whose replayed id is in the native top-k set), and
        ``"top_k"``. Agreement of layer ``i`` = ``agreeing_slots[i] / (replayed_rows[i] * top_k)``.
        Activation-checkpoint recomputation is not counted twice. Host tensors (one sync).
        """
        ...
