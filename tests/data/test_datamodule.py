import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from gloo_ranks import run_ranks
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from runif import run_if

from r3lightning.data.batch import RolloutBatch
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.datamodule import R3DataModule, _Cursor, _EpochShardSampler, _Plan, _Snapshot
from r3lightning.data.trajectory import Trajectory
from r3lightning.packed import PackedTensor

REPO = Path(__file__).resolve().parents[2]


def tagged(tag, rows=None):
    """Trajectory identified by its first prompt token; routes cover every forwarded token."""
    prompt, response = [tag, 1 + tag % 3], [2, 3][: tag % 3]
    n = len(prompt) + len(response)
    routes = torch.arange((n - 1) * 4).reshape(n - 1, 2, 2) % 8 if rows is None else rows
    return Trajectory(prompt, response, reward=float(tag % 5), routed_experts=routes)


def filled(count, first=100, **kwargs):
    buffer = ReplayBuffer(num_experts=8, **kwargs)
    buffer.extend([tagged(first + i) for i in range(count)])
    return buffer


def row_tags(batch):
    """First real token of every row (the trajectory's tag); placeholders (pad id 0) -> None."""
    seq, _ = batch.lengths_host()
    tags = [int(batch.input_ids[i, batch.width - int(seq[i])]) for i in range(len(batch))]
    return [t or None for t in tags]


class Recorder(pl.LightningModule):
    """Checks what the model sees and keeps every training batch."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen = []
        self.example_input_array = torch.zeros(2, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        assert isinstance(batch, RolloutBatch)
        assert isinstance(batch.routed_experts, PackedTensor)
        assert batch.routed_experts.device == self.device and batch.input_ids.device == self.device
        self.seen.append(batch)
        return self.layer(batch.loss_mask.sum(1, keepdim=True)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(**kwargs):
    defaults = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**defaults, **kwargs})


def flat(lists):
    return [x for inner in lists for x in inner]


def tags_of(batches):
    return [row_tags(b) for b in batches]


# ---------------------------------------------------------------------------- sharding


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
    from r3lightning.data.collate import RolloutCollator

    collator = RolloutCollator(
        num_threads=1, pin_memory=True, allocator=lambda shape, dtype: torch.empty(shape, dtype=dtype)
    )
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
        ({"batch_size": 0}, "batch_size must be a positive int, got 0"),
        ({"collate_threads": 0}, "collate_threads must be an int >= 1, got 0"),
        ({"width_multiple": 0}, "width_multiple must be an int >= 1, got 0"),
        ({"pad_token_id": -1}, "pad_token_id must be an int >= 0, got -1"),
        ({"seed": 1.5}, r"seed must be an int, got 1\.5"),
        ({"shuffle": "yes"}, "shuffle must be a bool, got 'yes'"),
        ({"drop_last": 1}, "drop_last must be a bool, got 1"),
        ({"pin_memory": "auto"}, "pin_memory must be a bool or None, got 'auto'"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_field(kwargs, match):
    settings = {"batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        R3DataModule(ReplayBuffer(), settings.pop("batch_size"), **settings)


def test_hydra_config_instantiates_the_data_module():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "conf" / "data" / "default.yaml")
    datamodule = instantiate(cfg, buffer=filled(3))
    assert isinstance(datamodule, R3DataModule) and datamodule.batch_size == cfg.batch_size
    assert (datamodule.shuffle, datamodule.pin_memory, datamodule.drop_last) == (True, None, False)


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


class Evaluator(Recorder):
    """A Recorder that also validates, tests and predicts, keeping the row tags it saw."""

    def __init__(self):
        super().__init__()
        self.evaluated = {"validate": [], "test": [], "predict": []}

    def validation_step(self, batch, batch_idx):
        self.evaluated["validate"].append(row_tags(batch))

    def test_step(self, batch, batch_idx):
        self.evaluated["test"].append(row_tags(batch))

    def predict_step(self, batch, batch_idx):
        self.evaluated["predict"].append(row_tags(batch))
        return batch.rewards


class ConsumedAtValidation(Callback):
    def __init__(self):
        self.consumed = []

    def on_validation_end(self, trainer, pl_module):
        self.consumed.append(trainer.datamodule.batches_consumed)


def test_eval_loaders_read_the_eval_buffer_in_order_and_never_move_the_training_position():
    eval_buffer = filled(5, first=300)
    datamodule = R3DataModule(filled(6), 3, eval_buffer=eval_buffer, collate_threads=1)
    module = Evaluator()
    for run in ("validate", "test", "predict"):
        getattr(trainer(), run)(module, datamodule=datamodule)
        assert module.evaluated[run] == [[300, 301, 302], [303, 304]]
        assert datamodule.batches_consumed == 0 and datamodule.epoch == -1
    # validation inside fit, after every training batch: the position counts training batches only
    seen = ConsumedAtValidation()
    module = Evaluator()
    trainer(max_epochs=1, val_check_interval=1, callbacks=[seen]).fit(module, datamodule=datamodule)
    assert seen.consumed == [1, 2] and datamodule.batches_consumed == 2
    assert module.evaluated["validate"] == [[300, 301, 302], [303, 304]] * 2
    assert sorted(flat(row_tags(b) for b in module.seen)) == list(range(100, 106))


def test_without_an_eval_buffer_there_is_no_validation():
    datamodule = R3DataModule(filled(4), 2, collate_threads=1)
    module = Evaluator()
    with pytest.raises(MisconfigurationException, match="val_dataloader"):
        trainer().validate(module, datamodule=datamodule)
    trainer(max_epochs=1).fit(module, datamodule=datamodule)
    assert module.evaluated["validate"] == [] and len(module.seen) == 2
    with pytest.raises(TypeError, match="eval_buffer must be a ReplayBuffer or None, got list"):
        R3DataModule(filled(4), 2, eval_buffer=[])


def test_settings_are_saved_as_hparams_and_in_checkpoints(tmp_path):
    datamodule = R3DataModule(filled(4), 2, shuffle=False, seed=7, collate_threads=1, eval_buffer=filled(2))
    expected = {
        "batch_size": 2,
        "shuffle": False,
        "seed": 7,
        "collate_threads": 1,
        "pin_memory": None,
        "drop_last": False,
        "pad_token_id": 0,
        "width_multiple": 1,
        "shard": True,
    }
    assert dict(datamodule.hparams) == expected
    fit = trainer(max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path)
    fit.fit(Recorder(), datamodule=datamodule)
    ckpt = torch.load(fit.checkpoint_callback.best_model_path, weights_only=False)
    assert dict(ckpt["datamodule_hyper_parameters"]) == expected


class ReplaceAtTrainStart(Callback):
    """New rollouts replace the whole buffer after Lightning built the loader, before any draw."""

    def on_train_start(self, trainer, pl_module):
        trainer.datamodule.buffer.extend([tagged(200 + i) for i in range(6)])


def test_an_epoch_whose_loader_was_built_but_not_drawn_from_covers_rows_appended_meanwhile():
    # by hand: build, append, iterate
    buffer = filled(4)
    datamodule = R3DataModule(buffer, 2, shuffle=False, collate_threads=1)
    loader = datamodule.train_dataloader()
    buffer.extend([tagged(200), tagged(201)])
    assert [row_tags(b) for b in loader] == [[100, 101], [102, 103], [200, 201]]
    assert len(loader) == 3
    # a second pass over the same loader is another epoch over the same snapshot
    buffer.extend([tagged(202)])
    assert flat(row_tags(b) for b in loader) == [100, 101, 102, 103, 200, 201]
    # under Lightning: the loader is built at fit start, rows arrive in on_train_start
    datamodule = R3DataModule(filled(6, capacity=6), 3, shuffle=False, collate_threads=1)
    module = Recorder()
    trainer(max_epochs=1, callbacks=[ReplaceAtTrainStart()]).fit(module, datamodule=datamodule)
    assert [row_tags(b) for b in module.seen] == [[200, 201, 202], [203, 204, 205]]


class SlotRecorder(Recorder):
    """Notes each batch's pooled input_ids buffer (before transfer) and its float dtypes."""

    def __init__(self):
        super().__init__()
        self.pointers, self.dtypes = [], []

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.pointers.append(batch.input_ids.data_ptr())
        return batch

    def training_step(self, batch, batch_idx):
        self.dtypes.append(
            {n: getattr(batch, n).dtype for n in ("loss_mask", "rollout_logprobs", "advantages")}
        )
        self.seen.append(batch)
        return self.layer(self.layer.weight.new_ones(1, 1)).sum()


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_the_pool_alternates_its_slots_and_batches_keep_float32_under_fit(monkeypatch, precision):
    from r3lightning.data import collate
    from r3lightning.data.fill import plain_empty

    monkeypatch.setattr(collate, "pinned_empty", plain_empty)  # the pool's logic without CUDA
    buffer = ReplayBuffer(num_experts=8)
    logprobs = torch.tensor([-20.123456, -0.987654321, -3.3333333])
    buffer.extend(
        Trajectory([t, 1], [2, 3, 4], rollout_logprobs=logprobs * (t - 99), advantage=0.1 * t)
        for t in range(100, 108)
    )
    datamodule = R3DataModule(buffer, 2, shuffle=False, pin_memory=True, collate_threads=1)
    module = SlotRecorder()
    trainer(max_epochs=1, precision=precision).fit(module, datamodule=datamodule)
    pool = datamodule._collator.pool
    assert pool.misses == 0 and pool.hits == 4
    a, b = module.pointers[:2]
    assert a != b and module.pointers == [a, b, a, b]  # the least recently released slot
    assert (
        module.dtypes == [dict.fromkeys(("loss_mask", "rollout_logprobs", "advantages"), torch.float32)] * 4
    )
    for i, batch in enumerate(module.seen):  # exact float32 values, not bf16-rounded ones
        for row, t in enumerate((100 + 2 * i, 101 + 2 * i)):
            assert torch.equal(batch.rollout_logprobs[row, 2:], logprobs * (t - 99))
            assert batch.advantages[row] == torch.tensor(0.1 * t, dtype=torch.float32)
    # Lightning's conversion hands the very batch through (lease and pinned storage included)
    batch = datamodule.train_dataloader().collate_fn([buffer[0]])
    from lightning.pytorch.plugins.precision import HalfPrecision

    assert HalfPrecision("bf16-true").convert_input(batch) is batch
