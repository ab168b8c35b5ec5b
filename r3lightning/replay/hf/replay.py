"""Router replay for Hugging Face transformers 5.x MoE models, by a forward hook on each router."""

import importlib
import inspect
import weakref
from collections.abc import Sequence
from typing import Self

import torch
from torch import Tensor, nn

from r3lightning.replay.backend import (
    agreement_counts,
    agreement_hits,
    check_soft_threshold,
    in_recompute,
    route_columns,
    routes_on_all_layers,
    soft_replay_indices,
    validate_routes_for_install,
)
from r3lightning.replay.hf.routers import RouterAdapter, find_routers

__all__ = ["HFRouterReplay"]
# router module -> owning backend; one backend per router so hooks never stack
_OWNERS: "weakref.WeakKeyDictionary[nn.Module, HFRouterReplay]" = weakref.WeakKeyDictionary()


def __getattr__(name: str) -> object:  # the old flat r3lightning.replay.hf served the registry's names
    return getattr(importlib.import_module("r3lightning.replay.hf.routers"), name)


class HFRouterReplay:
    """``RouterReplayBackend`` for the Hugging Face routers inside a model, found by layer name
    (``...layers.<i>....``), one forward hook each.

    A router's forward hook replaces its expert indices with the installed ones and recomputes
    the gate weights from its live logits with the model family's formula (gradients reach the
    router); rows with replay mask False keep the router's own choice. Keyed per router module,
    not a queue, so activation-checkpoint recompute and FSDP2 replay the same routes.

    Cost per router call with routes installed (``N`` tokens): the first call of an install moves
    the routes and mask to the router's device (non-blocking); then an int64 widening of that
    layer's column ``[N, K]``, a ``where``, the weight formula and one ``[N, K, K]`` comparison
    (the agreement count), all on device, no host sync. Soft replay adds an fp32 softmax
    ``[N, E]`` and three more ``[N, K, K]`` comparisons. Idle hooks return at once. Recording
    keeps an int32 ``[N, K]`` per MoE layer and forward. One backend per model: `for_model`
    shares it.

    Args:
        model: The MoE model (or the part of it one rank holds): its routers' types must be
            registered (`r3lightning.replay.hf.routers.register_router`; most transformers 5.x MoE
            families are built in) and sit in a ``layers.<i>`` module list.
        validate: Check the expert ids of every install (range, distinct per row): host syncs
            for device routes. Shapes are always checked.
        soft_threshold: Soft replay: keep a replayed expert only where the router's own
            probability of it is at least this (`r3lightning.replay.backend.soft_replay_indices`);
            None: plain replay.

    Raises:
        ValueError: No router of a registered type, routers that disagree on top-k or expert
            count, or a bad ``soft_threshold``.
        RuntimeError: A router already has a backend.
    """

    def __init__(
        self, model: nn.Module, *, validate: bool = True, soft_threshold: float | None = None
    ) -> None:
        self.validate = validate
        self.soft_threshold = check_soft_threshold(soft_threshold)
        found = find_routers(model)
        layers = [layer for layer, *_ in found]
        shapes: set[tuple[int, int]] = set()  # (top_k, num_experts) of each router: one model, one shape
        for _, _, module, adapter in found:
            top_k = int(getattr(module, adapter.top_k_attr))
            num_experts = int(getattr(module, adapter.num_experts_attr))
            shapes.add((top_k, num_experts))
        if len(shapes) != 1:
            raise ValueError(f"routers disagree on (top_k, num_experts): {sorted(shapes)}")
        self.top_k, self.num_experts = shapes.pop()
        self.moe_layers = tuple(layers)
        self.num_layers = int(getattr(getattr(model, "config", None), "num_hidden_layers", layers[-1] + 1))
        if layers[-1] >= self.num_layers:
            raise ValueError(f"router at layer {layers[-1]} but num_hidden_layers={self.num_layers}")
        self.model_name = type(model).__name__
        self.clear()
        owned = [name for _, name, module, _ in found if module in _OWNERS]
        if owned:
            fix = "use HFRouterReplay.for_model(model) to share it, or call .remove() on the old one"
            raise RuntimeError(f"router {owned[0]!r} already has a replay backend; {fix}")
        self.routers: tuple[nn.Module, ...] = tuple(module for _, _, module, _ in found)
        _OWNERS.update(dict.fromkeys(self.routers, self))
        hooks = [self._router_hook(layer, i, adapter) for i, (layer, _, _, adapter) in enumerate(found)]
        self._handles = [m.register_forward_hook(hook) for m, hook in zip(self.routers, hooks, strict=True)]
        # the first MoE block's input gives the token shape of each recorded forward ("": the model)
        first_parent = model.get_submodule(found[0][1].rpartition(".")[0])
        self._handles.append(
            first_parent.register_forward_pre_hook(self._on_first_moe_block, with_kwargs=True)
        )

    @classmethod
    def for_model(cls, model: nn.Module, **kwargs) -> Self:
        """The backend already attached to a model's routers, else a new one.

        Args:
            model: The MoE model.
            **kwargs: The constructor's keywords (``validate``, ``soft_threshold``). A new backend
                is built with them; an attached one is returned only if each given keyword equals
                its setting (``soft_threshold`` compared after its check: ``1`` equals ``1.0``).
                None given: the attached backend as it is.

        Returns:
            The backend that owns the first of ``model``'s routers that has one, else
            ``HFRouterReplay(model, **kwargs)``.

        Raises:
            ValueError: A keyword whose value differs from the attached backend's setting (the
                message names the keyword, the attached value and the requested one); for a new
                backend, what the constructor raises.
            TypeError: A keyword the constructor does not take.
        """
        owner = next((_OWNERS[module] for module in model.modules() if module in _OWNERS), None)
        if owner is None:
            return cls(model, **kwargs)
        settings = [p.name for p in inspect.signature(cls).parameters.values() if p.kind is p.KEYWORD_ONLY]
        for name, requested in kwargs.items():
            if name not in settings:
                raise TypeError(f"HFRouterReplay.for_model() got an unexpected keyword argument {name!r}")
            # compared as the constructor would store it: soft_threshold=1 is the attached 1.0
            wanted = check_soft_threshold(requested) if name == "soft_threshold" else requested
            attached = getattr(owner, name)
            if wanted != attached:
                raise ValueError(
                    f"{name}={requested!r} differs from the replay backend already attached to this "
                    f"model ({name}={attached!r}); pass {name}={attached!r} or no {name} to share it, "
                    f"or call .remove() on it first to attach a new one"
                )
        return owner

    def remove(self) -> None:
        """Unregister all hooks; the model routes natively and can get a new backend."""
        self.clear()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self.routers:
            if _OWNERS.get(module) is self:
                del _OWNERS[module]

    def install(
        self, routes: Tensor, replay_mask: Tensor | None = None, *, layers: Sequence[int] | None = None
    ) -> None:
        """Replays ``routes`` in the following forwards until `clear`.

        Args:
            routes: ``[*token_shape, num_layers, top_k]``, or ``[*token_shape, len(layers), top_k]``
                when ``layers`` is given: kept as they are (compact dtype, sliced), moved to the
                routers' device (non-blocking; host routes should be page-locked for it not to
                block) on first use, and each router reads its own column.
            replay_mask: None, or bool ``[*token_shape]``: False rows route natively.
            layers: The decoder layer of each column of layer-sliced routes, covering ``moe_layers``.

        Raises:
            TypeError: ``routes`` is not an integer tensor.
            ValueError: ``routes``, ``replay_mask`` or ``layers`` of the wrong shape; with
                ``validate``, ids outside ``[0, num_experts)`` or repeated in a row (host syncs
                for device routes). A forward over another token count raises in the router.
        """
        self._token_shape = validate_routes_for_install(
            self, routes, replay_mask, check_ids=self.validate, layers=layers
        )
        self._columns = route_columns(self, layers)
        self._routes = routes.reshape(-1, *routes.shape[-2:])  # [N, columns, K]
        self._mask = None if replay_mask is None else replay_mask.reshape(-1)

    def clear(self) -> None:
        """Drop installed routes, recording and stats (no device work)."""
        self._routes: Tensor | None = None  # [N, columns, top_k], compact dtype as installed
        self._columns: dict[int, int] = {}  # MoE layer -> its column of the installed routes
        self._mask: Tensor | None = None  # [N] bool
        self._token_shape: tuple[int, ...] | None = None
        self._stats: Tensor | None = None  # [4, moe_layers] int64 on device: agreement_counts, used, kept
        # per open recording (they nest), per forward: (token shape, {layer: experts [N, K] int32})
        self._sessions: list[list[tuple[tuple[int, ...], dict[int, Tensor]]]] = []

    @property
    def installed(self) -> bool:
        """Whether routes are installed."""
        return self._routes is not None

    @property
    def recording(self) -> bool:
        """Whether a recording is open."""
        return bool(self._sessions)

    def start_recording(self) -> None:
        """Capture the experts used (after replay) until `stop_recording`; recordings nest."""
        self._sessions.append([])

    def stop_recording(self) -> Tensor:
        """Ends the innermost recording.

        Returns:
            int32 ``[*token_shape, num_layers, top_k]`` on the routers' device, 0 on layers without
            a router: the experts each forward used (after any replay). Several forwards
            (``generate``) are joined along the last token axis. No host sync.

        Raises:
            RuntimeError: No open recording, no forward ran, or a MoE layer never routed.
            ValueError: Forwards whose token shapes differ before the last axis.
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
                shapes = [c[0] for c in captures]
                raise ValueError(f"recorded forwards of token shapes {shapes} join along the last axis only")
            missing = set(self.moe_layers) - set(by_layer)
            if missing:
                raise RuntimeError(f"recording saw no routing for MoE layers {sorted(missing)}")
            rows = ((layer, r.reshape(*token_shape, self.top_k)) for layer, r in by_layer.items())
            pieces.append(routes_on_all_layers(rows, token_shape, self.num_layers, self.top_k))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=len(lead))

    def routing_stats(self) -> dict:
        """Counts of the replaying forwards since `clear` (recompute not counted).

        Returns:
            ``layers`` (``moe_layers``), ``top_k``, and int64 ``[len(moe_layers)]`` on device:
            ``replayed_rows``, ``agreeing_slots`` (replayed experts the router also picked
            natively); under soft replay also ``used_slots`` and ``kept_slots``. No host sync.
        """
        table = self._stats  # [4, moe_layers]: replayed rows, agreeing slots, used, kept
        if table is None:
            table = torch.zeros((4, len(self.moe_layers)), dtype=torch.int64)
        rows, slots, used, kept = table
        stats = dict(layers=self.moe_layers, top_k=self.top_k, replayed_rows=rows, agreeing_slots=slots)
        if self.soft_threshold is not None:  # soft replay uses only the experts it keeps (and refills)
            stats |= dict(used_slots=used, kept_slots=kept)
        return stats

    def _on_first_moe_block(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._sessions or in_recompute():
            return
        hidden = args[0] if args else kwargs["hidden_states"]
        for session in self._sessions:
            session.append((tuple(hidden.shape[:-1]), {}))

    def _router_hook(self, layer: int, position: int, adapter: RouterAdapter):
        p_logits, p_weights, p_indices = adapter.output_positions

        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            if self._routes is None and not self._sessions:
                return None  # idle: no tensor work and nothing torch.compile cannot trace
            native = output[p_indices]  # [N, K]
            recompute = in_recompute()
            indices = native
            replaced = None
            if self._routes is not None:
                n = native.shape[0]
                if n != len(self._routes):
                    routed = f"{self.model_name} routed {n} tokens at layer {layer}"
                    shape = f"token shape {self._token_shape} ({len(self._routes)} tokens)"
                    raise ValueError(f"{routed} but routes were installed for {shape}")
                if self._routes.device != native.device:  # once per install: to the router's device
                    self._routes = self._routes.to(native.device, non_blocking=True)
                    if self._mask is not None:
                        self._mask = self._mask.to(native.device, non_blocking=True)
                installed = self._routes[:, self._columns[layer]].long()  # [N, K]: only this layer widened
                mask = self._mask
                indices = installed if mask is None else torch.where(mask[:, None], installed, native)
                kept = None
                if self.soft_threshold is not None:
                    logits = output[p_logits]
                    indices, kept = soft_replay_indices(indices, native, logits, self.soft_threshold, mask)
                # in the dtype the router returns: ERNIE computes in fp32 and rounds to its input's
                weights = adapter.gate_weights(module, output[p_logits], indices).to(output[p_weights].dtype)
                if kept is not None:  # a row with no replayed expert kept is the router's own output
                    weights = torch.where(kept.any(-1, keepdim=True), weights, output[p_weights])
                replaced = list(output)
                replaced[p_weights] = weights
                replaced[p_indices] = indices
                if not recompute:
                    if self._stats is None:
                        self._stats = native.new_zeros((4, len(self.moe_layers)), dtype=torch.int64)
                    self._stats[:2, position] += agreement_counts(installed, native, mask)
                    if kept is not None:
                        with torch.no_grad():
                            rows = torch.ones_like(kept[:, 0]) if mask is None else mask
                            used = agreement_hits(installed, indices) & rows[:, None]
                            self._stats[2, position] += used.sum()
                            self._stats[3, position] += kept.sum()
            if self._sessions and not recompute:
                used = indices.detach().to(torch.int32)
                for session in self._sessions:
                    if not session:
                        raise RuntimeError("recording started in the middle of a forward pass")
                    session[-1][1][layer] = used
            return None if replaced is None else type(output)(replaced)

        return hook
