"""Routes kept on the decoder layers a rank holds: Trajectory.route_layers, the buffer and the data
module cutting full-layer routes and refusing other layer sets, states that keep the ids, and
batches whose columns equal the full batch's columns at those ids."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from datamodule_support import Recorder, trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.collate import RolloutCollator, collate_trajectories
from r3lightning.data.datamodule import DataOptions, R3DataModule
from r3lightning.rollout.trajectory import Trajectory

L, K, E, KEPT = 4, 2, 8, (1, 3)


def full_routes(rows: int, seed: int) -> torch.Tensor:
    """[rows, L, K] int64, distinct experts per row (dense layer 0: zeros)."""
    scores = torch.rand(rows, L, E, generator=torch.Generator().manual_seed(seed))
    routes = scores.topk(K, dim=-1).indices
    routes[:, 0] = 0
    return routes


def trajectory(tag: int, routes: torch.Tensor | None = None, layers=None) -> Trajectory:
    prompt, response = [tag, 5], [6, 7, 8][: 1 + tag % 3]
    n = len(prompt) + len(response)
    rows = full_routes(n - 1, tag) if routes is None else routes
    return Trajectory(prompt, response, reward=float(tag), routed_experts=rows, route_layers=layers)


def kept_columns(t: Trajectory) -> list[list[list[int]]]:
    """The reference cut: each row's experts on KEPT, by plain indexing of the full routes."""
    full = full_routes(t.num_tokens - 1, int(t.prompt_ids[0]))
    return [[full[r, layer].tolist() for layer in KEPT] for r in range(len(full))]


def test_a_trajectory_names_its_route_columns_and_is_cut_to_held_layers():
    full = trajectory(7)
    cut = full.on_layers(KEPT)
    assert cut.route_layers == KEPT and cut.routed_experts.tolist() == kept_columns(full)
    assert full.route_layers is None and full.routed_experts.shape[1] == L  # the original is untouched
    assert cut.on_layers(KEPT) is cut and full.on_layers(None) is full
    sliced = trajectory(7, cut.routed_experts, layers=[1, 3])
    assert sliced == cut and sliced != full and "on layers [1, 3]" in repr(sliced)
    with pytest.raises(
        ValueError, match=r"Trajectory: route_layers \[1, 3\], expected route_layers \[2, 3\]"
    ):
        cut.on_layers((2, 3))
    with pytest.raises(ValueError, match=r"routes on all 4 layers, expected route_layers \[1, 4\] or routes"):
        full.on_layers((1, 4))  # lacks layer 4
    with pytest.raises(
        ValueError,
        match=r"Trajectory.routed_experts on route_layers \[1\]: shape \[3, 2, 2\] has 2 on axis 1, expected num_layers=1",
    ):
        trajectory(7, cut.routed_experts, layers=[1])
    with pytest.raises(ValueError, match=r"Trajectory.route_layers \[1\] given without routed_experts"):
        Trajectory([1], [2], route_layers=[1])
    with pytest.raises(ValueError, match=r"route_layers must be None or sorted, unique decoder-layer ids"):
        trajectory(7, cut.routed_experts, layers=[3, 1])


def test_a_buffer_cuts_full_routes_keeps_its_own_and_refuses_others_unchanged():
    buffer = ReplayBuffer(num_experts=E, layers=[1, 3])
    full, cut = trajectory(1), trajectory(2).on_layers(KEPT)
    buffer.extend([full, cut, Trajectory([9], [9])])
    stored = list(buffer)
    assert [t.route_layers for t in stored] == [KEPT, KEPT, None] and stored[1] is cut
    assert stored[0].routed_experts.tolist() == kept_columns(full) and full.routed_experts.shape[1] == L
    assert buffer.route_schema == (2, K)
    for bad, held in ((trajectory(3).on_layers((0, 1)), r"route_layers \[0, 1\]"),
                      (trajectory(4, full_routes(4, 4)[:, :3]), "routes on all 3 layers")):  # fmt: skip
        with pytest.raises(
            ValueError,
            match=rf"trajectory 1 of the batch rejected: Trajectory: {held}, expected route_layers \[1, 3\]",
        ):
            buffer.extend([trajectory(5), bad])
        assert list(buffer) == stored and buffer.stop == 3
    # without layers the first routes fix the layer set (routes on every layer are cut to it) until clear()
    free = ReplayBuffer()
    free.add(cut)
    with pytest.raises(
        ValueError, match=r"rejected: Trajectory: route_layers \[0, 2\], expected route_layers \[1, 3\]"
    ):
        free.add(trajectory(6).on_layers((0, 2)))
    free.add(trajectory(6))
    assert free[1].route_layers == KEPT and free[1].routed_experts.tolist() == kept_columns(trajectory(6))
    free.clear()
    free.add(trajectory(6))
    with pytest.raises(
        ValueError,
        match=r"rejected: Trajectory.route_layers is \[2, 3, 4, 5\], expected routes on every layer",
    ):
        free.add(trajectory(7, full_routes(3, 7), layers=(2, 3, 4, 5)))  # 4 columns, as the buffer's
    assert len(free) == 1 and free[0].route_layers is None


def test_buffer_state_keeps_the_layer_ids_and_goes_through_the_route_check():
    buffer = ReplayBuffer(num_experts=E, layers=KEPT)
    buffer.extend([trajectory(i) for i in range(4)])
    saved = io.BytesIO()
    torch.save(buffer.state_dict(), saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    for target in (ReplayBuffer(num_experts=E), ReplayBuffer(num_experts=E, layers=KEPT)):
        target.load_state_dict(state)
        assert list(target) == list(buffer) and all(t.route_layers == KEPT for t in target)
        target.extend([trajectory(9).on_layers(KEPT)])
    full = ReplayBuffer(num_experts=E)
    full.extend([trajectory(i) for i in range(4)])
    restored = ReplayBuffer(num_experts=E, layers=KEPT)
    restored.load_state_dict(full.state_dict())  # routes on every layer are cut on the way in
    assert list(restored) == list(buffer) and restored.route_schema == (2, K)
    other = ReplayBuffer(num_experts=E, layers=(2, 3))
    other.add(trajectory(8))
    with pytest.raises(ValueError, match=r"ReplayBuffer state route_layers is \[1, 3\], expected \[2, 3\]"):
        other.load_state_dict(state)
    assert len(other) == 1 and other[0].route_layers == (2, 3)
    routes = state["trajectories"]["routes"].clone()
    routes[0, 1, 1] = routes[0, 1, 0]  # column 1 is layer 3
    broken = {**state, "trajectories": {**state["trajectories"], "routes": routes}}
    with pytest.raises(
        ValueError,
        match=r"trajectory 0 rejected: Trajectory.routed_experts on route_layers \[1, 3\]: row 0 layer 3 repeats",
    ):
        restored.load_state_dict(broken)
    assert list(restored) == list(buffer)
    legacy = {k: v for k, v in full.state_dict().items() if k != "route_layers"}  # earlier states
    del legacy["trajectories"]["route_layers"]
    old = ReplayBuffer()
    old.load_state_dict(legacy)
    assert list(old) == list(full)


def test_batches_hold_the_full_batchs_columns_at_the_kept_ids():
    trajectories = [trajectory(i) for i in range(5)]
    full = collate_trajectories(trajectories)
    datamodule = R3DataModule(
        ReplayBuffer(num_experts=E), 5, shuffle=False, collate_threads=2, options=DataOptions(layers=KEPT)
    )
    datamodule.buffer.extend(trajectories)
    (batch,) = datamodule.train_dataloader()
    assert batch.route_layers == KEPT and full.route_layers is None
    assert torch.equal(batch.routed_experts.cu_seqlens, full.routed_experts.cu_seqlens)
    assert torch.equal(batch.routed_experts.values, full.routed_experts.values[:, list(KEPT)])
    assert batch.routed_experts.values.tolist() == [row for t in trajectories for row in kept_columns(t)]
    for name in ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs"):
        assert torch.equal(getattr(batch, name), getattr(full, name))
    # the ids travel with every cut, join, copy and placeholder
    parts = batch.split(2)
    assert all(p.route_layers == KEPT for p in [*parts, batch.select([4, 0]), batch.trim(), batch.cpu()])
    assert type(batch).cat(parts).equal(batch) and pickle.loads(pickle.dumps(batch)).equal(batch)
    padded = batch.pad_to_multiple(4, num_experts=E)
    assert padded.route_layers == KEPT and padded.routed_experts.row_shape == (2, K)
    with pytest.raises(ValueError, match=r"RolloutBatch.cat: different route_layers \[\(1, 3\), None\]"):
        type(batch).cat([batch, full])
    evened = RolloutCollator(num_threads=1, num_experts=E, layers=KEPT)(
        [trajectories[0], None]
    )  # a placeholder
    assert evened.route_layers == KEPT and evened.routed_experts[1].tolist() == [[[0, 1], [0, 1]]]


def test_the_data_module_refuses_routes_on_other_layers_naming_the_trajectory():
    buffer = ReplayBuffer(num_experts=E)
    buffer.extend([trajectory(i).on_layers((0, 1)) for i in range(3)])
    datamodule = R3DataModule(buffer, 3, shuffle=False, collate_threads=1, options=DataOptions(layers=KEPT))
    with pytest.raises(
        ValueError, match=r"trajectory 0 of the batch: route_layers \[0, 1\], expected route_layers \[1, 3\]"
    ):
        next(iter(datamodule.train_dataloader()))


class Evict(Callback):
    """Rollouts of the next step arrive after the first batch and push the oldest out."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            trainer.datamodule.buffer.extend([trajectory(10 + i) for i in range(3)])


def test_a_mid_epoch_data_module_state_with_sliced_routes_resumes_exactly(tmp_path):
    def datamodule(**buffer):
        return R3DataModule(ReplayBuffer(num_experts=E, capacity=6, **buffer), 2, seed=3, collate_threads=1)

    first = datamodule(layers=KEPT)
    first.buffer.extend([trajectory(i) for i in range(6)])
    uninterrupted = Recorder()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer(max_epochs=1, enable_checkpointing=True, callbacks=[checkpoints, Evict()]).fit(
        uninterrupted, datamodule=first
    )
    state = torch.load(tmp_path / "step=1.ckpt", weights_only=True)["R3DataModule"]
    assert state["snapshot"]["route_layers"] == list(KEPT)  # part of the epoch was evicted: packed
    for layers in (None, KEPT):  # a buffer without layers keeps the restored ids too
        fresh, resumed = datamodule(layers=layers), Recorder()
        trainer(max_epochs=1).fit(resumed, datamodule=fresh, ckpt_path=str(tmp_path / "step=1.ckpt"))
        assert [b.route_layers for b in resumed.seen] == [KEPT, KEPT]
        assert all(a.equal(b) for a, b in zip(resumed.seen, uninterrupted.seen[1:], strict=True))
