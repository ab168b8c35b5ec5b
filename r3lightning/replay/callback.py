"""Lightning callback that makes every training forward of an MoE model use replayed routes.

Per training batch (``on_train_batch_start``, after the batch reached its device):

1. build the :class:`TokenMetadataLayout` of the tokens the model sees (padded ``[B, S]`` for
   Hugging Face models; a backend may provide its own, e.g. packed / CP / SP for megatron),
2. align the batch's packed ``routed_experts`` to it, padding with ``dummy_routes`` (valid,
   distinct experts) and a replay mask that is False wherever no route was captured,
3. install them into the router replay backend.

Routes are cleared after the step (``on_train_batch_end``), at the end of each training epoch
(a step the module skips gets no ``on_train_batch_end``), on any exception, and before
validation / test / predict / sanity checking, so no other forward ever sees stale routes.

Modes:

* ``"r3"``: replay the rollout engine's routes (``batch.routed_experts``).
* ``"r2"``: for engines that return no routes. The LightningModule wraps its no-grad
  old-policy logprob forward in ``callback.old_policy_forward(batch)``; the routes the trainer
  used there are installed for the rest of the step and stored on the batch
  (``batch.routed_experts``), so every later update pass over the same batch object replays them
  (routes a batch already carries at batch start are installed as in r3)::

      def training_step(self, batch, batch_idx):
          with RouterReplayCallback.find(self.trainer).old_policy_forward(batch), torch.no_grad():
              old_logprobs = self.batch_logprobs(batch)
          for _ in range(self.update_passes):  # manual optimisation
              ...  # forwards here replay the old-policy routes

* ``"off"``: native routing; where the batch has routes, the experts the trainer chose are
  recorded and compared with them, so the mismatch is still logged.

Logged per step (``router_replay/...``): ``replayed_fraction`` (real tokens whose routes are
replayed; ``captured_fraction`` in off mode), ``native_loss_tokens`` (loss-target rows routed
natively: no captured route), ``agreement`` and ``agreement/layer_XX`` (replayed experts the
router would have chosen itself; in off mode, rollout experts the router chose natively).
Agreement costs one device->host sync per step; ``log_agreement=False`` skips it.
``native_loss_tokens`` is counted on the batch's device and logged as a tensor, so it is read
back only when Lightning's logger writes (every ``log_every_n_steps``).

Installing the routes of a ``RolloutBatch`` is otherwise free of device->host syncs (a plain
mapping batch costs one: its attention mask is copied back to build the layout), because the
expert ids are not checked again on install unless ``validate_routes=True``. They were checked
upstream: repeated experts are rejected when the wire response is decoded, ids
``>= num_experts`` when the trajectory enters a ``ReplayBuffer(num_experts=...)``; padding rows
are valid by construction and r2 routes are the router's own. Shapes, dtypes and the replay
mask are still checked on install (tensor metadata only).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from ..align.align import align_packed_token_metadata, build_replay_mask
from ..align.dummy import dummy_routes
from ..align.layout import TokenMetadataLayout
from ..packed import PackedTensor
from ..ragged import to_device_async
from .backend import RouterReplayBackend, agreement_hits
from .batch_fields import batch_field, host_attention_mask

Mode = Literal["r3", "r2", "off"]
LayoutFn = Callable[[Tensor], TokenMetadataLayout]  # attention_mask [B, S] -> layout
_MODES = ("r3", "r2", "off")


def _set_batch_field(batch: Any, name: str, value: Any) -> None:
    if isinstance(batch, dict):
        batch[name] = value
    else:
        setattr(batch, name, value)


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
        log_agreement: log native-vs-replayed agreement (one host sync per step).
        log_per_layer: also log the agreement of each MoE layer.
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
        sync_dist: reduce logged metrics across ranks.
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
        self._in_step = False
        self._layout: TokenMetadataLayout | None = None
        self._aligned: Tensor | None = None  # the step's routes [*token_shape, L, K], to compare with
        self._mask: Tensor | None = None
        self._metrics: dict[str, Tensor | float] = {}
        self._strict_hooks: list = []
        self._recording_r2 = False
        self._warned_r2 = False

    # --------------------------------------------------------------------------------- setup
    @staticmethod
    def find(trainer: pl.Trainer) -> RouterReplayCallback:
        """The trainer's ``RouterReplayCallback`` (for ``old_policy_forward`` in a LightningModule)."""
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
                from .megatron import MegatronRouterReplay

                self.backend = MegatronRouterReplay(module, validate=bool(self.validate_routes))
            else:
                from .hf import HFRouterReplay

                # for_model may return a backend attached earlier (by record_routes, say)
                self.backend = HFRouterReplay.for_model(module)
                self.backend.validate = bool(self.validate_routes)
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
        self._ensure_backend(pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._clear()
        for hook in self._strict_hooks:
            hook.remove()
        self._strict_hooks = []

    def _check_installed(self, module: nn.Module, args: Any) -> None:
        if not self._in_step or self.mode == "off" or self._recording_r2 or self._layout is not None:
            return
        raise RuntimeError(
            f"RouterReplayCallback(strict=True, mode={self.mode!r}): a training forward ran with no routes "
            "installed"
            + (" (wrap the old-policy forward in old_policy_forward(batch))" if self.mode == "r2" else "")
        )

    # ----------------------------------------------------------------------------- layouts
    @property
    def layout(self) -> TokenMetadataLayout | None:
        """Layout of the current training step's installed routes (None outside a step or
        without routes): a packed / sharded model must be fed its tokens in this layout."""
        return self._layout

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
        return dense, build_replay_mask(routes.lengths, layout)  # mask on the host

    # ------------------------------------------------------------------------- training loop
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._ensure_backend(pl_module)
        self._clear()
        self._in_step = True
        attention_mask = host_attention_mask(batch)
        routes = batch_field(batch, "routed_experts")
        if routes is None:
            if self.strict and self.mode == "r3":
                raise ValueError(
                    "batch.routed_experts is None: the rollout engine returned no routes (mode='r3', strict)"
                )
            if self.mode == "r3":
                self._metrics["replayed_fraction"] = 0.0
            return
        self._install(routes, self.build_layout(attention_mask), batch)

    def _install(self, routes: PackedTensor, layout: TokenMetadataLayout, batch: Any) -> None:
        backend = self.backend
        assert backend is not None
        dense, host_mask = self.align_routes(routes, layout)
        mask = to_device_async(host_mask, dense.device)  # staged through page-locked memory
        self._layout, self._aligned, self._mask = layout, dense, mask
        self._record_coverage(layout, host_mask, mask, batch)
        if self.mode == "off":
            if self.log_agreement:  # compare what the router chooses natively with the rollout
                backend.start_recording()
        else:
            backend.install(dense, mask)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        try:
            if self.backend is not None and self.log_agreement:
                self._collect_agreement()
            self._log(pl_module, batch)
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
        self._in_step = False
        self._layout = self._aligned = self._mask = None
        self._metrics = {}

    # -------------------------------------------------------------------------------- r2
    @contextmanager
    def old_policy_forward(self, batch: Any) -> Iterator[None]:
        """Wrap the old-policy (no-grad) forward over ``batch`` of a training step.

        r2: records the experts used, installs them for the rest of the step and stores them
        packed per trajectory on ``batch.routed_experts`` for later passes over the batch object.
        r3 / off: does nothing (the installed rollout routes already apply). The block must run
        exactly one forward over the whole batch.
        """
        if self.mode != "r2" or self.backend is None or not self._in_step or self._layout is not None:
            yield  # r3 / off, or routes already installed (recorded in an earlier pass)
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
        self._install(packed, layout, batch)

    @staticmethod
    def pack_recorded(recorded: Tensor, layout: TokenMetadataLayout) -> PackedTensor:
        """Recorded ``[*token_shape, L, K]`` -> per-trajectory packed rows (real tokens, in order)."""
        if layout.cp_size != 1:
            raise ValueError("r2 needs the whole sequence on each rank: context parallelism is not supported")
        real = (layout.position_sequence >= 0).nonzero().reshape(-1)  # host, sequence-major order
        rows = recorded.reshape(-1, *recorded.shape[-2:]).index_select(0, real.to(recorded.device))
        return PackedTensor.from_lengths(rows, layout.sequence_lengths)

    # ----------------------------------------------------------------------------- metrics
    def _record_coverage(
        self, layout: TokenMetadataLayout, host_mask: Tensor, mask: Tensor, batch: Any
    ) -> None:
        real_tokens = int(layout.token_mask.sum())  # host tensors: no sync
        covered = int(host_mask.sum()) / max(real_tokens, 1)
        if self.mode == "off":  # nothing is replayed; every loss target routes natively
            self._metrics["captured_fraction"] = covered
            return
        self._metrics["replayed_fraction"] = covered
        loss_mask = batch_field(batch, "loss_mask")
        if loss_mask is not None:
            # row t feeds the logprob of token t + 1: it matters where token t + 1 is a loss target
            target_next = layout.from_batch(loss_mask, next_token=True) > 0
            self._metrics["native_loss_tokens"] = (target_next & ~mask.to(target_next.device)).sum()

    def _collect_agreement(self) -> None:
        backend = self.backend
        assert backend is not None
        if self.mode == "off":
            if self._aligned is None:
                return
            try:
                native = backend.stop_recording()
            except (RuntimeError, ValueError):
                # no forward of the routed model in this step, or forwards of token shapes that
                # cannot be joined (micro-batches): the metric is skipped, the step must not fail
                return
            token_shape = self._aligned.shape[:-2]
            if native.shape[:-2] != token_shape:  # several forwards: compare the first
                native = native.narrow(len(token_shape) - 1, 0, token_shape[-1])
            hits, num_rows = self.agreement_with_routes(native)
            rows = torch.full_like(hits, num_rows)
            stats = {"layers": backend.moe_layers, "replayed_rows": rows.cpu(), "agreeing_slots": hits.cpu()}
        else:
            stats = backend.routing_stats()
        if "agreeing_slots" not in stats:
            return
        slots = stats["replayed_rows"].double() * backend.top_k
        if float(slots.sum()) == 0:
            return
        agreeing = stats["agreeing_slots"].double()
        self._metrics["agreement"] = float(agreeing.sum() / slots.sum())
        if self.log_per_layer:
            for layer, hit, total in zip(stats["layers"], agreeing.tolist(), slots.tolist(), strict=True):
                if total:
                    self._metrics[f"agreement/layer_{layer:02d}"] = hit / total

    def agreement_with_routes(self, used: Tensor) -> tuple[Tensor, int]:
        """How far ``used`` ``[*token_shape, L, K]`` (experts a forward of this step used) agrees
        with the routes the step installed (or, in off mode, compares with), on their rows with a
        captured route: int64 ``[len(moe_layers)]`` slots whose expert ``used`` also holds, on
        ``used``'s device, and the number of rows. One device->host sync (the masked selection).
        """
        if self._aligned is None or self._mask is None or self.backend is None:
            raise RuntimeError("no routes were installed in this training step")
        layers = list(self.backend.moe_layers)
        mask = self._mask.to(used.device)
        routes = self._aligned.to(used.device)[..., layers, :][mask].long()  # [rows, moe_layers, K]
        ours = used[..., layers, :][mask].long()
        return agreement_hits(routes, ours).sum(dim=(0, 2)), routes.shape[0]

    def _log(self, pl_module: pl.LightningModule, batch: Any) -> None:
        if self.mode == "r2" and self._layout is None and not self._warned_r2:
            self._warned_r2 = True
            warnings.warn(
                "RouterReplayCallback(mode='r2'): no old_policy_forward(batch) in this training step, "
                "nothing was replayed",
                stacklevel=2,
            )
        if not self._metrics:
            return
        input_ids = batch_field(batch, "input_ids")
        batch_size = int(input_ids.shape[0]) if input_ids is not None else 1
        for name, value in self._metrics.items():
            pl_module.log(
                f"router_replay/{name}",
                value.float() if isinstance(value, Tensor) else float(value),
                on_step=True,
                on_epoch=False,
                batch_size=batch_size,
                sync_dist=self.sync_dist,
            )
