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

from ..align.layout import position_ids_from_mask
from ..replay.callback import RouterReplayCallback
from .grpo import GRPOConfig, mismatch_metrics, policy_loss, token_logprobs


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
        # DCP directory (r3lightning.models.sharded) each rank reads its shards from after
        # sharding a meta-device model; None = the model arrives with its weights
        self.sharded_weights = sharded_weights

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

    def training_step(self, batch, batch_idx: int) -> Tensor:
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
        loss, stats = policy_loss(
            logprobs,
            old_logprobs,
            batch.advantages,
            loss_mask,
            clip_low=self.grpo.clip_low,
            clip_high=self.grpo.clip_high,
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
        (:func:`~r3lightning.models.sharded.shard_model`); a model built on the meta device then
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
        from ..models.sharded import load_sharded_weights, shard_model

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
