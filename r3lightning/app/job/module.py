"""The job's LightningModule: GRPO on a causal (MoE) LM whose routes the replay callback installs."""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf
from torch import Tensor, nn

from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.app.job.grpo import (
    GRPOConfig,
    gspo_loss,
    masked_mean,
    mismatch_metrics,
    paired_mismatch_metrics,
    policy_loss,
    token_entropy,
    token_logprobs,
)
from r3lightning.app.job.settings import OptimConfig
from r3lightning.app.job.sharded import load_sharded_weights, shard_model
from r3lightning.correction import CorrectionMetrics, correction_weights
from r3lightning.padded import position_ids_from_mask
from r3lightning.ragged import to_device_async
from r3lightning.replay.backend import route_columns
from r3lightning.replay.batch_fields import host_attention_mask
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.metrics import comparison_counts

__all__ = ["GRPOModule", "OptimConfig"]


class GRPOModule(pl.LightningModule):
    """GRPO policy update of a causal (MoE) LM; one epoch is one RL step.

    The clipped loss (``grpo.loss``: token-level ``grpo`` or sequence-level ``gspo``) is taken
    against the engine's logprobs, or against the trainer's own no-grad forward with
    ``recompute_old_logprobs``, and weighted by ``grpo.correction``. The replay callback installs
    the engine's routes around every forward. Every ``grpo.mismatch_every_n_steps`` steps, two
    more no-grad forwards give the paired ``mismatch/*`` metrics (docs/concepts/metrics.md).

    Cost per training step: one forward and backward; one more no-grad forward with
    ``recompute_old_logprobs``; two more on the steps that measure the paired mismatch. Metrics
    are logged as device tensors; on several ranks their epoch means are all-reduced once per
    epoch.

    Args:
        model: Any Hugging Face-style causal LM whose forward returns ``.logits`` ``[B, S, V]``;
            it is put in train mode.
        grpo: The loss and measurement settings (a ``DictConfig`` of them, as Hydra hands it
            over, is converted); None: the defaults.
        optim: The AdamW settings; None: the defaults.
        recompute_old_logprobs: Take the old-policy logprobs from a no-grad forward of the
            trainer (``replay=r2``, where the replay callback records that forward's routes and
            replays them) instead of the engine's.
        measure_agreement: Log ``used_agreement/layer_XX`` from the replay callback's counts
            every step (not under r2).
        sharded_weights: The DCP shards directory of a ``model`` built on the meta device;
            `configure_model` loads it after sharding (FSDP2 only).
    """

    def __init__(
        self,
        model: nn.Module,
        grpo: GRPOConfig | None = None,
        optim: OptimConfig | None = None,
        *,
        recompute_old_logprobs: bool = False,
        measure_agreement: bool = True,
        sharded_weights: str | None = None,
    ):
        super().__init__()
        self.model = model.train()  # builders hand out eval-mode models
        if OmegaConf.is_config(grpo):  # Hydra's instantiate hands dataclass arguments over as configs
            grpo = OmegaConf.to_object(grpo)
        self.grpo = grpo or GRPOConfig()
        self.optim = optim or OptimConfig()
        self.recompute_old_logprobs = recompute_old_logprobs
        self.measure_agreement = measure_agreement
        self.sharded_weights = sharded_weights
        self._paired: dict[str, Tensor] = {}  # measured at batch transfer, logged by training_step
        self._paired_epoch = -1
        self._correction = CorrectionMetrics(self.grpo.correction)
        self._engine_logprobs = True  # whether the batch in flight has every loss token's engine logprob

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Logits ``[B, S, V]`` of a left-padded batch."""
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask.long(),
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).logits

    def batch_logprobs(self, batch) -> Tensor:
        """The trainer's logprob of every token of ``batch``, with gradient unless under no_grad.

        Cost: one forward of the model (with whatever routes are installed).

        Args:
            batch: A ``ReplayBatch`` (left-padded ``input_ids`` and ``attention_mask`` ``[B, S]``).

        Returns:
            ``[B, S]`` float32, as `token_logprobs`; entry 0 of each row is 0.
        """
        return token_logprobs(self(batch.input_ids, batch.attention_mask), batch.input_ids)

    @property
    def _distributed(self) -> bool:
        return self._trainer is not None and self.trainer.world_size > 1

    def _log_epoch(self, metrics: dict[str, Tensor], batch_size: int) -> None:
        # epoch means, averaged across ranks (one all-reduce per metric per epoch)
        self.log_dict(
            metrics, on_step=False, on_epoch=True, batch_size=batch_size, sync_dist=self._distributed
        )

    def _replay_callback(self) -> RouterReplayCallback | None:
        callbacks = self._trainer.callbacks if self._trainer is not None else []
        return next((c for c in callbacks if isinstance(c, RouterReplayCallback)), None)

    def on_train_epoch_start(self) -> None:
        self._correction.reset()
        # callback_metrics keeps every metric's last value: a step that does not measure the
        # paired mismatch must not show the previous measurement as its own
        metrics = self.trainer.callback_metrics
        for key in [k for k in metrics if k.startswith("mismatch/")]:
            del metrics[key]

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        # on the host, before the copy to the device: the check costs no device sync
        logprobs = getattr(batch, "rollout_logprobs", None)
        missing = logprobs.isnan() if logprobs is not None else None  # [B, S]: no engine logprob
        count = 0 if missing is None else int((missing & batch.loss_mask.bool()).sum())
        if count and (not self.recompute_old_logprobs or self.grpo.correction.mode != "none"):
            raise ValueError(
                f"rollout_logprobs: {count} loss tokens of this batch have no engine logprob (the engine "
                "answered logprobs: null, or a Trajectory carries NaN there), and the loss needs them: "
                "the PPO ratio against the engine and the correction weigh by them; have the engine return "
                "logprobs, or recompute the old-policy logprobs in the trainer (replay.mode=r2) with "
                "algorithm.correction.mode=none"
            )
        self._engine_logprobs = count == 0  # the engine-mismatch metrics need them too
        if missing is not None:
            logprobs.masked_fill_(missing, 0.0)  # unused from here on: no NaN reaches a loss or metric
        return batch

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        # before the callbacks' on_train_batch_start (nothing installed or recorded yet) and
        # after the previous optimizer step
        trainer = self._trainer
        every = self.grpo.mismatch_every_n_steps
        if trainer is not None and trainer.training and every > 0:
            epoch = trainer.current_epoch
            if epoch % every == 0 and epoch != self._paired_epoch:
                self._paired_epoch = epoch
                self._paired = self.measure_mismatch(batch)
        return batch

    def measure_mismatch(self, batch) -> dict[str, Tensor]:
        """The paired mismatch of ``batch``: the trainer's native routing against the engine's
        routes replayed, same weights and batch.

        Call it with no routes installed (the module does, before the callbacks' batch start).
        Cost: two no-grad forwards; no host sync.

        Args:
            batch: A ``ReplayBatch`` on the device, with the engine's ``routed_experts`` and
                ``rollout_logprobs``.

        Returns:
            Detached scalars, unprefixed (logged as ``mismatch/<name>``): `paired_mismatch_metrics`,
            ``native_agreement`` (the share of the engine's expert slots the trainer's routers
            pick natively) and ``policy_entropy`` (nats, mean over loss tokens). Empty without
            engine routes, engine logprobs for every loss token, or a replay backend.
        """
        callback = self._replay_callback()
        routes = getattr(batch, "routed_experts", None)
        rollout_logprobs = getattr(batch, "rollout_logprobs", None)
        no_engine = rollout_logprobs is None or not self._engine_logprobs
        if callback is None or callback.backend is None or routes is None or no_engine:
            return {}
        backend = callback.backend
        layout = TokenMetadataLayout.padded(host_attention_mask(batch))  # what self.forward feeds
        route_layers = batch.route_layers
        aligned, mask = callback.align_routes(routes, layout, route_layers)  # [B, S, columns, K], [B, S]
        loss_mask = batch.loss_mask.to(rollout_logprobs.dtype)
        with torch.no_grad():
            with record_routes(backend) as native_routes:
                native_logits = self(batch.input_ids, batch.attention_mask)
            native = token_logprobs(native_logits, batch.input_ids)
            entropy = masked_mean(token_entropy(native_logits), loss_mask)
            del native_logits
            with replay_routes(backend, aligned, mask, layers=route_layers):
                replayed = self.batch_logprobs(batch)
            layers = to_device_async(torch.tensor(backend.moe_layers), aligned.device)
            used = native_routes.routes.to(aligned.device)  # [B, S, L, K]: one forward
            columns = None
            if route_layers is not None:  # each MoE layer's column of the sliced routes
                positions = list(route_columns(backend, route_layers).values())
                columns = to_device_async(torch.tensor(positions), aligned.device)
            counts = comparison_counts(aligned, mask, used, layers, columns)  # [COUNTS, moe_layers]
            route_rows, _, native_hits, _, _ = counts.sum(-1)  # each summed over the MoE layers
            out = paired_mismatch_metrics(
                native, replayed, rollout_logprobs, loss_mask, ratio_band=self.grpo.ratio_band
            )
            slots = (route_rows * aligned.shape[-1]).clamp(min=1)  # route rows times top-k
            out["native_agreement"] = native_hits.double() / slots
            out["policy_entropy"] = entropy.double()
        return out

    def training_step(self, batch, batch_idx: int) -> Tensor:
        paired = self._paired
        self._paired = {}  # measured for this step only
        if paired:
            self._log_epoch({f"mismatch/{k}": v for k, v in paired.items()}, batch_size=1)
        callback = self._replay_callback()
        old_logprobs = batch.rollout_logprobs
        if self.recompute_old_logprobs:
            # r2: the callback records the routes of this forward and replays them afterwards
            guard = callback.old_policy_forward(batch) if callback is not None else contextlib.nullcontext()
            with guard, torch.no_grad():
                old_logprobs = self.batch_logprobs(batch)
        logprobs = self.batch_logprobs(batch)  # [B, S]
        if self.measure_agreement and callback is not None and callback.mode != "r2":
            self._log_agreement(callback, len(batch))
        loss_mask = batch.loss_mask.to(logprobs.dtype)
        weights = None
        if self.grpo.correction.active:
            log_ratio = logprobs.detach() - batch.rollout_logprobs
            weights = correction_weights(log_ratio, loss_mask, self.grpo.correction)
            self._correction.update(weights, loss_mask, log_ratio)
            totals = self._correction.compute(sync_dist=self._distributed)
            self.log_dict(
                {k: v.float() for k, v in totals.items()}, on_step=True, on_epoch=False, batch_size=1
            )
        clip = {"clip_low": self.grpo.clip_low, "clip_high": self.grpo.clip_high}
        objective = gspo_loss if self.grpo.loss == "gspo" else policy_loss
        loss, stats = objective(logprobs, old_logprobs, batch.advantages, loss_mask, **clip, weights=weights)
        band = self.grpo.ratio_band
        if self._engine_logprobs:
            stats |= mismatch_metrics(logprobs.detach(), batch.rollout_logprobs, loss_mask, ratio_band=band)
        stats["loss"] = loss.detach()
        rewards = getattr(batch, "rewards", None)
        if rewards is not None:  # the progress bar's only; the CSV takes the rollout's
            reward = rewards.float().mean()
            self.log("reward", reward, prog_bar=True, on_step=True, on_epoch=False, batch_size=len(rewards))
        self._log_epoch({f"train/{k}": v for k, v in stats.items()}, batch_size=batch.input_ids.shape[0])
        return loss

    def _log_agreement(self, callback: RouterReplayCallback, batch_size: int) -> None:
        """``used_agreement/layer_XX`` from the replay callback's on-device counts; no host sync."""
        counts = callback.routing_counts()
        backend = callback.backend
        if counts is None or backend is None:
            return
        slots = (counts["route_rows"] * backend.top_k).clamp(min=1)
        fractions = counts["used_hits"].double() / slots  # [moe_layers]
        layers = zip(backend.moe_layers, fractions.unbind(0), strict=True)
        self._log_epoch({f"used_agreement/layer_{i:02d}": v.float() for i, v in layers}, batch_size)

    def configure_model(self) -> None:
        """Under FSDP2 (``ModelParallelStrategy``): shard, then read a meta model's ``sharded_weights``."""
        mesh = self.device_mesh
        if mesh is None and self.sharded_weights is not None:
            raise ValueError(
                "sharded_weights needs FSDP2 (ModelParallelStrategy, e.g. trainer=gpu_fsdp or cpu_fsdp): the "
                "model was built on the meta device and only sharding gives its parameters storage"
            )
        if mesh is None or getattr(self.model, "_r3_sharded", False):
            return
        names = mesh.mesh_dim_names or ()
        shard_model(self.model, mesh["data_parallel"] if "data_parallel" in names else mesh)
        if self.sharded_weights is not None:
            load_sharded_weights(self.model, self.sharded_weights, self.device)
        self.model._r3_sharded = True

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optim = self.optim
        return torch.optim.AdamW(
            self.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas)
        )
