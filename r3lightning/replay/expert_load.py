"""How evenly the rollout engine spread a step's tokens over the experts, per MoE layer: ``max_over_mean``
(1 balanced, up to ``num_experts / top_k``) and normalised ``entropy`` (1 uniform); dense rows skipped."""

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from r3lightning.checks import check_int
from r3lightning.packed import PackedTensor
from r3lightning.replay.batch_fields import batch_field

__all__ = ["ExpertLoadMonitor", "expert_load_stats"]


def expert_load_stats(
    routes: Tensor | PackedTensor,
    num_experts: int,
    *,
    moe_layers: Sequence[int] | None = None,
    route_layers: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """How evenly routes spread tokens over the experts, per layer; all-zero (dense) rows skipped.

    Args:
        routes: Integer ``[rows, columns, top_k]`` (or a ``PackedTensor`` of ``[columns, top_k]``
            rows), any device.
        num_experts: Experts per MoE layer (>= 1); ids outside ``[0, num_experts)`` are not
            counted.
        moe_layers: The decoder layers to report, among the columns' layers (None: every column).
        route_layers: The decoder layer of each column of layer-sliced routes (None: column ``i``
            is layer ``i``).

    Returns:
        On the routes' device: float32 ``counts [L, E]`` (slots per expert), and ``[L]``
        ``tokens``, ``max_over_mean`` (1 balanced, up to ``num_experts / top_k``) and
        normalised ``entropy`` (1 uniform), the last two NaN for a layer without counted rows;
        and host int64 ``layers [L]``, the absolute layer of each. One ``index_add_`` over all slots; no host
        sync.

    Raises:
        ValueError: ``routes`` is not an integer 3-D tensor, ``num_experts`` is not an int >= 1,
            or ``moe_layers`` names a layer the routes do not hold.
    """
    values = routes.values if isinstance(routes, PackedTensor) else routes
    if values.dim() != 3 or values.is_floating_point() or values.dtype == torch.bool:
        got = f"{values.dtype} {tuple(values.shape)}"
        raise ValueError(f"routes must be an integer [rows, num_layers, top_k] tensor, got {got}")
    check_int("num_experts", num_experts)
    _, n, top_k = values.shape
    device = values.device
    held = list(range(n)) if route_layers is None else list(route_layers)  # of each column
    chosen = held if moe_layers is None else [int(layer) for layer in moe_layers]
    if any(layer not in held for layer in chosen):
        raise ValueError(f"moe_layers {chosen} out of range for {n} layers {held}")
    ids = values.long()  # [rows, L_all, K]
    # a slot counts unless its row is all zeros (a dense layer's filler)
    counted = values.ne(0).any(-1, keepdim=True).expand_as(ids).reshape(-1).float()  # [rows * L_all * K]
    flat = (ids + torch.arange(n, device=device).view(1, n, 1) * num_experts).reshape(-1)
    # ids out of range would land in another layer's bins: clamp them into a dropped bin
    flat = torch.where(((ids >= 0) & (ids < num_experts)).reshape(-1), flat, n * num_experts)
    counts = torch.zeros(n * num_experts + 1, dtype=torch.float32, device=device).index_add_(0, flat, counted)
    counts = counts[:-1].view(n, num_experts)  # [L_all, E]
    if moe_layers is not None:
        # views stacked, not an index tensor: a host index would be copied to the device (a sync)
        counts = torch.stack([counts[held.index(layer)] for layer in chosen]) if chosen else counts[:0]
    layers = torch.tensor(chosen, dtype=torch.int64)  # host
    slots = counts.sum(-1)  # [L]
    # NaN without slots
    tokens = slots / top_k
    max_over_mean = counts.amax(-1) / (slots / num_experts)
    p = counts / slots.unsqueeze(-1)
    if num_experts > 1:
        entropy = -torch.special.xlogy(p, p).sum(-1) / math.log(num_experts)
    else:  # one expert: the only distribution is uniform (1 where there are slots)
        entropy = p.sum(-1)
    entropy = torch.where(slots > 0, entropy, torch.full_like(entropy, float("nan")))
    return dict(counts=counts, tokens=tokens, max_over_mean=max_over_mean, entropy=entropy, layers=layers)


class ExpertLoadMonitor(Callback):
    """Logs how evenly the engine spread the training batch's tokens over the experts, every N steps.

    At the start of steps 0, N, 2N, ... it computes `expert_load_stats` of the batch's
    ``routed_experts`` on device; at the end of the step it writes ``<prefix>/max_over_mean``,
    ``max_over_mean_worst``, ``entropy`` and ``entropy_min`` (means and worst over the MoE layers)
    to the trainer's loggers with one device-to-host read-back.

    Args:
        num_experts: Experts per MoE layer (None: the ``RouterReplayCallback``'s backend's).
        every_n_steps: Log every this many global steps (>= 1).
        moe_layers: The decoder layers to measure (None: the backend's ``moe_layers``, else every
            route column).
        log_per_layer: Also log ``<prefix>/layer_XX/max_over_mean`` and ``.../entropy``.
        prefix: The metric names' prefix.
        sync_dist: Average the values over ranks first (one collective every rank must join).

    Raises:
        ValueError: ``every_n_steps`` or ``num_experts`` is not an int >= 1; at the first logged
            step, no ``num_experts`` and no ``RouterReplayCallback`` to take it from.
    """

    def __init__(
        self,
        num_experts: int | None = None,
        *,
        every_n_steps: int = 10,
        moe_layers: Sequence[int] | None = None,
        log_per_layer: bool = False,
        prefix: str = "expert_load",
        sync_dist: bool = False,
    ) -> None:
        check_int("every_n_steps", every_n_steps)
        if num_experts is not None:
            check_int("num_experts", num_experts)
        self.num_experts = num_experts
        self.every_n_steps = every_n_steps
        self.log_per_layer = log_per_layer
        self.moe_layers = None if moe_layers is None else tuple(int(layer) for layer in moe_layers)
        self.prefix = prefix
        self.sync_dist = sync_dist
        self._last_step: int | None = None
        self._pending: tuple[int, list[str], Tensor] | None = None  # (step, names, values [M])

    def _schema(self, trainer: pl.Trainer) -> tuple[int, tuple[int, ...] | None]:
        backends = (getattr(callback, "backend", None) for callback in trainer.callbacks)
        backend = next((b for b in backends if hasattr(b, "moe_layers") and hasattr(b, "num_experts")), None)
        num_experts = self.num_experts or getattr(backend, "num_experts", None)
        moe_layers = self.moe_layers if self.moe_layers is not None else getattr(backend, "moe_layers", None)
        if num_experts is None:
            raise ValueError("ExpertLoadMonitor needs num_experts: pass it, or add a RouterReplayCallback")
        return num_experts, moe_layers

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Computes the batch's load on device at steps 0, N, 2N, ... (no read-back yet)."""
        step = trainer.global_step
        if step % self.every_n_steps or step == self._last_step:
            return
        routes = batch_field(batch, "routed_experts")
        if routes is None or (isinstance(routes, PackedTensor) and routes.num_rows == 0):
            return
        self._last_step = step
        num_experts, moe_layers = self._schema(trainer)
        held = batch_field(batch, "route_layers")
        stats = expert_load_stats(routes, num_experts, moe_layers=moe_layers, route_layers=held)
        measured = stats["tokens"] > 0  # [L]: dense layers (all-zero rows) drop out
        count = measured.sum().clamp(min=1)
        peak = torch.where(measured, stats["max_over_mean"], 0.0)
        entropy = torch.where(measured, stats["entropy"], 0.0)
        lowest = torch.where(measured, entropy, 1.0).amin()
        values = {
            "max_over_mean": peak.sum() / count,
            "max_over_mean_worst": peak.amax(),
            "entropy": entropy.sum() / count,
            "entropy_min": lowest,
        }
        if self.log_per_layer:
            for i, layer in enumerate(stats["layers"].tolist()):  # host tensor: no device sync
                values[f"layer_{layer:02d}/max_over_mean"] = stats["max_over_mean"][i]
                values[f"layer_{layer:02d}/entropy"] = stats["entropy"][i]
        names = [f"{self.prefix}/{name}" for name in values]
        self._pending = (step, names, torch.stack(list(values.values())))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Writes the pending values to the loggers: one read-back (and a mean over ranks)."""
        if self._pending is None:
            return
        step, names, values = self._pending
        self._pending = None
        if self.sync_dist and trainer.world_size > 1:
            values = trainer.strategy.reduce(values, reduce_op="mean")
        metrics = dict(zip(names, values.tolist(), strict=True))  # the one read-back
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
