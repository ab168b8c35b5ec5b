"""Building a run's pieces from the config: targets, trainer, callbacks, model, task and reward."""

from __future__ import annotations

import pytest

from r3lightning.app.job.main import compose_config
from r3lightning.app.job.setup import JobError


def test_instantiation_errors_name_the_key():
    from r3lightning.app.job.build import instantiate_node

    cfg = compose_config(["+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"])
    monitor = instantiate_node(cfg.callbacks.lr, "callbacks.lr")
    assert type(monitor).__name__ == "LearningRateMonitor"
    bad = compose_config(
        ["+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor", "+callbacks.lr.every=2"]
    )
    with pytest.raises(JobError, match=r"^callbacks\.lr: .*unexpected keyword argument 'every'"):
        instantiate_node(bad.callbacks.lr, "callbacks.lr")
    with pytest.raises(JobError, match=r"^task: task\.num_classes must be an integer >= 2, got 1$"):
        instantiate_node(compose_config(["task.num_classes=1"]).task, "task", vocab_size=96)


def test_trainer_keys_go_to_the_trainer_as_they_are(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from r3lightning.app.job.trainer import build_trainer

    cfg = compose_config(["trainer.enable_progress_bar=false"])
    trainer = build_trainer(cfg, tmp_path, [], grad_clip=1.0)
    # the job's defaults: CSV logger in the run folder, the algorithm's clip, one epoch per RL step
    assert isinstance(trainer.logger, CSVLogger) and trainer.logger.save_dir == str(tmp_path)
    assert trainer.gradient_clip_val == 1.0 and trainer.max_epochs == cfg.steps
    assert trainer.reload_dataloaders_every_n_epochs == 1
    cfg = compose_config(
        ["+trainer.gradient_clip_val=0.5", "+trainer.logger=false", "+trainer.max_steps=7", "steps=3"]
    )
    trainer = build_trainer(cfg, tmp_path, [], grad_clip=1.0)
    assert trainer.gradient_clip_val == 0.5 and trainer.logger is None
    assert trainer.max_steps == 7 and trainer.max_epochs == 3


def test_tensorboard_logger_only_when_installed(tmp_path):
    import importlib.util

    from r3lightning.app.job.trainer import tensorboard_if_installed

    logger = tensorboard_if_installed(str(tmp_path), name="tb")
    installed = importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
    if installed:
        assert type(logger).__name__ == "TensorBoardLogger" and logger.save_dir == str(tmp_path)
    else:
        assert logger is None


def test_replay_backend_follows_the_callbacks_config():
    from r3lightning.app.job.build import build_model, replay_backend
    from r3lightning.replay.hf.replay import HFRouterReplay

    cfg = compose_config()
    model = build_model(cfg.model)
    backend = replay_backend(cfg, model)
    assert isinstance(backend, HFRouterReplay) and backend.moe_layers == (1, 2, 3)
    with pytest.raises(
        JobError,
        match=r"^callbacks\.router_replay\.backend=megatron: no megatron TopKRouter found in "
        r"\['Qwen3MoeForCausalLM'\].* \(a Hugging Face model: use callbacks=router_replay\)$",
    ):
        replay_backend(compose_config(["callbacks=router_replay_megatron"]), model)
    with pytest.raises(
        JobError, match=r"^callbacks\.router_replay\.backend must be hf or megatron, got 'tpu'$"
    ):
        replay_backend(compose_config(["callbacks.router_replay.backend=tpu"]), model)


def test_callbacks_dict_entries_are_built_in_order_and_null_drops_one():
    from lightning.pytorch.callbacks import LearningRateMonitor

    from r3lightning.app.job.build import build_callbacks, build_model, replay_backend
    from r3lightning.replay.callback import RouterReplayCallback

    extra = [
        "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
        "+callbacks.lr.logging_interval=step",
    ]
    cfg = compose_config([*extra, "replay=off"])
    backend = replay_backend(cfg, build_model(cfg.model))
    replay, monitor = build_callbacks(cfg, backend, "off")
    assert isinstance(replay, RouterReplayCallback) and replay.backend is backend and replay.mode == "off"
    assert replay.strict is False  # the callback's own setting with the embedded engine
    assert isinstance(monitor, LearningRateMonitor) and monitor.logging_interval == "step"
    (only,) = build_callbacks(compose_config([*extra, "callbacks.router_replay=null"]), backend, "r3")
    assert isinstance(only, LearningRateMonitor)
    external = ["rollout.url=http://10.0.0.1:30000"]
    assert build_callbacks(compose_config(external), backend, "r3")[0].strict is True  # must return routes
    assert (
        build_callbacks(compose_config([*external, "replay.strict=false"]), backend, "r3")[0].strict is False
    )


def test_model_factories_take_dtype_and_attention_keywords(tmp_path):
    import torch

    from r3lightning.app.job.build import build_model
    from r3lightning.app.job.models import from_pretrained, tiny_moe

    model = build_model(
        compose_config(["model.dtype=bfloat16", "+model.overrides.num_hidden_layers=2"]).model
    )
    assert next(model.parameters()).dtype == torch.bfloat16 and model.config.num_hidden_layers == 2
    tiny_moe(seed=3).save_pretrained(tmp_path / "ckpt")
    loaded = from_pretrained(str(tmp_path / "ckpt"), dtype="bfloat16", attn_implementation="eager")
    assert next(loaded.parameters()).dtype == torch.bfloat16 and loaded.config._attn_implementation == "eager"
    reference = tiny_moe(seed=3)
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight.to(torch.bfloat16))
    with pytest.raises(
        ValueError, match="path must be a local checkpoint directory, /no/such/model is not one"
    ):
        from_pretrained("/no/such/model")
    with pytest.raises(JobError, match=r"^model: dtype must be a torch dtype name .* got 'float33'$"):
        build_model(compose_config(["model.dtype=float33"]).model)
    # the trainer's copy of a sharded checkpoint has no storage until FSDP2 loads its shards
    sharded = compose_config(
        ["model=hf_checkpoint", f"model.path={tmp_path / 'ckpt'}", "model.sharded_weights=/dcp"]
    )
    meta = build_model(sharded.model, trainer=True)
    assert all(p.is_meta for p in meta.parameters())
    assert not any(p.is_meta for p in build_model(sharded.model).parameters())  # the engine's copy
    with pytest.raises(
        JobError, match=r"^model\.sharded_weights needs model\.path: a directory with a config\.json"
    ):
        build_model(compose_config(["+model.sharded_weights=/dcp"]).model, trainer=True)


def test_task_and_reward_are_built_from_their_targets():
    import torch

    from r3lightning.app.job.build import build_task
    from r3lightning.app.tasks.token_class import ScoredTask, TokenClassTask

    task = build_task(compose_config(["task.num_classes=3"]), vocab_size=96)
    assert isinstance(task.prompts, TokenClassTask) and task.prompts.vocab_size == 96  # the model's vocab
    assert task.score.num_classes == 3  # the reward follows the task's keys
    prompts = task.sample_prompts(4, torch.Generator().manual_seed(0))
    assert all(4 <= p[-1] < 7 for p in prompts)
    assert task.reward([9, 9, 5], [1, 4, 7, 2]) == 0.75  # class 1: 1, 4, 7 of 4 tokens
    with pytest.raises(ValueError, match=r"^reward .*<lambda> returned nan; expected a finite number$"):
        ScoredTask(task.prompts, lambda p, r: float("nan")).reward([5], [1])
    assert task.guarded.timeout_s == 60.0 and task.pop_metrics() == {
        "reward/failures": 0.0,
        "reward/timeouts": 0.0,
    }
    with pytest.raises(JobError, match=r"reward must be callable .* add _partial_: true"):
        build_task(
            compose_config(
                [
                    "reward._target_=builtins.dict",
                    "~reward.num_classes",
                    "~reward.first_token",
                    "~reward.response_length",
                ]
            ),
            vocab_size=96,
        )


def test_reward_timeout_comes_from_the_reward_group(tmp_path):
    from r3lightning.app.job.build import build_task
    from r3lightning.app.models.tiny_tokenizer import save_tiny_checkpoint
    from r3lightning.rollout.prompts import TextReward

    assert build_task(compose_config(["reward.timeout_s=2.5"]), vocab_size=96).guarded.timeout_s == 2.5
    assert build_task(compose_config(["reward.timeout_s=null"]), vocab_size=96).guarded.timeout_s is None
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "reward_model": {"ground_truth": "2"}}\n')
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    dataset = ["task=prompts_file", f"task.path={data}", f"task.tokenizer={ckpt}", "reward.timeout_s=7"]
    task = build_task(compose_config(dataset), vocab_size=None)
    assert isinstance(task.guarded, TextReward) and task.guarded.timeout_s == 7.0
    assert task.guarded.compute_score.func.__name__ == "math_answer"  # timeout_s is not a scorer keyword
