"""``hf``, ``hf-fsdp``, ``hf-fsdp2``: a tiny Qwen3-MoE trained by a Lightning ``Trainer`` with replay."""

from __future__ import annotations

from typing import Any

import torch

from gpu_checks.common import (
    EXPERTS,
    MOE_LAYERS,
    VOCAB,
    Skip,
    engine_trajectories,
    ensure_process_group,
    expect,
    position_ids,
    replayed_slots,
)


def _lightning_module(shard: bool):
    import lightning.pytorch as pl

    from r3lightning.app.models.tiny import build_tiny_moe
    from r3lightning.replay.callback import RouterReplayCallback
    from r3lightning.replay.context import record_routes

    class ReplayedPolicy(pl.LightningModule):
        """Token NLL on the loss mask; notes what every training step saw and routed."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_tiny_moe(seed=0).train()
            self.shard = shard
            self.pinned: list[bool] = []
            self.steps: list[dict[str, Any]] = []
            self.gates: list[dict[str, torch.Tensor]] = []

        def configure_model(self) -> None:
            if self.shard:
                from torch.distributed.fsdp import fully_shard

                for layer in self.model.model.layers:
                    fully_shard(layer, mesh=self.device_mesh)
                fully_shard(self.model, mesh=self.device_mesh)

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            self.pinned.append(batch.is_pinned())
            return batch

        def gate_weights(self) -> dict[str, torch.Tensor]:
            out = {}
            for name, p in self.model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    t = p.detach()
                    t = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 DTensor
                    out[name] = t.float().cpu().clone()
            return out

        def on_train_start(self) -> None:
            self.gates.append(self.gate_weights())

        def on_train_end(self) -> None:
            self.gates.append(self.gate_weights())

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            backend = RouterReplayCallback.find(self.trainer).backend
            mask = batch.attention_mask
            with record_routes(self.model) as rec:
                logits = self.model(
                    input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=position_ids(mask)
                ).logits
            self.steps.append(
                {"installed": backend.installed, "device": batch.device.type, "used": rec.routes.cpu()}
            )
            logp = torch.log_softmax(logits[:, :-1].float(), -1)
            logp = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # [B, S - 1]
            weight = batch.loss_mask[:, 1:]
            return -(logp * weight).sum() / weight.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return ReplayedPolicy()


def check_hf(device: torch.device, variant: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger

    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.data.datamodule import R3DataModule
    from r3lightning.replay.callback import RouterReplayCallback

    cuda = device.type == "cuda"
    if variant == "fsdp" and not cuda:
        raise Skip("Lightning's fsdp strategy needs CUDA")
    batch_size, count = 4, 8
    trajectories = engine_trajectories(device, count)
    buffer = ReplayBuffer(num_experts=EXPERTS, vocab_size=VOCAB)
    buffer.extend(trajectories)
    data = R3DataModule(buffer, batch_size, shuffle=False, collate_threads=2)  # pins on a CUDA trainer
    strategy: Any = "auto"
    if variant == "fsdp":
        strategy = "fsdp"
    elif variant == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    if variant != "single":
        ensure_process_group(device)
    router_callback = RouterReplayCallback(mode="r3")
    cleared: list[bool] = []
    agreement: list[float] = []

    class AfterStep(pl.Callback):  # runs after the replay callback's on_train_batch_end
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            cleared.append(not router_callback.backend.installed)

    class Metrics(Logger):
        name, version = "memory", 0

        def log_metrics(self, metrics, step=None):
            if "router_replay/native_agreement" in metrics:
                agreement.append(float(metrics["router_replay/native_agreement"]))

        def log_hyperparams(self, *args, **kwargs):
            pass

    module = _lightning_module(shard=variant == "fsdp2")
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=[device.index] if cuda else 1,
        strategy=strategy,
        max_epochs=1,
        logger=Metrics(),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[router_callback, AfterStep()],
    )
    trainer.fit(module, datamodule=data)
    if variant == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = any(isinstance(m, FullyShardedDataParallel) for m in trainer.strategy.model.modules())
        expect(wrapped, "the fsdp strategy did not wrap the model in FullyShardedDataParallel")
    elif variant == "fsdp2":
        sharded = all(hasattr(p, "full_tensor") for p in module.model.parameters())
        expect(sharded, "ModelParallelStrategy left parameters that are not DTensors (not fully_shard-ed)")
    steps = count // batch_size
    expect(len(module.steps) == steps, f"expected {steps} training steps, ran {len(module.steps)}")
    expect(all(s["installed"] for s in module.steps), "routes were not installed during a training step")
    expect(cleared == [True] * steps, f"routes not cleared after every step: {cleared}")
    expect(all(s["device"] == device.type for s in module.steps), "a batch reached training_step off-device")
    if cuda:
        expect(
            module.pinned[:steps] == [True] * steps,
            f"batches were not pinned before transfer: {module.pinned}",
        )
        misses = data._collator.pool.misses
        expect(misses == 0, f"the pinned pool missed {misses} times")
    agree = total = 0
    for index, step in enumerate(module.steps):
        a, t = replayed_slots(step["used"], trajectories[index * batch_size : (index + 1) * batch_size])
        agree, total = agree + a, total + t
    expect(agree == total, f"training forwards used the rollout's experts on {agree}/{total} slots")
    before, after = module.gates
    moved = sum(not torch.equal(before[k], after[k]) for k in before)
    expect(moved == len(MOE_LAYERS), f"only {moved}/{len(MOE_LAYERS)} routers were updated by training")
    return {
        "replay_agreement": agree / total,
        "native_agreement": sum(agreement) / max(len(agreement), 1),
        "slots": total,
    }
