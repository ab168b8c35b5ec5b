import json
import warnings
from pathlib import Path

import pytest
import torch
from datamodule_support import REPO, Recorder, filled, flat, row_tags, tagged, tags_of, trainer
from gloo_ranks import run_ranks
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from runif import run_if

from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.datamodule import (
    DataOptions,
    R3DataModule,
    _Cursor,
    _EpochShardSampler,
    _Plan,
    _Snapshot,
)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("count", [0, 1, 7, 12])
@pytest.mark.parametrize("drop_last", [False, True])
def test_rank_shards_are_disjoint_and_cover_the_epoch(world, count, drop_last):
    batch_size = 2
    dataset = _Snapshot(tuple(range(count)))  # type: ignore[arg-type]
    plan = _Plan(batch_size, shuffle=True, seed=3, drop_last=drop_last, num_replicas=world)
    shards = [_EpochShardSampler(dataset, _Cursor(), plan, rank).shard(0) for rank in range(world)]
    real = [i for shard in shards for i in shard if i >= 0]
    assert len(real) == len(set(real))  # disjoint
    assert len({len(s) for s in shards}) == 1  # every rank runs the same number of samples
    if drop_last:
        assert all(len(s) == (count // world) // batch_size * batch_size for s in shards)
        assert -1 not in flat(shards)
    else:
        assert sorted(real) == list(range(count))  # covering, placeholders only to even out
        assert sum(s.count(-1) for s in shards) == -count % world


def test_each_epoch_has_a_new_order():
    dataset = _Snapshot(tuple(range(20)))  # type: ignore[arg-type]
    sampler = _EpochShardSampler(dataset, _Cursor(), _Plan(4, True, 0, False, 1), 0)
    assert sorted(sampler.shard(0)) == sorted(sampler.shard(1)) and sampler.shard(0) != sampler.shard(1)
    unshuffled = _EpochShardSampler(dataset, _Cursor(), _Plan(4, False, 0, False, 1), 0)
    assert unshuffled.shard(5) == list(range(20))


# ---------------------------------------------------------------------------- Lightning fit


def test_fit_sees_packed_routes_on_the_device_and_every_trajectory_once_per_epoch():
    buffer = filled(10)
    datamodule = R3DataModule(buffer, 3, collate_threads=2)
    module = Recorder()
    trainer(max_epochs=2, enable_model_summary=True).fit(module, datamodule=datamodule)
    assert [len(b) for b in module.seen] == [3, 3, 3, 1] * 2
    epochs = [sorted(flat(tags_of(module.seen[i : i + 4]))) for i in (0, 4)]
    assert epochs[0] == epochs[1] == list(range(100, 110))
    assert tags_of(module.seen[:4]) != tags_of(module.seen[4:])  # reshuffled per data epoch
    by_tag = {t.prompt_ids[0].item(): t for t in buffer}
    from collate_reference import assert_batch_matches

    for batch in module.seen:
        assert_batch_matches(batch, [by_tag[tag] for tag in row_tags(batch)])
    assert (datamodule.epoch, datamodule.batches_consumed) == (1, 4)


@run_if(cuda=True)
def test_gpu_fit_uses_the_pinned_pool_without_misses():
    datamodule = R3DataModule(filled(12), 2, collate_threads=2)
    module = Recorder()
    trainer(accelerator="gpu", max_epochs=2).fit(module, datamodule=datamodule)
    assert module.seen[0].routed_experts.device.type == "cuda" and len(module.seen) == 12
    pool = datamodule._collator.pool
    assert pool is not None and pool.misses == 0 and pool.hits == 12


def test_transfer_passes_other_inputs_through():
    datamodule = R3DataModule(filled(2), 2, collate_threads=1)
    cpu = torch.device("cpu")
    other = {"x": torch.ones(2), "name": "summary"}
    out = datamodule.transfer_batch_to_device(other, cpu, 0)
    assert out["name"] == "summary" and torch.equal(out["x"], other["x"])
    batch = next(iter(datamodule.train_dataloader()))
    assert datamodule.transfer_batch_to_device(batch, cpu, 0) is batch
    assert datamodule.batches_consumed == 0  # not training under a Trainer: not consumed


def test_transfer_to_another_device_returns_pooled_buffers():
    from r3lightning.data.collate import PinnedBufferPool, RolloutCollator

    pool = PinnedBufferPool(allocator=lambda shape, dtype: torch.empty(shape, dtype=dtype))
    collator = RolloutCollator(num_threads=1, pin_memory=pool)
    batch = collator([tagged(100), tagged(101)])
    assert collator.pool.free_slots == 1
    datamodule = R3DataModule(filled(1), 2, collate_threads=1)
    moved = datamodule.transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved.input_ids.device.type == "meta" and moved.routed_experts.device.type == "meta"
    assert collator.pool.free_slots == 2 and batch._lease is None


def test_interrupted_epoch_continues_in_the_next_fit_and_new_data_starts_a_new_epoch():
    buffer = filled(10)
    datamodule = R3DataModule(buffer, 3, collate_threads=1)
    first, second = Recorder(), Recorder()
    trainer(max_steps=2).fit(first, datamodule=datamodule)
    assert datamodule.batches_consumed == 2
    trainer(max_epochs=1).fit(second, datamodule=datamodule)
    assert len(second.seen) == 2
    assert sorted(flat(tags_of(first.seen + second.seen))) == list(range(100, 110))

    buffer.clear()
    buffer.extend([tagged(200 + i) for i in range(4)])
    third = Recorder()
    trainer(max_steps=1).fit(third, datamodule=datamodule)
    buffer.clear()  # the interrupted epoch's data is gone: the next fit starts over on new data
    buffer.extend([tagged(300 + i) for i in range(4)])
    fourth = Recorder()
    trainer(max_epochs=1).fit(fourth, datamodule=datamodule)
    assert sorted(flat(tags_of(fourth.seen))) == list(range(300, 304))
    assert datamodule.epoch == 2


class Refill(Callback):
    """The RL loop: new rollouts replace the buffer's contents after every epoch."""

    def __init__(self, buffer):
        self.buffer = buffer

    def on_train_epoch_end(self, trainer, pl_module):
        self.buffer.clear()
        self.buffer.extend([tagged(100 * (trainer.current_epoch + 2) + i) for i in range(5)])


def test_reloading_every_epoch_trains_on_each_steps_rollouts():
    buffer = filled(5)
    datamodule = R3DataModule(buffer, 2, collate_threads=1)
    module = Recorder()
    trainer(max_epochs=3, reload_dataloaders_every_n_epochs=1, callbacks=[Refill(buffer)]).fit(
        module, datamodule=datamodule
    )
    per_epoch = [sorted(flat(tags_of(module.seen[i : i + 3]))) for i in (0, 3, 6)]
    assert per_epoch == [list(range(100 * k, 100 * k + 5)) for k in (1, 2, 3)]


# ---------------------------------------------------------------------------- resume


class EvictEarly(Callback):
    """New rollouts arrive mid-epoch and push the oldest trajectories out of the buffer."""

    def __init__(self, buffer):
        self.buffer = buffer

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            self.buffer.extend([tagged(200 + i) for i in range(3)])


def test_mid_epoch_checkpoint_resumes_with_exactly_the_remaining_batches(tmp_path):
    buffer = filled(10, capacity=10)
    datamodule = R3DataModule(buffer, 3, collate_threads=2)
    uninterrupted = Recorder()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer(max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints, EvictEarly(buffer)]).fit(
        uninterrupted, datamodule=datamodule
    )
    assert len(uninterrupted.seen) == 8
    for step in (2, 6):  # mid-epoch in the first and in the second epoch
        ckpt = tmp_path / f"step={step}.ckpt"
        state = torch.load(ckpt, weights_only=True)["R3DataModule"]
        assert state["cursor"]["consumed"] == step % 4 and state["snapshot"] is not None  # 100..102 evicted
        resumed = Recorder()
        fresh = R3DataModule(ReplayBuffer(capacity=10, num_experts=8), 3, collate_threads=1)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*dataloader is not resumable.*")
            trainer(max_epochs=2).fit(resumed, datamodule=fresh, ckpt_path=str(ckpt))
        assert len(resumed.seen) == 8 - step
        assert all(a.equal(b) for a, b in zip(resumed.seen, uninterrupted.seen[step:], strict=True))
        assert sorted(t.prompt_ids[0].item() for t in fresh.buffer) == sorted(
            t.prompt_ids[0].item() for t in buffer
        )


def test_end_of_epoch_checkpoint_in_the_rl_loop_resumes_on_the_next_steps_rollouts(tmp_path):
    buffer = filled(5)
    datamodule = R3DataModule(buffer, 2, collate_threads=1)
    uninterrupted = Recorder()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    loop = {"max_epochs": 3, "reload_dataloaders_every_n_epochs": 1}
    trainer(**loop, enable_checkpointing=True, callbacks=[checkpoints, Refill(buffer)]).fit(
        uninterrupted, datamodule=datamodule
    )
    fresh_buffer = ReplayBuffer(num_experts=8)
    resumed = Recorder()
    fresh = R3DataModule(fresh_buffer, 2, collate_threads=1)
    trainer(**loop, callbacks=[Refill(fresh_buffer)]).fit(
        resumed, datamodule=fresh, ckpt_path=str(tmp_path / "epoch=0.ckpt")
    )
    assert len(resumed.seen) == 6
    assert all(a.equal(b) for a, b in zip(resumed.seen, uninterrupted.seen[3:], strict=True))


def test_resuming_mid_epoch_with_other_settings_is_refused():
    datamodule = R3DataModule(filled(10), 3, collate_threads=1)
    trainer(max_steps=1).fit(Recorder(), datamodule=datamodule)
    state = datamodule.state_dict()
    other = R3DataModule(ReplayBuffer(num_experts=8), 4, collate_threads=1)
    other.load_state_dict(state)
    with pytest.raises(
        ValueError, match=r"cannot continue epoch 0 mid-way with changed settings.*batch_size': \(3, 4\)"
    ):
        other.train_dataloader()
    with pytest.raises(ValueError, match=r"state version"):
        other.load_state_dict({**state, "version": 0})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
        ({"collate_threads": 0}, "collate_threads must be an int >= 1, got 0"),
        ({"options": {"shard": False}}, "options must be a DataOptions or None, got dict"),
        ({"seed": 1.5}, r"seed must be an int, got 1\.5"),
        ({"shuffle": "yes"}, "shuffle must be a bool, got 'yes'"),
        ({"drop_last": 1}, "drop_last must be a bool, got 1"),
        ({"pin_memory": "auto"}, "pin_memory must be a bool or None, got 'auto'"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_field(kwargs, match):
    settings = {"batch_size": 2, **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        R3DataModule(ReplayBuffer(), settings.pop("batch_size"), **settings)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"width_multiple": 0}, "width_multiple must be an int >= 1, got 0"),
        ({"pad_token_id": -1}, "pad_token_id must be an int >= 0, got -1"),
        ({"shard": 1}, "shard must be a bool, got 1"),
        ({"layers": [3, 1]}, r"layers must be None or sorted, unique decoder-layer ids >= 0, got \[3, 1\]"),
        ({"layers": [-1]}, "layers must be None or sorted"),
    ],
)
def test_bad_data_options_fail_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataOptions(**kwargs)
    with pytest.raises(TypeError, match="eval_buffer must be a ReplayBuffer or None, got list"):
        DataOptions(eval_buffer=[])


def test_hydra_config_instantiates_the_data_module():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "conf" / "data" / "default.yaml")
    datamodule = instantiate(cfg, buffer=filled(3))
    assert isinstance(datamodule, R3DataModule) and datamodule.batch_size == cfg.batch_size
    assert (datamodule.shuffle, datamodule.pin_memory, datamodule.drop_last) == (True, None, False)
    assert datamodule.options == DataOptions(shard=False) and datamodule.shard is False


# ---------------------------------------------------------------------------- ddp (2 processes, gloo)


def _ddp_worker(rank, out_dir):
    torch.set_num_threads(1)
    buffer = filled(11)
    datamodule = R3DataModule(buffer, 2, collate_threads=2)
    module = Recorder()
    fit = trainer(devices=2, strategy="ddp", max_epochs=1)
    fit.fit(module, datamodule=datamodule)
    Path(out_dir, f"rank{fit.global_rank}.json").write_text(json.dumps(tags_of(module.seen)))


@pytest.mark.slow
def test_two_process_ddp_ranks_collate_disjoint_shards_covering_the_epoch(tmp_path):
    run_ranks(_ddp_worker, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [[len(b) for b in batches] for batches in ranks] == [[2, 2, 2], [2, 2, 2]]
    rows = [[tag for batch in batches for tag in batch] for batches in ranks]
    real = [[t for t in r if t is not None] for r in rows]
    assert not set(real[0]) & set(real[1])
    assert sorted(real[0] + real[1]) == list(range(100, 111))
    assert sum(r.count(None) for r in rows) == 1  # one placeholder evens out 11 over 2 ranks
