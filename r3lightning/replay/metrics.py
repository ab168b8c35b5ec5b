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
    """``[COUNTS, len(layers)]`` counts comparing ``used [*shape, L, K]`` (forwards joined along the last
    token axis) on decoder ``layers`` with ``routes [*token_shape, C, K]`` where ``mask``; ``columns``:
    the routes' column of each of ``layers`` (None: the layers themselves, ``C = L``). None unless
    the shapes fit."""
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
    """The ratios of counts ``[COUNTS, num_layers]``, per layer for ``layers`` (NaN without route
    rows); ``soft``: with ``soft_kept_fraction``, the share of replayed slots soft replay kept."""
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
    """One training step's counts on device and their logging (``sync_dist``: one ``all_reduce``)."""

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
        self._layers = None

    def start(self, backend: RouterReplayBackend, batch: Any) -> None:
        """Open a step of ``backend`` on ``batch`` (the counts live on its ``input_ids``' device)."""
        if backend is not self.backend:
            self.backend = backend
            self._index = None
        ids = batch_field(batch, "input_ids")
        self.device = ids.device if isinstance(ids, Tensor) else torch.device("cpu")
        self._table = self._native_loss_tokens = self._missing_rows = None

    def layer_index(self, device: torch.device) -> Tensor:
        assert self.backend is not None
        if self._index is None or self._index.device != device:
            self._index = to_device_async(torch.tensor(self.backend.moe_layers), device)
        return self._index

    def column_index(self, layers: tuple[int, ...] | None, device: torch.device) -> Tensor:
        """int64 ``[len(moe_layers)]`` on ``device``: each MoE layer's column in routes whose columns
        are decoder ``layers`` (None: the layers themselves)."""
        assert self.backend is not None
        if layers is None:
            return self.layer_index(device)
        columns = list(route_columns(self.backend, layers).values())
        return to_device_async(torch.tensor(columns), device)

    def add(self, table: Tensor) -> None:
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
        """``[COUNTS, len(moe_layers)]``: the counts so far (or zeros), plus the backend's if ``with_backend``."""
        assert self.backend is not None
        table = self._table
        if table is None:
            table = torch.zeros((COUNTS, len(self.backend.moe_layers)), dtype=torch.int64, device=self.device)
        return self.backend_counts() + table.to(self.device) if with_backend else table

    def count_native_loss_tokens(self, layout: TokenMetadataLayout, mask: Tensor, batch: Any) -> None:
        """Loss targets of the step's batch whose logprob row (``t - 1``) is routed natively."""
        loss_mask = batch_field(batch, "loss_mask")
        if loss_mask is not None:
            target_next = layout.from_batch(loss_mask, next_token=True) > 0
            self._native_loss_tokens = (target_next & ~mask.to(target_next.device)).sum()

    def count_missing_rows(self, routes: PackedTensor) -> None:
        """The step's route rows marked missing (a -1 id; only signed routes can hold one); no sync."""
        if routes.dtype.is_signed:
            self._missing_rows = (routes.values < 0).flatten(1).any(1).sum()

    def log(self, pl_module: pl.LightningModule, local: Tensor, *, missing: int | None) -> None:
        """Log the ratios of ``local``, and ``missing`` with ``native_loss_tokens`` unless None (off mode)."""
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
