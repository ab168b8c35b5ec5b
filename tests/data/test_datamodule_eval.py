import pytest
import torch
from datamodule_support import Recorder, filled, flat, row_tags, tagged, trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.datamodule import DataOptions, R3DataModule
from r3lightning.rollout.trajectory import Trajectory


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
    datamodule = R3DataModule(filled(6), 3, collate_threads=1, options=DataOptions(eval_buffer=eval_buffer))
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
        R3DataModule(filled(4), 2, options=DataOptions(eval_buffer=[]))


def test_settings_are_saved_as_hparams_and_in_checkpoints(tmp_path):
    options = DataOptions(layers=[1], eval_buffer=filled(2))
    datamodule = R3DataModule(filled(4), 2, shuffle=False, seed=7, collate_threads=1, options=options)
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
        "layers": (1,),
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
