"""Router replay for Hugging Face transformers 5.x MoE models.

In transformers 5.x every supported family routes through a small router module whose forward
returns ``(router_logits [N, E], routing_weights [N, K], expert_indices [N, K])`` for the ``N``
flattened tokens of the batch. ``HFRouterReplay`` puts a forward hook on each router that

* replaces ``expert_indices`` with the installed routes of that router's decoder layer (rows
  whose replay mask is False keep their native experts), and
* recomputes ``routing_weights`` from the *live* ``router_logits`` for those indices with the
  family's own normalisation, so the router weight still gets gradients and the result equals
  the native computation bit for bit when the replayed experts are the native ones.

Routes are keyed per router module (no queue of pending routes), so an activation-checkpoint
recomputation replays exactly what the first forward replayed, and FSDP2 ``fully_shard``, which
keeps module identity, needs nothing special. Recompute passes are neither recorded nor counted
in the routing stats.

Other router types are supported through :func:`~r3lightning.replay.hf.routers.register_router`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from r3lightning.replay.backend import (
    agreement_hits,
    in_recompute,
    routes_on_all_layers,
    validate_routes_for_install,
)

# The router adapter registry lives in hf_routers; these names stay importable from here.
from r3lightning.replay.hf.routers import (
    GateWeightsFn,
    RouterAdapter,
    _adapter_for,
    _load_builtins,
    find_routers,
    mixtral_weights,
    register_router,
    sigmoid_scaled_weights,
    softmax_over_topk_weights,
    softmax_then_topk_weights,
)

__all__ = [
    "GateWeightsFn",
    "HFRouterReplay",
    "RouterAdapter",
    "find_routers",
    "mixtral_weights",
    "register_router",
    "sigmoid_scaled_weights",
    "softmax_over_topk_weights",
    "softmax_then_topk_weights",
]


@dataclass
class _RouterSlot:
    layer: int  # absolute decoder-layer index
    position: int  # index into moe_layers
    adapter: RouterAdapter


# router module -> owning backend; one backend per router so hooks never stack
_OWNERS: weakref.WeakKeyDictionary[nn.Module, HFRouterReplay] = weakref.WeakKeyDictionary()


class HFRouterReplay:
    """Replay / record backend for the MoE routers of a Hugging Face model (``RouterReplayBackend``).

    ``model`` is any module containing the routers (a ``*ForCausalLM``, its backbone, or a
    LightningModule holding it). Routers are mapped to their absolute decoder-layer index from
    their qualified name (``...layers.<i>....``); ``num_layers`` is ``config.num_hidden_layers``
    when the model has a config. Use :meth:`for_model` to share one backend per model.

    ``validate=True`` checks installed expert ids (range, distinct within a row) on
    install: one pass over the routes and, for routes already on device, device->host syncs
    (:class:`~r3lightning.replay.callback.RouterReplayCallback` turns it off: its ids are checked
    upstream).

    Per router call while routes are installed: the installed routes of that layer widened to
    int64 (routes stay in their compact dtype on device until then), a ``where`` on the indices,
    the family's weight formula on the live logits, and two ``[N, K, K]`` comparisons for the
    agreement counts, all on device with no host sync. The routes move to the router logits'
    device in the first router call after :meth:`install` (once; with CPU-offloaded parameters
    that is still the compute device). With nothing installed and nothing recording the hooks
    return at once (no tensor work, nothing for ``torch.compile`` to trace). Recording keeps an
    int32 ``[N, K]`` per MoE layer and forward.
    """

    def __init__(self, model: nn.Module, *, validate: bool = True) -> None:
        self.validate = validate
        found = find_routers(model)
        layers = [layer for layer, *_ in found]
        top_ks = {getattr(m, a.top_k_attr) for _, _, m, a in found}
        num_experts = {getattr(m, a.num_experts_attr) for _, _, m, a in found}
        if len(top_ks) != 1 or len(num_experts) != 1:
            raise ValueError(f"routers disagree on top_k {top_ks} or num_experts {num_experts}")
        config = getattr(model, "config", None)
        self.num_layers: int = int(getattr(config, "num_hidden_layers", layers[-1] + 1))
        if layers[-1] >= self.num_layers:
            raise ValueError(f"router at layer {layers[-1]} but num_hidden_layers={self.num_layers}")
        self.top_k: int = int(top_ks.pop())
        self.num_experts: int = int(num_experts.pop())
        self.moe_layers: tuple[int, ...] = tuple(layers)
        self.model_name = type(model).__name__

        self._routes: Tensor | None = None  # [N, num_layers, top_k], compact dtype as installed
        self._mask: Tensor | None = None  # [N] bool or None
        self._token_shape: tuple[int, ...] | None = None
        # [3, len(moe_layers)] int64 on the logits' device: replayed rows, agreeing slots, used slots
        self._stats: Tensor | None = None
        # one list per active recording (nested recordings each get every forward), per forward:
        # (token shape, {layer: experts used [N, K] int32})
        self._sessions: list[list[tuple[tuple[int, ...], dict[int, Tensor]]]] = []

        for _, name, module, _ in found:
            if module in _OWNERS:
                raise RuntimeError(
                    f"router {name!r} already has a replay backend; use HFRouterReplay.for_model(model) "
                    "to share it, or call .remove() on the old one"
                )
        self._handles = []
        for position, (layer, _, module, adapter) in enumerate(found):
            _OWNERS[module] = self
            slot = _RouterSlot(layer, position, adapter)
            self._handles.append(module.register_forward_hook(self._make_router_hook(slot)))
        # The first MoE block's input gives the token shape of each recorded forward.
        first_parent = model.get_submodule(found[0][1].rpartition(".")[0]) if "." in found[0][1] else model
        self._handles.append(
            first_parent.register_forward_pre_hook(self._on_first_moe_block, with_kwargs=True)
        )
        self.routers: tuple[nn.Module, ...] = tuple(module for _, _, module, _ in found)

    # ----------------------------------------------------------------------------- lifecycle
    @classmethod
    def for_model(cls, model: nn.Module, **kwargs) -> HFRouterReplay:
        """The backend already attached to ``model``'s routers (as it is: ``kwargs`` only apply to
        a new one), or a new one built with ``kwargs``."""
        _load_builtins(imported_only=True)
        for module in model.modules():
            if _adapter_for(module) is not None and module in _OWNERS:
                return _OWNERS[module]
        return cls(model, **kwargs)

    def remove(self) -> None:
        """Unregister all hooks; the model routes natively and can get a new backend."""
        self.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self.routers:
            if _OWNERS.get(module) is self:
                del _OWNERS[module]

    # ------------------------------------------------------------------------------- replay
    def install(self, routes: Tensor, replay_mask: Tensor | None = None) -> None:
        """Replay ``routes`` ``[*token_shape, num_layers, top_k]`` until :meth:`clear`.

        Kept as given (compact dtype, any device: no copy here); the first router call moves
        them to its logits' device (``non_blocking``: pin host routes to overlap the copy) and
        each router widens only its own layer to int64. ``replay_mask`` ``[*token_shape]`` bool,
        False -> native routing for that token. Replaces any installed routes; the routing stats
        keep accumulating until :meth:`clear` (several installs in one step: micro-batches).
        """
        token_shape = validate_routes_for_install(self, routes, replay_mask, check_ids=self.validate)
        n = routes[..., 0, 0].numel()
        self._routes = routes.reshape(n, self.num_layers, self.top_k)
        self._mask = None if replay_mask is None else replay_mask.reshape(n)
        self._token_shape = token_shape

    def _routes_on(self, device: torch.device) -> tuple[Tensor, Tensor | None]:
        """Installed routes ``[N, L, K]`` and mask ``[N]`` on ``device``, moved there once."""
        routes, mask = self._routes, self._mask
        assert routes is not None
        if routes.device != device:
            self._routes = routes = routes.to(device, non_blocking=True)
            if mask is not None:
                self._mask = mask = mask.to(device, non_blocking=True)
        return routes, mask

    def clear(self) -> None:
        """Drop installed routes, recording and stats (no device work)."""
        self._routes = None
        self._mask = None
        self._token_shape = None
        self._stats = None
        self._sessions = []

    @property
    def installed(self) -> bool:
        return self._routes is not None

    # ---------------------------------------------------------------------------- recording
    @property
    def recording(self) -> bool:
        return bool(self._sessions)

    def start_recording(self) -> None:
        """Capture the experts used (after replay) by every forward until :meth:`stop_recording`.

        Recordings nest: each ``start_recording`` opens a session that sees every later forward;
        ``stop_recording`` closes the innermost one.
        """
        self._sessions.append([])

    def stop_recording(self) -> Tensor:
        """Routes of the recorded forwards, int32 ``[*token_shape, num_layers, top_k]`` on device.

        Several forwards (KV-cache generation: prefill then one step per token) are concatenated
        along the last token axis, so ``generate`` yields one row per forwarded token. Dense
        layers hold 0. No host sync.
        """
        if not self._sessions:
            raise RuntimeError("stop_recording() without a matching start_recording()")
        captures = self._sessions.pop()
        if not captures:
            raise RuntimeError(f"no forward pass of {self.model_name} ran while recording routes")
        lead = captures[0][0][:-1]
        pieces = []
        for token_shape, by_layer in captures:
            if token_shape[:-1] != lead:
                raise ValueError(
                    f"recorded forwards have token shapes {[c[0] for c in captures]}; they can only be "
                    "joined along the last token axis"
                )
            missing = set(self.moe_layers) - set(by_layer)
            if missing:
                raise RuntimeError(f"recording saw no routing for MoE layers {sorted(missing)}")
            rows = ((layer, r.reshape(*token_shape, self.top_k)) for layer, r in by_layer.items())
            pieces.append(routes_on_all_layers(rows, token_shape, self.num_layers, self.top_k))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=len(lead))

    # -------------------------------------------------------------------------------- stats
    def routing_stats(self) -> dict:
        """Per MoE layer, over the replayed rows of the forwards since :meth:`clear` (every
        install in between): int64 ``[len(moe_layers)]`` tensors on the logits' device (no sync).

        ``agreeing_slots[i] / (replayed_rows[i] * top_k)`` is the fraction of replayed experts
        the router would also have chosen natively (as a set) at layer ``layers[i]``;
        ``used_slots`` counts the replayed experts the forward actually used.
        """
        if self._stats is None:
            rows = slots = used = torch.zeros(len(self.moe_layers), dtype=torch.int64)
        else:
            rows, slots, used = self._stats.unbind(0)
        return {
            "layers": self.moe_layers,
            "top_k": self.top_k,
            "replayed_rows": rows,
            "agreeing_slots": slots,
            "used_slots": used,
        }

    # -------------------------------------------------------------------------------- hooks
    def _on_first_moe_block(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._sessions or in_recompute():
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        for session in self._sessions:
            session.append((tuple(hidden.shape[:-1]), {}))

    def _make_router_hook(self, slot: _RouterSlot):
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            return self._route(slot, module, output)

        return hook

    def _route(self, slot: _RouterSlot, module: nn.Module, output: tuple) -> tuple | None:
        if self._routes is None and not self._sessions:
            return None  # idle: no tensor work and no call torch.compile cannot trace
        p_logits, p_weights, p_indices = slot.adapter.output_positions
        native = output[p_indices]  # [N, K]
        recompute = in_recompute()
        indices = native
        replaced = None
        if self._routes is not None:
            if native.shape[0] != self._routes.shape[0]:
                raise ValueError(
                    f"{self.model_name} routed {native.shape[0]} tokens at layer {slot.layer} but routes "
                    f"were installed for token shape {self._token_shape} ({self._routes.shape[0]} tokens)"
                )
            routes, mask = self._routes_on(output[p_logits].device)
            installed = routes[:, slot.layer].long()  # [N, K]: only this layer is widened
            indices = installed if mask is None else torch.where(mask[:, None], installed, native)
            weights = slot.adapter.gate_weights(module, output[p_logits], indices)
            # in the dtype the router returns: some (ERNIE) compute in fp32 and round to the
            # input's dtype, which their logits do not show
            weights = weights.to(output[p_weights].dtype)
            replaced = list(output)
            replaced[p_weights], replaced[p_indices] = weights, indices
            if not recompute:
                self._count(slot, installed, native, indices, mask)
        if self._sessions and not recompute:
            used = indices.detach().to(torch.int32)
            for session in self._sessions:
                if not session:
                    raise RuntimeError("recording started in the middle of a forward pass")
                session[-1][1][slot.layer] = used
        return None if replaced is None else type(output)(replaced)

    def _count(
        self, slot: _RouterSlot, installed: Tensor, native: Tensor, used: Tensor, mask: Tensor | None
    ) -> None:
        """Add this forward's replayed rows, native hits and used hits of one layer (on device)."""
        with torch.no_grad():
            hits = agreement_hits(installed, native)  # [N, K]
            used_hits = agreement_hits(installed, used)
            if mask is None:
                rows: Tensor | int = installed.shape[0]
            else:
                keep = mask[:, None]
                hits, used_hits, rows = hits & keep, used_hits & keep, mask.sum()
            if self._stats is None:
                self._stats = torch.zeros((3, len(self.moe_layers)), dtype=torch.int64, device=native.device)
            column = self._stats[:, slot.position]
            column[0] += rows
            column[1] += hits.sum()
            column[2] += used_hits.sum()
