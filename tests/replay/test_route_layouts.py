"""Routes stay on their tokens through batch transforms, data-parallel shards, the callback's own
alignment and a real Lightning fit with the GRPO module (the route pipeline's second half; the
rollouts and their reference are the session fixtures of conftest.py)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager

import align_reference as ref
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from route_checks import (
    align_and_check,
    check_batch,
    references_of,
    valid_routes,
)
from route_reference import MOE_LAYERS, SEED, E, K, L, Reference, Rollouts

from r3lightning.app.job.module import GRPOModule
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.data.batch import RolloutBatch
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.datamodule import R3DataModule
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes
from r3lightning.replay.hf.replay import HFRouterReplay

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "transform", ["micro_batches", "repeat_interleave", "pad_to_multiple", "cat", "pickle"]
)
def test_batch_transforms_keep_routes_on_their_tokens(transform, full_batch, rollouts, model):
    if transform == "micro_batches":
        batches = full_batch.split([4, 3])
        batches.append(batches[1].trim())
        assert batches[2].width < batches[1].width
    elif transform == "repeat_interleave":  # GRPO-style duplicates, uneven counts
        batches = [full_batch[[2, 0, 3]].repeat_interleave(torch.tensor([2, 1, 3]))]
    elif transform == "pad_to_multiple":  # data-parallel evening with placeholder rows
        batches = [full_batch[:5].pad_to_multiple(4, num_experts=E)]
        assert len(batches[0]) == 8
    elif transform == "cat":
        batches = [RolloutBatch.cat([full_batch[3:], full_batch[:2]])]
    else:  # how batches travel between processes
        batches = [pickle.loads(pickle.dumps(full_batch))]
    for batch in batches:
        check_batch(batch, rollouts, model)


@contextmanager
def _data_parallel_rank(rank: int, world: int) -> Iterator[None]:
    """This process acts as data-parallel ``rank`` of ``world``: torch's in-process "fake" backend
    answers rank and world size without starting ``world`` processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_data_parallel_rank(buffer: ReplayBuffer, rollouts: Rollouts, model: torch.nn.Module):
    world = 4  # 7 rollouts over 4 ranks: one rank gets a placeholder
    seen: list[Reference] = []
    for rank in range(world):
        datamodule = R3DataModule(
            buffer, batch_size=2, shuffle=True, seed=1, collate_threads=1, pin_memory=False
        )
        with _data_parallel_rank(rank, world):
            batches = list(datamodule.train_dataloader())
        assert len(batches) == 1 and len(batches[0]) == 2
        for batch in batches:
            check_batch(batch, rollouts, model)
            seen.extend(r for r in references_of(batch, rollouts) if r.rows is not None)
    assert sorted(map(id, seen)) == sorted(map(id, rollouts.references))  # disjoint shards, nothing lost


def test_callback_alignment_matches(full_batch: RolloutBatch, rollouts: Rollouts, model: torch.nn.Module):
    """The Lightning callback's own layout + alignment put the same routes on the same tokens."""
    callback = RouterReplayCallback(backend=HFRouterReplay.for_model(model))
    layout = callback.build_layout(full_batch.attention_mask)
    dense, mask = callback.align_routes(full_batch.routed_experts, layout)
    aligned = align_and_check(full_batch, references_of(full_batch, rollouts), {"kind": "padded"})
    assert torch.equal(mask, aligned.mask)
    assert torch.equal(dense[mask].long(), aligned.routes[mask].long())
    assert valid_routes(dense)


class _RecordingGRPOModule(GRPOModule):
    """The main job's GRPO module, keeping the experts each training forward actually used."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.steps: list[tuple[RolloutBatch, torch.Tensor]] = []

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        with record_routes(self.model) as recording:
            loss = super().training_step(batch, batch_idx)
        self.steps.append((batch, recording.routes))
        return loss


def test_lightning_training_forwards_replay_every_captured_route(rollouts: Rollouts, buffer: ReplayBuffer):
    """A real fit: data module -> RouterReplayCallback -> the GRPO module's forwards. Every
    training forward uses the server's experts on every captured token, also after the first
    optimizer step has moved the weights away from the served ones."""
    module = _RecordingGRPOModule(build_tiny_moe(seed=SEED))  # trained: not the shared fp32 copy
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RouterReplayCallback(backend="hf")],
    )
    trainer.fit(module, datamodule=R3DataModule(buffer, batch_size=4, seed=7, collate_threads=1))
    assert [len(batch) for batch, _ in module.steps] == [4, 3]
    for batch, used in module.steps:
        references = references_of(batch, rollouts)
        grid = ref.padded_positions(batch.lengths_host()[0].tolist(), batch.width, 1, "left")
        assert tuple(used.shape) == (len(batch), batch.width, L, K)
        assert valid_routes(used)  # padding and uncaptured tokens route natively, validly
        used_np = used.long().numpy()
        replayed = 0
        for r, row in enumerate(grid):
            for c, cell in enumerate(row):
                if cell is not None and cell[1] in references[cell[0]].rows:
                    i, t = cell
                    np.testing.assert_array_equal(used_np[r, c], references[i].rows[t], err_msg=f"{i}:{t}")
                    replayed += 1
        assert replayed == sum(len(r.rows) for r in references)
    for layer in MOE_LAYERS:
        assert float(trainer.callback_metrics[f"used_agreement/layer_{layer:02d}"]) == 1.0
