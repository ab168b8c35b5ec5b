"""The ``router_replay/...`` metrics: ratios of int64 counts summed on device, without host syncs."""

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.packed import PackedTensor
from r3lightning.ragged import to_device_async
from r3lightning.replay.backend import RouterReplayBackend, agreement_hits, route_columns
from r3lightning.replay.batch_fields import batch_field

# route_rows: rows with a route row (per forward and layer); replayed_rows: those replayed;
# native_hits / used_hits: route experts the router picked natively / the forward used;
# kept_slots: replayed slots soft replay kept (0 without soft replay)
COUNT_KEYS = ("route_rows", "replayed_rows", "native_hits", "used_hits", "kept_slots")
COUNTS = len(COUNT_KEYS)


def comparison_counts(
    routes: Tensor, mask: Tensor, used: Tensor, layers: Tensor, columns: Tensor | None = None
) -> Tensor | None:
    """Counts comparing the experts some forwards used with the routes they were measured against.

    Args:
        routes: Integer ``[*token_shape, C, K]`` (off mode: the batch's aligned routes).
        mask: bool ``[*token_shape]``: the rows with a route.
        used: Integer ``[*lead, joined, L, K]``: what the forwards used, as ``stop_recording``
            returns it (several forwards joined along the last token axis).
        layers: int64 ``[M]`` on ``used``'s device: the decoder layers compared (the MoE layers).
        columns: int64 ``[M]``: the routes' column of each of ``layers`` (None: the layers
            themselves, ``C = L``).

    Returns:
        int64 ``[COUNTS, M]`` on ``used``'s device (route rows times forwards, 0, hits, hits, 0),
        or None when the shapes do not fit (then nothing can be compared). No host sync.
    """
    *lead, width = routes.shape[:-2]
    *used_lead, joined = used.shape[:-2]  # forwards joined along the last token axis
    if used_lead != lead or width == 0 or joined % width:
        return None
    forwards = joined // width
    used = used.reshape(*lead, forwards, width, *used.shape[-2:]).movedim(len(lead), 0)
    routes = routes.to(used.device).index_select(
        -2, layers if columns is None else columns
    )  # [..., L_moe, K]
    keep = mask.to(used.device)[..., None, None]
    hits = agreement_hits(routes, used.index_select(-2, layers)) & keep
    hits = hits.sum(dim=(*range(used.dim() - 2), -1))  # [L_moe] over all forwards
    rows = keep.sum().expand(len(layers)) * forwards
    zeros = torch.zeros_like(rows)
    return torch.stack([rows, zeros, hits, hits, zeros])


def step_metrics(
    table: Tensor, *, top_k: int, layers: tuple[int, ...] | None, soft: bool = False
) -> dict[str, Tensor]:
    """The ``router_replay/`` ratios of a step's counts.

    Args:
        table: ``[COUNTS, num_layers]`` counts by absolute decoder layer (floating, so the
            ratios divide exactly).
        top_k: Experts per token.
        layers: The layers to report ``native_agreement/layer_XX`` for (None or empty: none).
        soft: Also ``soft_kept_fraction``, the share of replayed slots soft replay kept.

    Returns:
        ``{name: [] tensor}``: ``replayed_fraction`` (0 without route rows),
        ``native_agreement``, ``used_agreement`` and the per-layer ratios (NaN without route
        rows). Device arithmetic; no host sync.
    """
    route_rows, replayed_rows, native_hits, used_hits, kept_slots = table
    rows = route_rows.sum()
    replayed = torch.where(rows > 0, replayed_rows.sum() / rows.clamp(min=1), 0.0)
    slots = rows * top_k
    metrics = {"replayed_fraction": replayed, "native_agreement": native_hits.sum() / slots}
    metrics["used_agreement"] = used_hits.sum() / slots
    if soft:
        replayed_slots = replayed_rows.sum() * top_k
        metrics["soft_kept_fraction"] = kept_slots.sum() / replayed_slots.clamp(min=1)
    if layers:
        per_layer = native_hits / (route_rows * top_k)  # [num_layers]
        for layer in layers:
            metrics[f"native_agreement/layer_{layer:02d}"] = per_layer[layer]
    return metrics


class ReplayMetrics:
    """One training step's counts on device and their logging.

    Args:
        per_layer: Log ``native_agreement/layer_XX`` for every MoE layer of any rank.
        sync_dist: Sum the counts over all ranks before taking the ratios (one ``all_reduce`` per
            step, and one ``all_gather_object`` of the MoE layers per fit).
    """

    def __init__(self, *, per_layer: bool, sync_dist: bool) -> None:
        self.per_layer = per_layer
        self.sync_dist = sync_dist
        self.backend: RouterReplayBackend | None = None
        self.device = torch.device("cpu")
        self._layers: tuple[int, ...] | None = None  # MoE layers of any rank, gathered once per fit
        self._index: Tensor | None = None  # backend.moe_layers on the metrics' device, built once
        self._table: Tensor | None = None  # [COUNTS, moe_layers] int64
        self._native_loss_tokens: Tensor | None = None  # int64 scalar
        self._missing_rows: Tensor | None = None  # int64 scalar: route rows marked missing (-1)

    def new_fit(self) -> None:
        """Forget the MoE layers gathered for the last fit (a new module may hold others)."""
        self._layers = None

    def start(self, backend: RouterReplayBackend, batch: Any) -> None:
        """Opens a step.

        Args:
            backend: The backend of the step.
            batch: The step's batch: the counts live on its ``input_ids``' device (CPU without).
        """
        if backend is not self.backend:
            self.backend = backend
            self._index = None
        ids = batch_field(batch, "input_ids")
        self.device = ids.device if isinstance(ids, Tensor) else torch.device("cpu")
        self._table = None
        self._native_loss_tokens = None
        self._missing_rows = None

    def layer_index(self, device: torch.device) -> Tensor:
        """The backend's ``moe_layers`` as int64 ``[M]`` on ``device`` (cached: one copy per backend).

        Args:
            device: Where the index goes.

        Returns:
            int64 ``[len(moe_layers)]``.
        """
        assert self.backend is not None
        if self._index is None or self._index.device != device:
            self._index = to_device_async(torch.tensor(self.backend.moe_layers), device)
        return self._index

    def column_index(self, layers: tuple[int, ...] | None, device: torch.device) -> Tensor:
        """Each MoE layer's column in routes whose columns are decoder ``layers``.

        Args:
            layers: The decoder layer of each route column (None: column ``i`` is layer ``i``).
            device: Where the index goes.

        Returns:
            int64 ``[len(moe_layers)]`` on ``device`` (one non-blocking copy).
        """
        assert self.backend is not None
        if layers is None:
            return self.layer_index(device)
        columns = list(route_columns(self.backend, layers).values())
        return to_device_async(torch.tensor(columns), device)

    def add(self, table: Tensor) -> None:
        """Adds counts ``[COUNTS, len(moe_layers)]`` (from `comparison_counts` or `backend_counts`).

        Args:
            table: The counts, on any device.
        """
        self._table = table if self._table is None else self._table + table.to(self._table.device)

    def backend_counts(self) -> Tensor:
        """The replaying backend's stats since its last clear as counts ``[COUNTS, moe_layers]``."""
        assert self.backend is not None
        stats = self.backend.routing_stats()
        replayed = stats["replayed_rows"]
        native = stats["agreeing_slots"]
        used = stats.get("used_slots")
        used = replayed * self.backend.top_k if used is None else used
        kept = stats.get("kept_slots", torch.zeros_like(replayed))
        counts = (replayed, replayed, native, used, kept)
        return torch.stack([to_device_async(t, self.device).long() for t in counts])

    def table(self, *, with_backend: bool) -> Tensor:
        """The step's counts so far.

        Args:
            with_backend: Add the backend's counts since its last clear (replaying modes).

        Returns:
            int64 ``[COUNTS, len(moe_layers)]`` on the metrics' device (zeros without counts).
        """
        assert self.backend is not None
        table = self._table
        if table is None:
            table = torch.zeros((COUNTS, len(self.backend.moe_layers)), dtype=torch.int64, device=self.device)
        return self.backend_counts() + table.to(self.device) if with_backend else table

    def count_native_loss_tokens(self, layout: TokenMetadataLayout, mask: Tensor, batch: Any) -> None:
        """Counts the loss targets whose logprob row (``t - 1``) is routed natively, on device.

        Args:
            layout: The layout of the step's routes.
            mask: bool ``[*token_shape]``: the rows replayed.
            batch: The step's batch (nothing is counted without its ``loss_mask``).
        """
        loss_mask = batch_field(batch, "loss_mask")
        if loss_mask is not None:
            target_next = layout.from_batch(loss_mask, next_token=True) > 0
            self._native_loss_tokens = (target_next & ~mask.to(target_next.device)).sum()

    def count_missing_rows(self, routes: PackedTensor) -> None:
        """Counts the step's route rows marked missing, on device; no sync.

        Args:
            routes: The step's packed routes: a row with a -1 id is missing (only signed dtypes
                can hold one).
        """
        if routes.dtype.is_signed:
            self._missing_rows = (routes.values < 0).flatten(1).any(1).sum()

    def log(self, pl_module: pl.LightningModule, local: Tensor, *, missing: int | None) -> None:
        """Logs the step's ``router_replay/`` metrics through ``pl_module.log``.

        Args:
            pl_module: The LightningModule being trained.
            local: This rank's counts ``[COUNTS, len(moe_layers)]``.
            missing: ``batches_without_routes`` so far: with it, also that count,
                ``native_loss_tokens`` and ``missing_rows`` (None: off mode, not logged).
        """
        backend = self.backend
        device = self.device
        assert backend is not None
        # [COUNTS, num_layers] by absolute layer (pipeline stages hold different layers), then 3 scalars
        size = COUNTS * backend.num_layers
        vector = torch.zeros(size + 3, dtype=torch.int64, device=device)
        vector[:size].view(COUNTS, -1).index_copy_(1, self.layer_index(device), local.to(device))
        if self._native_loss_tokens is not None:
            vector[size] += self._native_loss_tokens.to(device)
        vector[size + 1] += missing or 0
        if self._missing_rows is not None:
            vector[size + 2] += self._missing_rows.to(device)
        distributed = self.sync_dist and dist.is_available() and dist.is_initialized()
        if self._layers is None:  # MoE layers any rank routes (pipeline stages differ), once per fit
            gathered: list[Any] = [tuple(backend.moe_layers)] * (dist.get_world_size() if distributed else 1)
            if distributed:
                dist.all_gather_object(gathered, tuple(backend.moe_layers))
            self._layers = tuple(sorted({layer for layers in gathered for layer in layers}))
        if distributed:
            dist.all_reduce(vector)  # exact ratios over all ranks; no host sync
        totals = vector[:size].view(COUNTS, -1).double()
        soft = getattr(backend, "soft_threshold", None) is not None
        layers = self._layers if self.per_layer else None
        metrics = step_metrics(totals, top_k=backend.top_k, layers=layers, soft=soft)
        if missing is not None:
            native, without, lost = vector[size:]
            metrics |= {"native_loss_tokens": native, "batches_without_routes": without, "missing_rows": lost}
        for name, value in metrics.items():  # sync_dist=False: summed over ranks above
            pl_module.log(f"router_replay/{name}", value.float(), on_step=True, on_epoch=False, batch_size=1)
