"""``grpo``, ``grpo-bf16``, ``grpo-fsdp2``: the package's GRPOModule under a sync guard."""

from __future__ import annotations

from typing import Any

import torch

from gpu_checks.common import (
    EXPERTS,
    VOCAB,
    engine_trajectories,
    ensure_process_group,
    expect,
    replayed_slots,
)


def check_grpo(device: torch.device, variant: str) -> dict[str, Any]:
    """The package's ``GRPOModule`` (HF activation checkpointing on) trained by a Lightning
    ``Trainer`` with ``R3DataModule`` and ``RouterReplayCallback``; every step after the first
    (collation, transfer, layout, install, forward, recompute, backward, optimizer, metrics) runs
    under ``torch.cuda.set_sync_debug_mode("error")``. ``bf16``: ``precision="bf16-true"`` (the
    batch keeps float32 logprobs, masks and advantages, and stays pinned); ``fsdp2``: the module's
    own ``configure_model`` sharding under ``ModelParallelStrategy``."""
    import lightning.pytorch as pl

    from r3lightning.app.job.module import GRPOModule
    from r3lightning.app.models.tiny import build_tiny_moe
    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.data.datamodule import R3DataModule
    from r3lightning.replay.callback import RouterReplayCallback
    from r3lightning.replay.context import record_routes

    cuda = device.type == "cuda"
    batch_size, count = 4, 12
    trajectories = engine_trajectories(device, count)
    buffer = ReplayBuffer(num_experts=EXPERTS, vocab_size=VOCAB)
    buffer.extend(trajectories)
    data = R3DataModule(buffer, batch_size, shuffle=False, collate_threads=2)  # pins on a CUDA trainer
    seen: dict[str, list[Any]] = {"used": [], "pinned": [], "dtypes": []}

    class Policy(GRPOModule):
        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            seen["pinned"].append(batch.is_pinned())
            return batch

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.in_training_step = True  # the paired-mismatch forwards before it are not counted
            try:
                return super().training_step(batch, batch_idx)
            finally:
                self.in_training_step = False

        def batch_logprobs(self, batch: Any) -> torch.Tensor:
            if not getattr(self, "in_training_step", False):
                return super().batch_logprobs(batch)
            seen["dtypes"].append(
                {batch.rollout_logprobs.dtype, batch.loss_mask.dtype, batch.advantages.dtype}
            )
            with record_routes(self.model) as rec:
                out = super().batch_logprobs(batch)
            seen["used"].append(rec.routes)  # stays on the device: copied after the fit
            return out

    class SyncGuard(pl.Callback):
        """Sync debug mode "error" from the end of the first step (warm-up) to the end of the fit."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda and batch_idx == 0:
                torch.cuda.synchronize(device)
                torch.cuda.set_sync_debug_mode("error")

        def on_train_end(self, trainer, pl_module):
            if cuda:
                torch.cuda.set_sync_debug_mode("default")

    model = build_tiny_moe(seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module = Policy(model)
    strategy: Any = "auto"
    if variant == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        ensure_process_group(device)
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=[device.index] if cuda else 1,
        strategy=strategy,
        precision="bf16-true" if variant == "bf16" else "32-true",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RouterReplayCallback(mode="r3"), SyncGuard()],
    )
    try:
        trainer.fit(module, datamodule=data)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    steps = count // batch_size
    expect(len(seen["used"]) == steps, f"expected {steps} training forwards, ran {len(seen['used'])}")
    expect(
        seen["dtypes"] == [{torch.float32}] * steps,
        f"batch float fields reached the step as {seen['dtypes']}",
    )
    if variant == "fsdp2":
        sharded = all(hasattr(p, "full_tensor") for p in module.model.parameters())
        expect(sharded, "GRPOModule.configure_model left parameters that are not DTensors")
    if cuda:
        expect(seen["pinned"] == [True] * steps, f"batches were not pinned before transfer: {seen['pinned']}")
        misses = data._collator.pool.misses
        expect(misses == 0, f"the pinned pool missed {misses} times")
    agree = total = 0
    for index, used in enumerate(seen["used"]):
        a, t = replayed_slots(used.cpu(), trajectories[index * batch_size : (index + 1) * batch_size])
        agree, total = agree + a, total + t
    expect(agree == total, f"training forwards used the rollout's experts on {agree}/{total} slots")
    return {"replay_agreement": agree / total, "slots": total, "steps": steps}
