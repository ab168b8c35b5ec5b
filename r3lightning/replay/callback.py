"""The Lightning callback: each (micro-)batch's routes aligned to the model's layout, given to the mode."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from r3lightning._keywords import refuse_moved_keywords
from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.packed import PackedTensor
from r3lightning.replay import modes
from r3lightning.replay.backend import RouterReplayBackend
from r3lightning.replay.batch_fields import batch_field, host_attention_mask
from r3lightning.replay.context import record_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.replay.metrics import COUNT_KEYS, ReplayMetrics

Mode = Literal["r3", "r2", "off"]
LayoutFn = Callable[[Tensor], TokenMetadataLayout]  # attention_mask [B, S] -> layout
_MODES = ("r3", "r2", "off")


# 0.1 keywords -> their 0.2 settings
_CALLBACK_MOVED = {
    "log_per_layer": 'log_agreement="per_layer" (per layer) or True (no per-layer metrics)',
    "pad_to_multiple": "layout_fn=functools.partial(TokenMetadataLayout.padded, pad_to_multiple=N)",
}


class RouterReplayCallback(Callback):
    """Replays each training batch's routes in the model's routers, and measures how well they agree.

    Before each training forward it lays the batch's ``routed_experts`` out as the model sees its
    tokens (padding, packing, tensor / context / sequence parallel shards) and installs them; it
    clears them after the step, at epoch end and on any exception: validation, test and predict
    never see stale routes. Rows without a route (or marked missing, -1) route natively;
    layer-sliced routes (``batch.route_layers``) stay sliced. In ``training_step``,
    `micro_batch` replays a micro-batch's own rows and `old_policy_forward` records them for r2.
    The batch is a ``RolloutBatch`` or a mapping with its fields (``attention_mask``,
    ``routed_experts``; optionally ``route_layers``, ``loss_mask``, ``input_ids``).

    Cost per step: host index maths for the layout, non-blocking page-locked host-to-device
    copies of the gather index and of the replay mask, one gather of the routes on their device,
    and the backend's per-router work (see its class). No host sync, except with
    ``validate_routes``, and for a batch without ``lengths_host()`` (a mapping), whose
    ``attention_mask`` is copied back to the host. ``sync_dist`` adds one ``all_reduce`` of the
    counts per step (and one ``all_gather_object`` of the MoE layer ids per fit). The logged
    tensors are read when Lightning's loggers write them.

    Args:
        backend: ``"hf"`` or None: a Hugging Face backend (``HFRouterReplay.for_model``, so one
            already attached to the routers is reused) over the routers of the LightningModule
            (or of its ``model_attr`` submodule), built at each ``on_fit_start``; ``"megatron"``: a
            ``MegatronRouterReplay``, built the same way; or a backend object
            (``RouterReplayBackend``), used as it is for every fit.
        mode: ``"r3"``: replay the routes the rollout engine used; ``"r2"``: replay the routes the
            trainer's own old-policy forward recorded in ``old_policy_forward`` (engines that
            return none; a batch that carries routes replays them as they are); ``"off"``: route
            natively and only measure the agreement with the batch's routes. A backend with soft
            replay (``soft_threshold``) needs ``"r3"`` (``ValueError`` at ``on_fit_start``).
        strict: Raise instead of routing natively: ``ValueError`` when an r3 batch has no routes
            (or a micro-batch of a batch with routes has none), or an r2 step recorded none;
            ``RuntimeError`` when a training forward reaches a router with nothing installed.
            False: warn once per mode and run (rank zero) and count the step in
            ``router_replay/batches_without_routes`` (both checkpointed with the callback's state).
        log_agreement: ``"per_layer"`` (default): log every ``router_replay/`` metric, with
            ``native_agreement/layer_XX`` per MoE layer; True: all but the per-layer ones; False:
            none (and `routing_counts` returns None). Logged per step: ``replayed_fraction``,
            ``native_agreement``, ``used_agreement`` (``soft_kept_fraction`` under soft replay)
            and, in r3 / r2, ``native_loss_tokens``, ``batches_without_routes`` and
            ``missing_rows``.
        validate_routes: Check the expert ids of every install (range, distinct per row): host
            syncs. None: off for a backend the callback builds; a backend object keeps its own
            ``validate`` flag. True / False set that flag.
        layout_fn: ``attention_mask [B, S] -> TokenMetadataLayout``: the layout the routed model
            is fed, given the host left-padded mask. None: the backend's ``build_layout`` (the
            megatron backend's packed layout), else ``TokenMetadataLayout.padded``.
        model_attr: The name of the LightningModule's submodule that holds the routers
            (``pl_module.get_submodule(model_attr)``); None: the module itself.
        sync_dist: Sum the counts over all ranks before taking the ratios (one ``all_reduce``
            per step), so every rank logs the global ratios; each rank's own otherwise.

    Raises:
        ValueError: An unknown ``mode``, ``log_agreement`` or ``backend``, or ``validate_routes``
            for a backend object without a ``validate`` flag.
        TypeError: A keyword of 0.1 (``log_per_layer``, ``pad_to_multiple``); the message names
            its replacement.
    """

    @refuse_moved_keywords(_CALLBACK_MOVED)
    def __init__(
        self,
        backend: str | RouterReplayBackend | None = None,
        mode: Mode = "r3",
        strict: bool = False,
        log_agreement: bool | Literal["per_layer"] = "per_layer",
        *,
        validate_routes: bool | None = None,
        layout_fn: LayoutFn | None = None,
        model_attr: str | None = None,
        sync_dist: bool = False,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if log_agreement not in (True, False, "per_layer"):
            raise ValueError(f"log_agreement must be true, false or 'per_layer', got {log_agreement!r}")
        if not (backend is None or backend in ("hf", "megatron") or isinstance(backend, RouterReplayBackend)):
            raise ValueError(f"backend must be None, 'hf', 'megatron' or a backend object, got {backend!r}")
        self.mode = mode
        self._backend_spec = backend
        self.strict = strict
        self.log_agreement = bool(log_agreement)
        self.validate_routes = validate_routes
        self.layout_fn = layout_fn
        self.model_attr = model_attr
        self.sync_dist = sync_dist
        self.backend = backend if isinstance(backend, RouterReplayBackend) else None
        if self.backend is not None and validate_routes is not None:
            if not hasattr(self.backend, "validate"):
                needs = f"validate_routes={validate_routes} needs a backend with a 'validate' flag"
                raise ValueError(f"{needs}, got {type(self.backend).__name__}")
            self.backend.validate = validate_routes
        self._strict_hooks: list = []
        self._missing = modes.MissingRoutes(strict)
        self._metrics = ReplayMetrics(per_layer=log_agreement == "per_layer", sync_dist=sync_dist)
        self._reset_step()

    def _reset_step(self) -> None:
        self._in_step = False
        self._in_micro = False
        self._missing.counted_step = False
        self._batch: Any = None
        self._step: modes.Install | None = None  # the whole batch's routes
        self._micro: modes.Install | None = None  # the active micro-batch's (None: native)
        self._mode: modes.Replaying | None = None  # Comparing in off mode
        self._r2 = modes.OldPolicyRecorder()

    @staticmethod
    def find(trainer: pl.Trainer) -> "RouterReplayCallback":
        """The first ``RouterReplayCallback`` of the trainer, for `micro_batch` / `old_policy_forward`.

        Args:
            trainer: The running trainer (``self.trainer`` in a LightningModule).

        Raises:
            LookupError: The trainer has none.
        """
        for callback in trainer.callbacks:
            if isinstance(callback, RouterReplayCallback):
                return callback
        raise LookupError("the trainer has no RouterReplayCallback")

    def _routed_module(self, pl_module: pl.LightningModule) -> nn.Module:
        return pl_module if self.model_attr is None else pl_module.get_submodule(self.model_attr)

    def _ensure_backend(self, pl_module: pl.LightningModule) -> RouterReplayBackend:
        if self.backend is None:
            module = self._routed_module(pl_module)
            validate = bool(self.validate_routes)
            if self._backend_spec == "megatron":
                from r3lightning.replay.megatron.replay import MegatronRouterReplay

                self.backend = MegatronRouterReplay(module, validate=validate)
            else:  # for_model: maybe a backend attached earlier (record_routes)
                self.backend = HFRouterReplay.for_model(module)
                self.backend.validate = validate
        if getattr(self.backend, "soft_threshold", None) is not None and self.mode != "r3":
            raise ValueError(
                f"soft replay (the backend's soft_threshold) applies to mode 'r3', got {self.mode!r}"
            )
        if self.strict and not self._strict_hooks:
            # on the routers themselves: the module may call its model without its own forward
            targets = getattr(self.backend, "routers", None) or [self._routed_module(pl_module)]
            self._strict_hooks = [m.register_forward_pre_hook(self._check_installed) for m in targets]
        return self.backend

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Builds the backend for this fit's module (a backend object is kept) and its strict hooks."""
        if not isinstance(self._backend_spec, RouterReplayBackend):
            self.backend = None  # an earlier fit's backend belongs to that fit's module
        self._metrics.new_fit()
        self._ensure_backend(pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Clears the routes and removes the strict hooks."""
        self._clear()
        for hook in self._strict_hooks:
            hook.remove()
        self._strict_hooks = []

    @property
    def batches_without_routes(self) -> int:
        """Steps of this run (rank) with routes expected but none replayed; checkpointed."""
        return self._missing.count

    def state_dict(self) -> dict[str, Any]:
        """``batches_without_routes`` and the modes already warned about."""
        return self._missing.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores `state_dict`'s counts (a state without them loads as zero); malformed: ``ValueError``."""
        self._missing.load_state_dict(state_dict)

    def _check_installed(self, module: nn.Module, args: Any) -> None:
        if not self._in_step or self.mode == "off" or self._r2.recording or self.layout is not None:
            return
        hint = " (wrap the old-policy forward in old_policy_forward(batch))" if self.mode == "r2" else ""
        prefix = f"RouterReplayCallback(strict=True, mode={self.mode!r})"
        raise RuntimeError(f"{prefix}: a training forward ran with no routes installed{hint}")

    @property
    def layout(self) -> TokenMetadataLayout | None:
        """The layout of the active routes (the micro-batch's inside `micro_batch`), None without:
        a packed / sharded model must be fed its tokens in it."""
        active = self._micro if self._in_micro else self._step
        return None if active is None else active.layout

    def build_layout(self, attention_mask: Tensor) -> TokenMetadataLayout:
        """The layout of the tokens the routed model sees.

        Args:
            attention_mask: The batch's host left-padded ``[B, S]`` mask.

        Returns:
            By ``layout_fn``, else the backend's ``build_layout``, else ``padded``; host maths.
        """
        build = self.layout_fn or getattr(self.backend, "build_layout", TokenMetadataLayout.padded)
        return build(attention_mask)

    def align_routes(
        self, routes: PackedTensor, layout: TokenMetadataLayout, layers: tuple[int, ...] | None = None
    ) -> tuple[Tensor, Tensor]:
        """`r3lightning.replay.modes.align_routes` for this callback's backend.

        Args:
            routes: Packed ``[columns, top_k]`` rows, one segment per trajectory.
            layout: The model's token layout (`build_layout`).
            layers: The decoder layer of each column (None: one per decoder layer).

        Returns:
            ``(dense [*token_shape, columns, top_k], bool mask [*token_shape])``; no host sync.
        """
        assert self.backend is not None
        return modes.align_routes(routes, layout, self.backend, layers)

    def _prepare(self, routes: PackedTensor, batch: Any) -> modes.Install:
        layout = self.build_layout(host_attention_mask(batch))
        layers = batch_field(batch, "route_layers")
        layers = None if layers is None else tuple(layers)
        dense, mask = self.align_routes(routes, layout, layers)
        return modes.Install(layout, dense, mask, layers)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Aligns the batch's routes and installs them (r3); opens the step's counts."""
        backend = self._ensure_backend(pl_module)
        self._clear()
        self._in_step = True
        self._batch = batch
        self._r2 = modes.OldPolicyRecorder(batch)
        self._metrics.start(backend, batch)
        mode_cls = modes.Comparing if self.mode == "off" else modes.Replaying
        self._mode = mode_cls(backend, self._metrics if self.log_agreement else None)
        routes = batch_field(batch, "routed_experts")
        if routes is None or routes.num_rows == 0:
            if self.mode == "r3":
                none = "has no routed_experts" if routes is None else "has routed_experts of 0 rows"
                self._missing(self.mode, f"the batch {none}")
            return
        self._set_step(self._prepare(routes, batch))
        if self.log_agreement and self.mode != "off":
            self._metrics.count_missing_rows(routes)

    def _set_step(self, install: modes.Install) -> None:
        self._step = install
        if not self._in_micro:
            self._in_step_mode().use(install)
        if self.log_agreement and self.mode != "off":
            self._metrics.count_native_loss_tokens(install.layout, install.mask, self._batch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Logs the step's ``router_replay/`` metrics and clears the routes."""
        try:
            if self.mode == "r2" and self._mode is not None and not self._mode.installed_any:
                self._missing(self.mode, "no old_policy_forward(batch) in this training step recorded routes")
            if self.log_agreement and self._mode is not None:
                missing = None if self.mode == "off" else self.batches_without_routes
                self._metrics.log(pl_module, self._mode.table(reopen=False), missing=missing)
        finally:
            self._clear()

    def _clear(self, *hook_args: Any) -> None:
        # at epoch end too: a module returning -1 from on_train_batch_start skips on_train_batch_end
        if self.backend is not None:
            self.backend.clear()
        self._reset_step()

    on_exception = on_train_epoch_end = on_validation_start = on_sanity_check_start = _clear
    on_test_start = on_predict_start = _clear

    @contextmanager
    def micro_batch(self, sub_batch: Any) -> Iterator[TokenMetadataLayout | None]:
        """Replays a sub-batch's routes in every forward of the block (recompute included).

        For PPO / GRPO mini- and micro-batches and several passes over one rollout batch: routes
        aligned to the sub-batch's own layout; on exit the step's install is back. No nesting.

        Args:
            sub_batch: A cut of the step's batch (``RolloutBatch.split`` / ``chunk`` /
                ``select``, or a mapping with the same fields): its own ``routed_experts``, or in
                r2 the routes recorded for its rows.

        Yields:
            The sub-batch's layout (feed the model its tokens in it), or None when it has no
            routes: the block routes natively.

        Raises:
            RuntimeError: Outside a training step of this callback, or inside another block.
            ValueError: ``strict`` and an r3 sub-batch of a batch with routes has none.
        """
        if not self._in_step or self.backend is None:
            raise RuntimeError("micro_batch() is only valid inside a training step (with this callback)")
        if self._in_micro:
            raise RuntimeError("micro_batch() blocks cannot nest or overlap: leave the current one first")
        routes = self._r2.routes_of(sub_batch)
        install = None if routes is None else self._prepare(routes, sub_batch)
        if routes is None and self.mode == "r3" and self._step is not None:
            self._missing(self.mode, "a micro-batch of a batch with routes has no routed_experts")
        self._in_micro = True
        self._micro = install
        self._in_step_mode().use(install)
        try:
            yield None if install is None else install.layout
        finally:
            self._in_micro = False
            self._micro = None
            if self._in_step:  # an exception may already have cleared the step
                self._in_step_mode().use(self._step)

    @contextmanager
    def old_policy_forward(self, batch: Any) -> Iterator[None]:
        """r2: records the experts the old-policy forward uses, for later passes over its rows.

        On exit the experts are kept per row of the step's batch, set on ``batch``
        (``routed_experts``, ``route_layers``) and installed: every later forward over those
        rows replays them. A no-op in r3 / off and for rows that have routes already.

        Args:
            batch: The step's batch or a cut of it, which the block's forward covers exactly.

        Raises:
            RuntimeError: No forward of the routed model ran in the block.
            ValueError: The forward's token shape is not ``batch``'s layout, or the layout is
                context-parallel (r2 needs whole sequences on each rank).
        """
        active = self.mode == "r2" and self._in_step and self.backend is not None
        routes = self._r2.routes_of(batch) if active else None
        if not active or (routes is not None and routes.num_rows > 0):  # r3 / off, or recorded already
            yield
            return
        self._r2.recording = True
        try:
            with record_routes(self.backend) as recording:
                yield
        finally:
            self._r2.recording = False
        layout = self.build_layout(host_attention_mask(batch))
        packed = self._r2.keep(recording.routes, layout, batch, self.backend)  # on the layers it routes
        dense, mask = self.align_routes(packed, layout, self._r2.layers)
        install = modes.Install(layout, dense, mask, self._r2.layers)
        if self._in_micro:
            self._micro = install
            self._in_step_mode().use(install)
        step_routes = None if self._step is not None else self._r2.routes_of(self._batch)
        if step_routes is not None:  # every row of the step's batch is recorded now
            self._set_step(install if batch is self._batch else self._prepare(step_routes, self._batch))

    def _in_step_mode(self) -> modes.Replaying:
        """The mode of the step in progress (set by ``on_train_batch_start``)."""
        if self._mode is None:
            raise RuntimeError("RouterReplayCallback: no training step in progress")
        return self._mode

    def routing_counts(self) -> dict[str, Tensor] | None:
        """This step's raw counts so far, per MoE layer of the backend.

        Returns:
            ``{name: int64 [len(moe_layers)]}`` on device for each of `COUNT_KEYS` (``route_rows``,
            ``replayed_rows``, ``native_hits``, ``used_hits``, ``kept_slots``); no host sync.
            None outside a training step or with ``log_agreement=False``.
        """
        if not self._in_step or self._mode is None or not self.log_agreement:
            return None
        return dict(zip(COUNT_KEYS, self._in_step_mode().table().unbind(0), strict=True))
