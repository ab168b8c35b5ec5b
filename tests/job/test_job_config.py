"""Hydra composition of the main job's config: every option of every group, overrides, errors."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from r3lightning.job.main import compose_config
from r3lightning.job.setup import CONF_DIR, JobError, _trainer_kwargs, check_config, replay_settings

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_every_group_is_in_the_defaults_list():
    defaults = OmegaConf.load(CONF_DIR / "config.yaml").defaults
    named = {next(iter(d)) for d in defaults if isinstance(d, dict) or OmegaConf.is_dict(d)}
    assert set(GROUPS) <= named, f"groups missing from config.yaml defaults: {set(GROUPS) - named}"
    assert {"model", "rollout", "data", "algorithm", "callbacks", "trainer", "replay", "experiment"} <= set(
        GROUPS
    )


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)], ids=lambda v: str(v))
def test_each_option_composes_and_resolves(group, option):
    overrides = [f"{group}={option}"]
    if (group, option) == ("model", "hf_checkpoint"):
        overrides.append("model.path=/models/some-moe")
    if (group, option) == ("task", "prompts_file"):
        overrides += ["task.path=/data/train.parquet", "task.tokenizer=/models/some-moe"]
    if group == "rollout" and option == "skyrl":
        overrides.append("rollout.url=http://127.0.0.1:30000")
    cfg = compose_config(overrides)
    container = OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert isinstance(container, dict)
    if group == "experiment":
        return
    if group in ("data", "callbacks"):  # targets the job builds from these groups
        _check_targets(cfg)
        return
    chosen = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
    for key in chosen:
        if key in ("defaults", "url", "path") or OmegaConf.is_interpolation(chosen, key):
            continue
        assert OmegaConf.select(cfg, f"{group}.{key}") == chosen[key], f"{group}.{key}"


def _check_targets(cfg):
    from hydra.utils import get_class

    from r3lightning.data.datamodule import R3DataModule
    from r3lightning.replay.callback import RouterReplayCallback

    assert get_class(cfg.data._target_) is R3DataModule
    callbacks = cfg.callbacks if "_target_" in cfg.callbacks else cfg.callbacks.router_replay
    assert get_class(callbacks._target_) is RouterReplayCallback


def test_default_config_values():
    cfg = compose_config()
    assert cfg.replay.mode == "r3" and cfg.replay.request_routes is True
    assert cfg.rollout.url is None and cfg.rollout.protocol == "skyrl"
    assert cfg.rollout.server.dtype == "bfloat16"
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.precision == "32-true"
    assert cfg.model.family == "qwen3_moe" and cfg.model.seed == cfg.seed
    assert cfg.rollout.sampling.max_new_tokens == cfg.task.response_length
    assert list(cfg.compare) == []
    check_config(cfg)


def test_replay_off_and_compare_and_external_engine_overrides():
    off = compose_config(["replay=off"])
    assert off.replay.mode == "off" and off.replay.request_routes is True  # not YAML's boolean off
    r2 = compose_config(["replay=r2"])
    assert r2.replay.mode == "r2" and r2.replay.request_routes is False
    compare = compose_config(["experiment=compare"])
    assert list(compare.compare) == ["r3", "off"]
    swapped = replay_settings(compare, "off")
    assert swapped.replay.mode == "off" and compare.replay.mode == "r3"
    ext = compose_config(["rollout.url=http://10.0.0.1:30000", "rollout.protocol=sglang"])
    assert ext.rollout.url == "http://10.0.0.1:30000" and ext.rollout.protocol == "sglang"
    check_config(ext)
    with pytest.raises(JobError, match=r"rollout\.url must be set"):
        check_config(compose_config(["rollout=skyrl"]))
    with pytest.raises(JobError, match=r"rollout\.url must be set"):
        check_config(compose_config(["experiment=fsdp_moe", "model.path=/m"]))
    smoke = compose_config(["experiment=smoke"])
    assert smoke.steps < compose_config().steps


def test_fsdp_trainer_instantiates_its_strategy():
    from lightning.pytorch.strategies import ModelParallelStrategy

    kwargs = _trainer_kwargs(compose_config(["trainer=gpu_fsdp"]).trainer)
    assert isinstance(kwargs["strategy"], ModelParallelStrategy)
    assert kwargs["accelerator"] == "gpu" and kwargs["devices"] == 8
    assert kwargs["strategy"]._data_parallel_size == 8 and kwargs["strategy"]._tensor_parallel_size == 1


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["steps=0"], "steps must be an integer >= 1, got 0"),
        (["prompts_per_step=two"], "prompts_per_step must be an integer >= 1, got 'two'"),
        (["algorithm.group_size=1"], "algorithm.group_size must be an integer >= 2, got 1"),
        (["replay.mode=r4"], "replay.mode must be one of \\['r3', 'r2', 'off'\\], got 'r4'"),
        (
            ["rollout.protocol=grpc"],
            "rollout.protocol must be one of \\['skyrl', 'vllm', 'sglang', 'openai'\\]",
        ),
        (
            ["rollout.protocol=vllm"],
            "rollout.protocol=vllm needs rollout.url .* speaks \\['skyrl', 'sglang'\\]",
        ),
        (["rollout=openai"], "rollout.protocol=openai needs rollout.url"),
        (["rollout.url=localhost:30000"], "rollout.url must be null .* got 'localhost:30000'"),
        (["algorithm.optim.lr=-1"], "algorithm.optim.lr must be a number > 0, got -1"),
        (
            ["callbacks.router_replay.pad_to_multiple=0"],
            "callbacks.router_replay.pad_to_multiple must be an integer >= 1, got 0",
        ),
    ],
)
def test_bad_values_are_rejected_with_the_key(overrides, message):
    with pytest.raises(JobError, match=message):
        check_config(compose_config(overrides))


def test_unknown_group_option_and_key_fail_at_composition():
    with pytest.raises(ConfigCompositionException, match="replay"):
        compose_config(["replay=sometimes"])
    with pytest.raises(ConfigCompositionException, match="no_such_key"):
        compose_config(["no_such_key=1"])


async def test_sglang_weight_sync_through_a_shared_directory(tmp_path):
    """rollout.weight_sync_dir: the weights land in the directory as bf16 safetensors (plus the
    checkpoint's config.json) and the engine is told to load them; a refusal is a JobError."""
    import asyncio
    import json

    import torch
    from aiohttp import web
    from safetensors.torch import load_file

    from r3lightning.job.engine import _sglang_disk_push

    answers = [{"success": True, "message": "ok"}, {"success": False, "message": "shape mismatch"}]
    seen: list[dict] = []

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"body": body, "weights": load_file(f"{body['model_path']}/model.safetensors")})
        return web.json_response(answers[len(seen) - 1])

    app = web.Application()
    app.router.add_post("/update_weights_from_disk", update)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    target = tmp_path / "shared"
    push = _sglang_disk_push([url], None, 10.0, target, str(source))
    state = {"lm_head.weight": torch.randn(3, 2), "model.norm.weight": torch.arange(4.0)}
    try:
        await asyncio.to_thread(push, state)
        assert seen[0]["body"] == {"model_path": str(target)}
        assert set(seen[0]["weights"]) == set(state)
        for name, value in state.items():
            assert seen[0]["weights"][name].dtype == torch.bfloat16
            assert torch.equal(seen[0]["weights"][name], value.to(torch.bfloat16))
        assert json.loads((target / "config.json").read_text()) == {"model_type": "qwen3_moe"}
        with pytest.raises(
            JobError, match=r"update_weights_from_disk at .* failed: HTTP 200: .*shape mismatch"
        ):
            await asyncio.to_thread(push, state)
    finally:
        await runner.cleanup()


def test_external_engine_weight_sync_follows_the_protocol(tmp_path, monkeypatch):
    """Every rank joins the full-weight gather exactly when rank 0 has somewhere to push it."""
    from r3lightning.job.engine import embedded_server

    url = ["rollout.url=http://10.0.0.1:30000/"]
    sglang = [*url, "rollout.protocol=sglang"]
    with embedded_server(compose_config([*url, "rollout=skyrl"])) as engine:
        assert engine.urls == ["http://10.0.0.1:30000"] and engine.push is not None and engine.gather
    with embedded_server(compose_config([*sglang, f"rollout.weight_sync_dir={tmp_path}"])) as engine:
        assert engine.push is not None and engine.gather
    with (
        pytest.warns(UserWarning, match="weight_sync_dir is not set"),
        embedded_server(compose_config(sglang)) as engine,
    ):
        assert engine.push is None and not engine.gather  # nothing to push: no collective either
    with embedded_server(compose_config([*url, "rollout.sync_weights=false"])) as engine:
        assert engine.push is None and not engine.gather
    monkeypatch.setenv("RANK", "1")  # other ranks join the gather but never push
    with embedded_server(compose_config([*url, "rollout=skyrl"])) as engine:
        assert engine.push is None and engine.gather
    with embedded_server(compose_config([])) as engine:  # the embedded server runs on rank 0 only
        assert engine.urls is None and engine.push is None and engine.gather


# ---------------------------------------------------------------------------- _target_ and values


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data._target_=does.not.Exist"], r"^data\._target_: cannot import 'does\.not\.Exist'"),
        (
            ["callbacks.router_replay._target_=does.not.Exist"],
            r"^callbacks\.router_replay\._target_: cannot import 'does\.not\.Exist'",
        ),
        (["+callbacks.extra._target_=nowhere.Callback"], r"^callbacks\.extra\._target_: cannot import"),
        (["module._target_=r3lightning.job.module.NoSuchModule"], r"^module\._target_: cannot import"),
        (["reward._target_=nowhere.reward"], r"^reward\._target_: cannot import"),
        (["model._target_=nowhere.build"], r"^model\._target_: cannot import"),
        (["seed=abc"], r"^seed must be an integer, got 'abc'$"),
        (["algorithm.clip_low=abc"], r"^algorithm\.clip_low must be a number, got 'abc'$"),
        (["algorithm.normalize_std=maybe"], r"^algorithm\.normalize_std must be true or false, got 'maybe'$"),
        (["+algorithm.clip=0.2"], r"^algorithm\.clip is not a setting here; expected one of \['group_size'"),
        (
            ["algorithm.optim.grad_clip=abc"],
            r"^algorithm\.optim\.grad_clip must be a number or null, got 'abc'$",
        ),
        (["loggers=[csv]"], r"^loggers\[0\] must be a mapping with a _target_, got 'csv'$"),
        (
            ["loggers=[{_target_: nowhere.Logger}]"],
            r"^loggers\[0\]\._target_: cannot import 'nowhere\.Logger'",
        ),
        (["rollout.retry.timeout_s=0"], r"^rollout\.retry\.timeout_s must be a number > 0, got 0\.0$"),
        (
            ["+trainer.max_epochs=3"],
            r"^trainer\.max_epochs is set by the job; use steps \(one epoch is one RL step\)$",
        ),
    ],
)
def test_bad_target_or_value_names_the_key(overrides, message):
    with pytest.raises(JobError, match=message):
        check_config(compose_config(overrides))


def test_instantiation_errors_name_the_key():
    from r3lightning.job.build import instantiate_node

    cfg = compose_config(["+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor"])
    monitor = instantiate_node(cfg.callbacks.lr, "callbacks.lr")
    assert type(monitor).__name__ == "LearningRateMonitor"
    bad = compose_config(
        ["+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor", "+callbacks.lr.every=2"]
    )
    with pytest.raises(JobError, match=r"^callbacks\.lr: .*unexpected keyword argument 'every'"):
        instantiate_node(bad.callbacks.lr, "callbacks.lr")
    with pytest.raises(JobError, match=r"^task: task\.num_classes must be >= 2, got 1$"):
        instantiate_node(compose_config(["task.num_classes=1"]).task, "task", vocab_size=96)


def test_trainer_keys_go_to_the_trainer_as_they_are(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from r3lightning.job.setup import build_trainer

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

    from r3lightning.job.build import tensorboard_if_installed

    logger = tensorboard_if_installed(str(tmp_path), name="tb")
    installed = importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
    if installed:
        assert type(logger).__name__ == "TensorBoardLogger" and logger.save_dir == str(tmp_path)
    else:
        assert logger is None


def test_help_lists_groups_options_and_yaml_comments():
    from r3lightning.job.help import format_help

    text = format_help(CONF_DIR)
    for group in GROUPS:
        assert f"\n  {group}:\n" in text
        for option in _options(group):
            assert option in text
    lines = text.splitlines()

    def line_of(start: str) -> str:
        return next(line for line in lines if line.strip().startswith(start))

    assert "* tiny_qwen3_moe" in line_of("* tiny_qwen3_moe") and "Tiny random Qwen3-MoE" in line_of(
        "* tiny_qwen3_moe"
    )
    assert "Tiny random megatron-core MoE" in line_of("tiny_megatron_moe")
    assert line_of("steps=30").endswith(
        "RL steps; each = one rollout of the current policy + one pass of updates"
    )
    assert line_of("callbacks.router_replay.strict=false").endswith(
        "true: raise instead of routing natively when routes are missing (the job: replay.strict wins "
        "when set; r3 with an external engine is strict)"  # a comment continued on the next line
    )
    assert line_of("rollout.weight_sync_dir=null").endswith(
        "sglang: a directory the engine can read; weights are saved there and loaded with POST "
        "/update_weights_from_disk"
    )


# ---------------------------------------------------------------------------- resume checks


def _ckpt(path, state_dict, epoch):
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"epoch": epoch, "global_step": epoch + 1, "state_dict": state_dict}, path)


def test_resume_refuses_unreadable_foreign_or_overtaken_checkpoints(tmp_path):
    from r3lightning.job.checkpoint import resume_checkpoint
    from r3lightning.job.module import GRPOModule
    from r3lightning.testing.tiny import build_tiny_moe, tiny_moe_config

    module = GRPOModule(build_tiny_moe(seed=0))
    last = tmp_path / "checkpoints" / "last.ckpt"
    fix = "delete it to start this run over, or set resume=false or another hydra.run.dir"
    assert resume_checkpoint(compose_config(["steps=3"]), tmp_path, module) is None  # nothing to resume
    _ckpt(last, module.state_dict(), epoch=1)  # two steps done
    assert resume_checkpoint(compose_config(["steps=3"]), tmp_path, module) == str(last)
    assert resume_checkpoint(compose_config(["steps=3", "resume=false"]), tmp_path, module) is None
    with pytest.raises(
        JobError, match=rf"^steps=1 is below the 2 steps this run has done \({last}\); set steps=2"
    ):
        resume_checkpoint(compose_config(["steps=1"]), tmp_path, module)
    other = GRPOModule(build_tiny_moe(tiny_moe_config(num_hidden_layers=2), seed=0))
    _ckpt(last, other.state_dict(), epoch=1)
    with pytest.raises(
        JobError, match=rf"^checkpoint {last} was saved for another model \(model\.model\.layers\.2\."
    ):
        resume_checkpoint(compose_config(["steps=3"]), tmp_path, module)
    _ckpt(last, module.state_dict(), epoch=1)
    whole = last.read_bytes()
    for content in (b"", b"garbage" * 10, whole[: len(whole) // 2]):
        last.write_bytes(content)
        with pytest.raises(JobError) as info:
            resume_checkpoint(compose_config(["steps=3"]), tmp_path, module)
        message = str(info.value)
        assert message.startswith(f"checkpoint {last} cannot be read (") and message.endswith(fix)
        assert "\n" not in message
        assert last.read_bytes() == content  # nothing was touched


def test_replay_backend_follows_the_callbacks_config():
    from r3lightning.job.setup import build_model, replay_backend
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

    from r3lightning.job.setup import _callbacks, build_model, replay_backend
    from r3lightning.replay.callback import RouterReplayCallback

    extra = [
        "+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
        "+callbacks.lr.logging_interval=step",
    ]
    cfg = compose_config([*extra, "replay=off"])
    backend = replay_backend(cfg, build_model(cfg.model))
    replay, monitor = _callbacks(cfg, backend, "off")
    assert isinstance(replay, RouterReplayCallback) and replay.backend is backend and replay.mode == "off"
    assert replay.strict is False  # the callback's own setting with the embedded engine
    assert isinstance(monitor, LearningRateMonitor) and monitor.logging_interval == "step"
    (only,) = _callbacks(compose_config([*extra, "callbacks.router_replay=null"]), backend, "r3")
    assert isinstance(only, LearningRateMonitor)
    external = ["rollout.url=http://10.0.0.1:30000"]
    assert _callbacks(compose_config(external), backend, "r3")[0].strict is True  # must return routes
    assert _callbacks(compose_config([*external, "replay.strict=false"]), backend, "r3")[0].strict is False


def test_model_factories_take_dtype_and_attention_keywords(tmp_path):
    import torch

    from r3lightning.job.models import from_pretrained, tiny_moe
    from r3lightning.job.setup import build_model

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
    with pytest.raises(JobError, match=r"^model\.sharded_weights needs model\.path"):
        build_model(compose_config(["+model.sharded_weights=/dcp"]).model, trainer=True)


def test_task_and_reward_are_built_from_their_targets():
    import torch

    from r3lightning.job.setup import build_task
    from r3lightning.rollout.tasks import ScoredTask, TokenClassTask

    task = build_task(compose_config(["task.num_classes=3"]), vocab_size=96)
    assert isinstance(task.prompts, TokenClassTask) and task.prompts.vocab_size == 96  # the model's vocab
    assert task.score.num_classes == 3  # the reward follows the task's keys
    prompts = task.sample_prompts(4, torch.Generator().manual_seed(0))
    assert all(4 <= p[-1] < 7 for p in prompts)
    assert task.reward([9, 9, 5], [1, 4, 7, 2]) == 0.75  # class 1: 1, 4, 7 of 4 tokens
    with pytest.raises(ValueError, match=r"returned nan; expected a finite number"):
        ScoredTask(task.prompts, lambda p, r: float("nan")).reward([5], [1])
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


def test_help_flag_prints_the_help_and_exits_0(capsys):
    from r3lightning.job.help import format_help
    from r3lightning.job.main import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out == format_help(CONF_DIR) + "\n"
