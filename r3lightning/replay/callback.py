"""Lightning callback that makes every training forward of an MoE model use replayed routes.

Per training batch (``on_train_batch_start``, after the batch reached its device):

1. build the :class:`TokenMetadataLayout` of the tokens the model sees (padded ``[B, S]`` for
   Hugging Face models; a backend may provide its own, e.g. packed / CP / SP for megatron),
2. align the batch's packed ``routed_experts`` to it, padding with ``dummy_routes`` (valid,
   distinct experts) and a replay mask that is False wherever no route was captured,
3. install them into the router replay backend.

Micro-batches: inside ``with callback.micro_batch(sub_batch):`` (``sub_batch`` cut from the step's
``RolloutBatch`` by ``split`` / ``chunk`` / ``select``, trimmed or not) every forward of the
routed model replays that sub-batch's routes in its own layout; on exit the step's install is
back. Several passes over the same sub-batches replay the same routes::

    def training_step(self, batch, batch_idx):
        replay = RouterReplayCallback.find(self.trainer)
        for _ in range(ppo_epochs):
            for mb in batch.chunk(4):
                with replay.micro_batch(mb):
                    loss = self.loss(mb)
                    self.manual_backward(loss)  # recompute inside backward replays mb's routes too

Routes are cleared after the step (``on_train_batch_end``), at the end of each training epoch
(a step the module skips gets no ``on_train_batch_end``), on any exception, and before
validation / test / predict / sanity checking, so no other forward ever sees stale routes.

Modes:

* ``"r3"``: replay the rollout engine's routes (``batch.routed_experts``). A batch without
  routes warns once per run, is counted (``batches_without_routes``) and routes natively;
  ``strict=True`` raises instead.
* ``"r2"``: for engines that return no routes. The LightningModule wraps its no-grad
  old-policy logprob forward in ``callback.old_policy_forward(batch_or_sub_batch)``; the routes
  the trainer used there are stored on that batch (``routed_experts``) and kept for its rows, so
  every later pass over those rows (the batch, or micro-batches cut from it) replays them.
* ``"off"``: native routing; where the batch has routes, the router's choices are compared with
  them, so the mismatch is still logged.

Logged per step (names in ``router_replay/``), from counts kept on device, summed over the
step's forwards, micro-batches and (``sync_dist=True``) ranks before dividing, so each value
is an exact ratio <= 1:

* ``replayed_fraction``: replayed token-layer slots / token-layer slots with a route row,
* ``native_agreement`` and ``native_agreement/layer_XX``: share of the route's experts the
  router picks natively in that forward (the mismatch R3 removes),
* ``used_agreement``: share of the route's experts the forward actually used,
* ``native_loss_tokens``: loss targets whose logprob row had no captured route (r3 / r2),
* ``batches_without_routes``: batches of this run with routes expected but none (r3 / r2).

Agreement values are NaN for a step without a route row. The counting costs no host sync: the
metrics are logged as device tensors, read back when Lightning's logger writes
(``log_every_n_steps``). With ``sync_dist=True`` one ``all_reduce`` of a small int64 vector
per step. ``log_agreement=False`` logs nothing and reduces nothing.

Installing the routes of a ``RolloutBatch`` is otherwise free of device->host syncs (a plain
mapping batch costs one: its attention mask is copied back to build the layout), because the
expert ids are not checked again on install unless ``validate_routes=True``. They were checked
upstream: repeated experts are rejected when the wire response is decoded, ids
``>= num_experts`` when the trajectory enters a ``ReplayBuffer(num_experts=...)``; padding rows
are valid by construction and r2 routes are the router's own. Shapes, dtypes and the replay
mask are still checked on install (tensor metadata only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from r3lightning.align.align import align_packed_token_metadata, build_replay_mask
from r3lightning.align.dummy import dummy_routes
from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.packed import PackedTensor
from r3lightning.ragged import to_device_async
from r3lightning.replay.backend import RouterReplayBackend
from r3lightning.replay.batch_fields import batch_field, host_attention_mask
from r3lightning.replay.metrics import (
    COUNT_KEYS,
    comparison_counts,
    stats_counts,
    step_metrics,
    sum_over_ranks,
)

Mode = Literal["r3", "r2", "off"]
LayoutFn = Callable[[Tensor], TokenMetadataLayout]  # attention_mask [B, S] -> layout
_MODES = ("r3", "r2", "off")
ENGINE_ROUTES_FLAG = "--enable-return-routed-experts"


def _set_batch_field(batch: Any, name: str, value: Any) -> None:
    if isinstance(batch, dict):
        batch[name] = value
    else:
        setattr(batch, name, value)


@dataclass
class _Install:
    """Routes that the forwards of one (micro-)batch replay or are compared with."""

    layout: TokenMetadataLayout
    routes: Tensor  # [*token_shape, L, K], dummy rows where uncaptured
    mask: Tensor  # [*token_shape] bool on the routes' device: True where a route row was captured


class RouterReplayCallback(Callback):
    """Install aligned routes before each training forward; clear them after.

    Args:
        backend: ``"hf"`` / ``None`` (Hugging Face routers found in the LightningModule, or in
            its ``model_attr`` submodule), ``"megatron"``, or a ``RouterReplayBackend`` object.
            String backends are built at each ``on_fit_start`` (after ``configure_model`` and
            sharding) for that fit's module.
        mode: ``"r3"``, ``"r2"`` or ``"off"`` (see the module docstring).
        strict: raise instead of routing natively when a training batch has no routes (r3), when
            no old-policy forward recorded any (r2), or when a forward of the routed model runs
            during a training step with nothing installed.
        log_agreement: log the ``router_replay/`` metrics (counted on device; nothing is logged,
            counted or reduced when False).
        log_per_layer: also log ``native_agreement/layer_XX`` for each MoE layer.
        validate_routes: check the replayed expert ids on every install (range and distinct
            within a row): a pass over the routes and device->host syncs per step. ``None``: off
            for a backend the callback builds or finds (``"hf"`` / ``"megatron"`` / ``None``),
            while a backend object passed in keeps its own ``validate`` flag; ``True`` /
            ``False`` set the flag on either.
        layout_fn: ``attention_mask -> TokenMetadataLayout`` for the tokens the model sees.
            Default: the backend's ``build_layout`` if it has one, else
            ``TokenMetadataLayout.padded(attention_mask, pad_to_multiple=pad_to_multiple)``.
        model_attr: submodule of the LightningModule holding the MoE model (e.g. ``"model"``);
            needed when the module holds several MoE models (a frozen reference, say).
        sync_dist: sum the counts over all ranks before the ratios are taken (one ``all_reduce``
            per step on the default process group; every rank logs the same keys).
    """

    def __init__(
        self,
        backend: str | RouterReplayBackend | None = None,
        mode: Mode = "r3",
        strict: bool = False,
        log_agreement: bool = True,
        *,
        log_per_layer: bool = True,
        validate_routes: bool | None = None,
        layout_fn: LayoutFn | None = None,
        pad_to_multiple: int = 1,
        model_attr: str | None = None,
        sync_dist: bool = False,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if not (backend is None or backend in ("hf", "megatron") or isinstance(backend, RouterReplayBackend)):
            raise ValueError(
                f"backend must be None, 'hf', 'megatron' or a RouterReplayBackend, got {backend!r}"
            )
        self.mode: Mode = mode
        self.strict = strict
        self.log_agreement = log_agreement
        self.log_per_layer = log_per_layer
        self.validate_routes = validate_routes
        self.layout_fn = layout_fn
        self.pad_to_multiple = pad_to_multiple
        self.model_attr = model_attr
        self.sync_dist = sync_dist
        self._backend_spec = backend
        self.backend: RouterReplayBackend | None = (
            backend if isinstance(backend, RouterReplayBackend) else None
        )
        if self.backend is not None and validate_routes is not None:
            if not hasattr(self.backend, "validate"):
                raise ValueError(
                    f"validate_routes={validate_routes} needs a backend with a 'validate' flag, "
                    f"got {type(self.backend).__name__}"
                )
            self.backend.validate = validate_routes
        self._strict_hooks: list = []
        self._recording_r2 = False
        self._warned_r2 = False
        self._warned_missing = False
        self.batches_without_routes = 0  # this run, this rank
        self._logged_layers: tuple[int, ...] | None = None
        self._layer_index: Tensor | None = None  # moe_layers on the metrics' device, built once
        self._reset_step()

    def _reset_step(self) -> None:
        self._in_step = False
        self._batch: Any = None
        self._step: _Install | None = None  # the whole batch's routes
        self._micro: _Install | None = None  # the active micro-batch's routes (None: native)
        self._in_micro = False
        self._compare: _Install | None = None  # off mode: what the open recording is compared with
        self._r2_rows: dict[int, Tensor] = {}  # r2: step-batch row -> recorded rows [n, L, K]
        self._installed_any = False
        self._counts: Tensor | None = None  # [4, moe_layers] int64: comparisons by recording
        self._native_loss_tokens: Tensor | None = None  # int64 scalar on device

    # --------------------------------------------------------------------------------- setup
    @staticmethod
    def find(trainer: pl.Trainer) -> RouterReplayCallback:
        """The trainer's ``RouterReplayCallback`` (for ``micro_batch`` / ``old_policy_forward``)."""
        for callback in trainer.callbacks:
            if isinstance(callback, RouterReplayCallback):
                return callback
        raise LookupError("the trainer has no RouterReplayCallback")

    def _routed_module(self, pl_module: pl.LightningModule) -> nn.Module:
        return pl_module if self.model_attr is None else pl_module.get_submodule(self.model_attr)

    def _ensure_backend(self, pl_module: pl.LightningModule) -> RouterReplayBackend:
        if self.backend is None:
            module = self._routed_module(pl_module)
            if self._backend_spec == "megatron":
                from r3lightning.replay.megatron.replay import MegatronRouterReplay

                self.backend = MegatronRouterReplay(module, validate=bool(self.validate_routes))
            else:
                from r3lightning.replay.hf.replay import HFRouterReplay

                # for_model may return a backend attached earlier (by record_routes, say)
                self.backend = HFRouterReplay.for_model(module)
                self.backend.validate = bool(self.validate_routes)
            self._layer_index = None
        if self.strict and not self._strict_hooks:
            # On the routers themselves when the backend exposes them: the LightningModule may call
            # its model directly rather than through its own forward.
            targets = getattr(self.backend, "routers", None) or [self._routed_module(pl_module)]
            self._strict_hooks = [m.register_forward_pre_hook(self._check_installed) for m in targets]
        return self.backend

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not isinstance(self._backend_spec, RouterReplayBackend):
            # A backend from an earlier fit belongs to that fit's module: look it up again
            # (the same one for the same module) so another module is not routed natively.
            self.backend = None
        self._logged_layers = None
        self._ensure_backend(pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._clear()
        for hook in self._strict_hooks:
            hook.remove()
        self._strict_hooks = []

    def _check_installed(self, module: nn.Module, args: Any) -> None:
        if not self._in_step or self.mode == "off" or self._recording_r2:
            return
        if (self._micro if self._in_micro else self._step) is not None:
            return
        raise RuntimeError(
            f"RouterReplayCallback(strict=True, mode={self.mode!r}): a training forward ran with no routes "
            "installed"
            + (" (wrap the old-policy forward in old_policy_forward(batch))" if self.mode == "r2" else "")
        )

    # ----------------------------------------------------------------------------- layouts
    @property
    def layout(self) -> TokenMetadataLayout | None:
        """Layout of the routes installed now: the active micro-batch's inside ``micro_batch``,
        else the step's (None outside a step or without routes). A packed / sharded model must be
        fed its tokens in this layout."""
        active = self._micro if self._in_micro else self._step
        return None if active is None else active.layout

    def build_layout(self, attention_mask: Tensor) -> TokenMetadataLayout:
        """Layout of the tokens the routed model sees for a host left-padded ``[B, S]`` mask."""
        if self.layout_fn is not None:
            return self.layout_fn(attention_mask)
        backend_layout = getattr(self.backend, "build_layout", None)
        if backend_layout is not None:
            return backend_layout(attention_mask)
        return TokenMetadataLayout.padded(attention_mask, pad_to_multiple=self.pad_to_multiple)

    def align_routes(self, routes: PackedTensor, layout: TokenMetadataLayout) -> tuple[Tensor, Tensor]:
        """Dense routes ``[*token_shape, L, K]`` (dummy routes where uncaptured) and the replay mask
        ``[*token_shape]`` on the routes' device. Host work only; no device->host sync."""
        backend = self.backend
        assert backend is not None
        if tuple(routes.row_shape) != (backend.num_layers, backend.top_k):
            raise ValueError(
                f"batch.routed_experts rows must be [num_layers={backend.num_layers}, top_k={backend.top_k}], "
                f"got {tuple(routes.row_shape)}"
            )

        def pad(n: int) -> Tensor:
            return dummy_routes(
                n, backend.num_layers, backend.top_k, backend.num_experts, device=routes.device
            )

        dense = align_packed_token_metadata(routes, layout, pad=pad)
        mask = build_replay_mask(routes.lengths, layout)  # host
        return dense, to_device_async(mask, dense.device)  # staged through page-locked memory

    def _prepare(self, routes: PackedTensor, batch: Any) -> _Install:
        layout = self.build_layout(host_attention_mask(batch))
        dense, mask = self.align_routes(routes, layout)
        return _Install(layout, dense, mask)

    # ------------------------------------------------------------------------- training loop
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._ensure_backend(pl_module)
        self._clear()
        self._in_step = True
        self._batch = batch
        routes = batch_field(batch, "routed_experts")
        if routes is None or routes.num_rows == 0:
            if self.mode == "r3":
                self._missing_routes("the batch has no routed_experts")
            return
        self._step = self._prepare(routes, batch)
        self._use(self._step)
        self._count_native_loss_tokens(self._step, batch)

    def _use(self, install: _Install | None) -> None:
        """Make the forwards from now on replay (or, off mode, be compared with) ``install``;
        ``None``: native routing."""
        backend = self.backend
        assert backend is not None
        if self.mode == "off":
            if self.log_agreement:
                self._close_comparison()
                if install is not None:
                    backend.start_recording()
                    self._compare = install
            return
        if install is None:  # keep what the backend counted so far, then route natively
            if self.log_agreement:
                self._fold_backend_stats()
            backend.clear()
            return
        backend.install(install.routes, install.mask)
        self._installed_any = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        try:
            if self.mode == "r2" and not self._installed_any:
                self._missing_routes("no old_policy_forward(batch) in this training step recorded routes")
            if self.log_agreement and self.backend is not None:
                self._close_comparison()
                self._log(pl_module)
        finally:
            self._clear()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._clear()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A module returning -1 from on_train_batch_start ends the epoch after the install and
        # without on_train_batch_end; callbacks run before the module's own epoch-end hook.
        self._clear()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clear()

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clear()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clear()

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._clear()

    def _clear(self) -> None:
        if self.backend is not None:
            self.backend.clear()
        self._reset_step()

    def _missing_routes(self, reason: str) -> None:
        """A batch that should carry routes replays none: raise (strict) or warn once and count."""
        if self.strict:
            raise ValueError(
                f"RouterReplayCallback(mode={self.mode!r}, strict=True): {reason}"
                + (f"; start the rollout engine with {ENGINE_ROUTES_FLAG}" if self.mode == "r3" else "")
            )
        self.batches_without_routes += 1
        if self.mode == "r2":
            if not self._warned_r2:
                self._warned_r2 = True
                rank_zero_warn(f"RouterReplayCallback(mode='r2'): {reason}; nothing was replayed")
            return
        if not self._warned_missing:
            self._warned_missing = True
            rank_zero_warn(
                f"RouterReplayCallback(mode='r3'): {reason}, so it routes natively. Is the rollout engine "
                f"started with {ENGINE_ROUTES_FLAG} and asked for routes? Such batches are counted in "
                "router_replay/batches_without_routes (warned once per run; strict=True raises)."
            )

    # ---------------------------------------------------------------------------- micro-batches
    @contextmanager
    def micro_batch(self, sub_batch: Any) -> Iterator[TokenMetadataLayout | None]:
        """Replay ``sub_batch``'s routes in every forward of the block (and its recompute).

        ``sub_batch`` is a ``RolloutBatch`` cut from the step's batch (``split`` / ``chunk`` /
        ``select`` / indexing, trimmed or not; its routes travel with its rows) or any batch with
        its own ``routed_experts``. Its routes are aligned to its own layout (the backend's: packed,
        CP / SP for megatron) and installed; rows without a captured route route natively, and so
        does a sub-batch without ``routed_experts`` (r3: counted as a batch without routes
        unless its step's batch was). In r2 the rows recorded
        by ``old_policy_forward`` are replayed. Yields the layout (None without routes). Run the
        backward of the block's forwards inside the block. On exit the step's routes are back.
        Blocks cannot nest or overlap; outside a training step it is an error.
        """
        if not self._in_step or self.backend is None:
            raise RuntimeError(
                "micro_batch() is only valid inside a training step with a RouterReplayCallback"
            )
        if self._in_micro:
            raise RuntimeError(
                "micro_batch() blocks cannot nest or overlap: leave the current micro-batch block first"
            )
        install = None
        routes = self._routes_of(sub_batch)
        if routes is not None:  # rows without a captured route (all, maybe) route natively
            install = self._prepare(routes, sub_batch)
        elif self.mode == "r3" and self._step is not None:  # (a routeless step counted already)
            self._missing_routes("a micro-batch of a batch with routes has no routed_experts")
        self._in_micro = True
        self._micro = install
        self._use(install)
        try:
            yield None if install is None else install.layout
        finally:
            self._in_micro = False
            self._micro = None
            if self._in_step:  # an exception may already have cleared the step
                self._use(self._step)

    def _routes_of(self, batch: Any) -> PackedTensor | None:
        """``batch.routed_experts``, else (r2) the rows recorded for it earlier in this step."""
        routes = batch_field(batch, "routed_experts")
        if routes is not None or not self._r2_rows:
            return routes
        rows = self._rows_in_step(batch)
        if rows is None or not all(int(r) in self._r2_rows for r in rows):
            return None
        packed = PackedTensor.from_segments([self._r2_rows[int(r)] for r in rows])
        _set_batch_field(batch, "routed_experts", packed)
        return packed

    def _rows_in_step(self, batch: Any) -> Tensor | None:
        rows_in = getattr(batch, "rows_in", None)
        if batch is self._batch:
            return torch.arange(len(batch_field(batch, "attention_mask")))
        return rows_in(self._batch) if callable(rows_in) and self._batch is not None else None

    # -------------------------------------------------------------------------------- r2
    @contextmanager
    def old_policy_forward(self, batch: Any) -> Iterator[None]:
        """Wrap the old-policy (no-grad) forward over ``batch`` (the step's batch or a micro-batch
        cut from it) of a training step.

        r2: records the experts used and stores them packed per trajectory on
        ``batch.routed_experts`` and for those rows of the step's batch, so every later pass over
        them replays them: ``micro_batch`` blocks over (re-cut) sub-batches, and, once every row
        of the step's batch is recorded, the rest of the step (installed like r3 routes, and set
        on the step's ``batch.routed_experts``). Inside ``micro_batch(batch)`` the recorded routes
        replay for the rest of that block. Rows recorded already are not recorded again.
        r3 / off: does nothing. The block must run exactly one forward over ``batch``.
        """
        if (
            self.mode != "r2"
            or self.backend is None
            or not self._in_step
            or self._routes_of(batch) is not None
        ):
            yield  # r3 / off, or routes already recorded for these rows (an earlier pass)
            return
        backend = self.backend
        backend.start_recording()
        self._recording_r2 = True
        try:
            yield
        except BaseException:
            backend.clear()
            raise
        finally:
            self._recording_r2 = False
        recorded = backend.stop_recording()  # [*token_shape, L, K]
        layout = self.build_layout(host_attention_mask(batch))
        if tuple(recorded.shape[:-2]) != layout.token_shape:
            raise ValueError(
                f"old_policy_forward recorded token shape {tuple(recorded.shape[:-2])}, expected one forward "
                f"over the batch with token shape {layout.token_shape}"
            )
        packed = self.pack_recorded(recorded, layout)
        _set_batch_field(batch, "routed_experts", packed)
        rows = self._rows_in_step(batch)
        if rows is not None:
            for i, row in enumerate(rows.tolist()):  # host positions
                self._r2_rows[row] = packed[i]
        install = _Install(layout, *self.align_routes(packed, layout))
        if self._in_micro:
            self._micro = install
            self._use(install)
        step_routes = None if self._step is not None else self._routes_of(self._batch)
        if step_routes is not None:  # every row of the step's batch is recorded now
            self._step = install if batch is self._batch else self._prepare(step_routes, self._batch)
            self._count_native_loss_tokens(self._step, self._batch)
            if not self._in_micro:
                self._use(self._step)

    @staticmethod
    def pack_recorded(recorded: Tensor, layout: TokenMetadataLayout) -> PackedTensor:
        """Recorded ``[*token_shape, L, K]`` -> per-trajectory packed rows (real tokens, in order)."""
        if layout.cp_size != 1:
            raise ValueError("r2 needs the whole sequence on each rank: context parallelism is not supported")
        real = (layout.position_sequence >= 0).nonzero().reshape(-1)  # host, sequence-major order
        rows = recorded.reshape(-1, *recorded.shape[-2:]).index_select(
            0, to_device_async(real, recorded.device)
        )
        return PackedTensor.from_lengths(rows, layout.sequence_lengths)

    # ----------------------------------------------------------------------------- metrics
    def _count_native_loss_tokens(self, install: _Install, batch: Any) -> None:
        """Loss targets of the step's batch whose logprob row (``t - 1``) has no captured route
        (they route natively): counted once per step, on device."""
        if not self.log_agreement or self.mode == "off":
            return
        loss_mask = batch_field(batch, "loss_mask")
        if loss_mask is None:
            return
        target_next = install.layout.from_batch(loss_mask, next_token=True) > 0
        self._native_loss_tokens = (target_next & ~install.mask.to(target_next.device)).sum()

    def _metric_device(self) -> torch.device:
        batch = self._batch
        ids = batch_field(batch, "input_ids") if batch is not None else None
        return ids.device if isinstance(ids, Tensor) else torch.device("cpu")

    def _layers_on(self, device: torch.device) -> Tensor:
        assert self.backend is not None
        if self._layer_index is None or self._layer_index.device != device:
            self._layer_index = to_device_async(torch.tensor(self.backend.moe_layers), device)
        return self._layer_index

    def _add_counts(self, table: Tensor) -> None:
        self._counts = table if self._counts is None else self._counts + table.to(self._counts.device)

    def _close_comparison(self) -> None:
        """Off mode: stop the open recording and count how far its forwards agree with the routes."""
        install, self._compare = self._compare, None
        if install is None or self.backend is None:
            return
        try:
            used = self.backend.stop_recording()  # [*token_shape', L, K]
        except (RuntimeError, ValueError):
            # no forward, or forwards of token shapes that cannot be joined: nothing to compare
            return
        table = comparison_counts(install.routes, install.mask, used, self._layers_on(used.device))
        if table is not None:
            self._add_counts(table)

    def _fold_backend_stats(self) -> None:
        assert self.backend is not None
        self._add_counts(
            stats_counts(self.backend.routing_stats(), self.backend.top_k, self._metric_device())
        )

    def routing_counts(self) -> dict[str, Tensor] | None:
        """This step's counts so far, int64 ``[len(backend.moe_layers)]`` each on device (no sync):
        ``route_rows`` (rows with a route row, per forward), ``replayed_rows``, ``native_hits`` /
        ``used_hits`` (route experts the router picked natively / the forward used); zeros before
        anything was counted. None outside a step or when ``log_agreement`` is False. In off mode the forwards recorded so far are
        compared now and the recording goes on for the later ones."""
        if not self._in_step or self.backend is None or not self.log_agreement:
            return None
        if self.mode == "off" and self._compare is not None:
            install = self._compare
            self._close_comparison()
            self.backend.start_recording()
            self._compare = install
        counts = self._counts
        if self.mode != "off":
            saved, self._counts = self._counts, None
            self._fold_backend_stats()
            counts, self._counts = self._counts, saved
            if saved is not None:
                counts = counts + saved.to(counts.device)  # type: ignore[operator]
        if counts is None:  # nothing counted yet: zeros, so every rank logs the same keys
            counts = torch.zeros(
                (4, len(self.backend.moe_layers)), dtype=torch.int64, device=self._metric_device()
            )
        return dict(zip(COUNT_KEYS, counts.unbind(0), strict=True))

    def _global_layers(self) -> tuple[int, ...]:
        """MoE layers any rank routes (pipeline stages differ), gathered once per fit."""
        assert self.backend is not None
        if self._logged_layers is None:
            layers = set(self.backend.moe_layers)
            if self.sync_dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                gathered: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, tuple(self.backend.moe_layers))
                layers = {layer for rank_layers in gathered for layer in rank_layers}
            self._logged_layers = tuple(sorted(layers))
        return self._logged_layers

    def _log(self, pl_module: pl.LightningModule) -> None:
        backend = self.backend
        assert backend is not None
        counts = self.routing_counts()
        device = self._metric_device()
        # [4, num_layers] by absolute layer (pipeline stages hold different layers), then scalars
        table = torch.zeros((4, backend.num_layers), dtype=torch.int64, device=device)
        if counts is not None:
            local = torch.stack([counts[k] for k in COUNT_KEYS])
            table.index_copy_(1, self._layers_on(device), local.to(device))
        extra = torch.zeros(2, dtype=torch.int64, device=device)
        if self._native_loss_tokens is not None:
            extra[0] += self._native_loss_tokens.to(device)
        extra[1] += self.batches_without_routes
        vector = torch.cat([table.reshape(-1), extra])
        layers = self._global_layers()
        if self.sync_dist:
            vector = sum_over_ranks(vector)  # exact ratios over all ranks; no host sync
        totals = vector[: table.numel()].reshape(table.shape).double()
        native_loss_tokens, missing = vector[table.numel() :].unbind(0)
        metrics = step_metrics(totals, top_k=backend.top_k, layers=layers if self.log_per_layer else None)
        if self.mode != "off":
            metrics["native_loss_tokens"] = native_loss_tokens
            metrics["batches_without_routes"] = missing
        for name, value in metrics.items():
            pl_module.log(
                f"router_replay/{name}",
                value.float(),
                on_step=True,
                on_epoch=False,
                batch_size=1,
                sync_dist=False,  # already summed over ranks above (sync_dist=True)
            )
