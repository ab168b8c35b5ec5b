"""The LightningModule that trains a Hugging Face causal (MoE) LM with the GRPO loss.

It computes logprobs, the loss and the training/inference mismatch; routes reach the MoE
routers through the ``RouterReplayCallback`` (which installs them before each training forward)
and rollouts come from the data module. Batches are left-padded ``RolloutBatch`` es.

Routing agreement is measured, not assumed: when the batch carries the rollout engine's routes,
``used_agreement/layer_XX`` is the share of the engine's experts that each MoE layer *actually
used* in the training forward, over the tokens that have a captured route (100% under R3),
counted on device by the replay backend's router hooks (no second recording, no host sync).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from r3lightning.align.layout import TokenMetadataLayout, position_ids_from_mask
from r3lightning.correction import CorrectionMetrics, correction_weights
from r3lightning.correction.grpo import (
    GRPOConfig,
    masked_mean,
    mismatch_metrics,
    paired_mismatch_metrics,
    policy_loss,
    token_entropy,
    token_logprobs,
)
from r3lightning.ragged import to_device_async
from r3lightning.replay.backend import agreement_hits
from r3lightning.replay.batch_fields import host_attention_mask
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes, replay_routes


@dataclass
class OptimConfig:
    lr: float = 1e-2
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float | None = 1.0  # applied by the Trainer (gradient_clip_val)


class GRPOModule(pl.LightningModule):
    """GRPO policy update of ``model`` (any HF causal LM returning ``.logits``).

    ``training_step`` does one forward over the left-padded batch, the clipped surrogate loss
    against the rollout engine's logprobs (the behaviour policy), and logs the
    training/inference mismatch (``train/k3_kl``, ``train/ratio_out_of_band``, ...), averaged over
    the epoch. One epoch is one RL step.

    ``grpo.correction`` weights each loss token by an importance-sampling correction
    (:mod:`r3lightning.correction`) of ``log p_trainer - log p_engine`` from this same forward
    (replayed under r3); unless it is ``none``, ``correction/*`` are exact ratios of sums over the
    epoch's batches so far and over ranks, logged every step (the epoch's last covers the RL step).

    Paired mismatch, every ``grpo.mismatch_every_n_steps`` RL steps (on the step's first batch,
    whose weights are the ones the engine sampled with): two extra no-grad forwards of the batch,
    routed natively and with the engine's routes replayed, each compared with the engine's
    logprobs (``mismatch/k3_native``, ``mismatch/k3_replayed``, ``mismatch/outside_band_native``,
    ``mismatch/outside_band_replayed``), plus ``mismatch/native_agreement`` (share of the engine's
    expert slots the trainer's router picks natively) and ``mismatch/policy_entropy`` (mean
    entropy of the natively routed policy on loss tokens). The same in every replay mode, so arms
    compare like with like. They run before the replay callback installs the step's routes.
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
        self.grpo = grpo or GRPOConfig()
        self.optim = optim or OptimConfig()
        # True: the behaviour policy is the trainer's own no-grad forward (required by r2 mode,
        # whose routes are recorded there); False: the rollout engine's logprobs.
        self.recompute_old_logprobs = recompute_old_logprobs
        self.measure_agreement = measure_agreement
        # DCP directory (r3lightning.job.sharded) each rank reads its shards from after
        # sharding a meta-device model; None = the model arrives with its weights
        self.sharded_weights = sharded_weights
        self._paired: dict[str, Tensor] = {}  # measured at batch transfer, logged by training_step
        self._paired_epoch = -1
        self._correction = CorrectionMetrics(self.grpo.correction)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Logits ``[B, S, V]`` of a left-padded batch."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask.long(),
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return out.logits

    def batch_logprobs(self, batch) -> Tensor:
        """Trainer logprob of every token of ``batch`` ``[B, S]`` (0 where undefined)."""
        return token_logprobs(self(batch.input_ids, batch.attention_mask), batch.input_ids)

    @property
    def _distributed(self) -> bool:
        # epoch metrics are averaged across ranks (one all-reduce per metric per epoch)
        return self._trainer is not None and self.trainer.world_size > 1

    def _replay_callback(self) -> RouterReplayCallback | None:
        trainer = self._trainer
        if trainer is None:
            return None
        try:
            return RouterReplayCallback.find(trainer)
        except LookupError:
            return None

    # ------------------------------------------------------------------ paired mismatch

    def on_train_epoch_start(self) -> None:
        self._correction.reset()
        # trainer.callback_metrics keeps the last value of every metric; a step that does not
        # measure the paired mismatch must not show the previous measurement as its own
        metrics = self.trainer.callback_metrics
        for key in [k for k in metrics if k.startswith("mismatch/")]:
            del metrics[key]

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        # Runs before the callbacks' on_train_batch_start, i.e. before the replay callback
        # installs (r3) or records (off) anything, and after the previous optimizer step.
        trainer = self._trainer
        every = self.grpo.mismatch_every_n_steps
        if trainer is not None and trainer.training and every > 0:
            epoch = trainer.current_epoch
            if epoch % every == 0 and epoch != self._paired_epoch:
                self._paired_epoch = epoch
                self._paired = self.measure_mismatch(batch)
        return batch

    def measure_mismatch(self, batch) -> dict[str, Tensor]:
        """Paired mismatch metrics of ``batch`` (names without the ``mismatch/`` prefix).

        Empty when the batch has no engine routes or logprobs, or no replay callback (whose
        backend routes the model) is attached. Must run with no routes installed. Cost: two
        no-grad forwards; no device->host sync of its own.
        """
        callback = self._replay_callback()
        routes = getattr(batch, "routed_experts", None)
        rollout_logprobs = getattr(batch, "rollout_logprobs", None)
        if callback is None or callback.backend is None or routes is None or rollout_logprobs is None:
            return {}
        backend = callback.backend
        layout = TokenMetadataLayout.padded(host_attention_mask(batch))  # what self.forward feeds
        aligned, mask = callback.align_routes(routes, layout, batch.route_layers)  # [B, S, L, K], [B, S]
        loss_mask = batch.loss_mask.to(rollout_logprobs.dtype)
        with torch.no_grad():
            with record_routes(backend) as native_routes:
                native_logits = self(batch.input_ids, batch.attention_mask)
            native = token_logprobs(native_logits, batch.input_ids)
            entropy = masked_mean(token_entropy(native_logits), loss_mask)
            del native_logits
            with replay_routes(backend, aligned, mask):
                replayed = self.batch_logprobs(batch)
            layers = to_device_async(torch.tensor(backend.moe_layers), aligned.device)
            engine = aligned.index_select(-2, layers)  # [B, S, moe_layers, K]
            used = native_routes.routes.to(aligned.device).index_select(-2, layers)
            top_k = engine.shape[-1]
            hits = agreement_hits(engine.reshape(-1, top_k).long(), used.reshape(-1, top_k).long())
            hits = hits.view(engine.shape) & mask[..., None, None]  # only rows the engine routed
            slots = mask.sum() * (engine.shape[-2] * top_k)
            out = paired_mismatch_metrics(
                native, replayed, rollout_logprobs, loss_mask, ratio_band=self.grpo.ratio_band
            )
            out["native_agreement"] = hits.sum().double() / slots.clamp(min=1)
            out["policy_entropy"] = entropy.double()
        return out

    def training_step(self, batch, batch_idx: int) -> Tensor:
        paired, self._paired = self._paired, {}
        if paired:
            self.log_dict(
                {f"mismatch/{k}": v for k, v in paired.items()},
                on_step=False,
                on_epoch=True,
                batch_size=1,
                sync_dist=self._distributed,
            )
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
        weights, correction = None, self.grpo.correction
        if correction.mode != "none":
            weights = correction_weights(logprobs.detach() - batch.rollout_logprobs, loss_mask, correction)
            self._correction.update(weights, loss_mask)
        loss, stats = policy_loss(
            logprobs,
            old_logprobs,
            batch.advantages,
            loss_mask,
            clip_low=self.grpo.clip_low,
            clip_high=self.grpo.clip_high,
            weights=weights,
        )
        if weights is not None:
            totals = self._correction.compute(sync_dist=self._distributed)
            self.log_dict(
                {k: v.float() for k, v in totals.items()}, on_step=True, on_epoch=False, batch_size=1
            )
        stats.update(
            mismatch_metrics(
                logprobs.detach(), batch.rollout_logprobs, loss_mask, ratio_band=self.grpo.ratio_band
            )
        )
        stats["loss"] = loss.detach()
        rewards = getattr(batch, "rewards", None)
        if rewards is not None:  # shown on the progress bar only; the CSV takes the rollout's
            self.log(
                "reward",
                rewards.float().mean(),
                prog_bar=True,
                on_step=True,
                on_epoch=False,
                batch_size=len(rewards),
            )
        self.log_dict(
            {f"train/{k}": v for k, v in stats.items()},
            on_step=False,
            on_epoch=True,
            batch_size=batch.input_ids.shape[0],
            sync_dist=self._distributed,
        )
        return loss

    def _log_agreement(self, callback: RouterReplayCallback, batch_size: int) -> None:
        """Log ``used_agreement/layer_XX``: share of the rollout's expert slots that the training
        forward used, per MoE layer, over the tokens with a captured route (0 without one), from
        the callback's on-device counts. Every rank logs every layer; no host sync."""
        counts = callback.routing_counts()
        backend = callback.backend
        if counts is None or backend is None:
            return
        slots = (counts["route_rows"] * backend.top_k).clamp(min=1)
        fractions = counts["used_hits"].double() / slots  # [moe_layers]
        for layer, value in zip(backend.moe_layers, fractions.unbind(0), strict=True):
            self.log(
                f"used_agreement/layer_{layer:02d}",
                value.float(),
                on_step=False,
                on_epoch=True,
                batch_size=batch_size,
                sync_dist=self._distributed,
            )

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (FSDP2): shard every decoder layer, then the root
        (:func:`~r3lightning.job.sharded.shard_model`); a model built on the meta device then
        reads this rank's shards from ``sharded_weights``. A no-op for other strategies.
        """
        mesh = self.device_mesh
        if mesh is None and self.sharded_weights is not None:
            raise ValueError(
                "sharded_weights needs FSDP2 (ModelParallelStrategy, e.g. trainer=gpu_fsdp or cpu_fsdp): the "
                "model was built on the meta device and only sharding gives its parameters storage"
            )
        if mesh is None or getattr(self.model, "_r3_sharded", False):
            return
        from r3lightning.job.sharded import load_sharded_weights, shard_model

        dp_mesh = (
            mesh["data_parallel"] if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names else mesh
        )
        shard_model(self.model, dp_mesh)
        if self.sharded_weights is not None:
            load_sharded_weights(self.model, self.sharded_weights, self.device)
        self.model._r3_sharded = True

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(),
            lr=self.optim.lr,
            weight_decay=self.optim.weight_decay,
            betas=tuple(self.optim.betas),
        )
