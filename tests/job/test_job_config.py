"""Hydra composition of the main job's config (every option of every group, overrides) and --help."""

from __future__ import annotations

import pytest
from job_cli import train_cli
from omegaconf import OmegaConf

from r3lightning.app.job.common import JobError
from r3lightning.app.job.main import compose_config
from r3lightning.app.job.setup import CONF_DIR, replay_settings
from r3lightning.app.job.trainer import trainer_kwargs
from r3lightning.app.job.validate import check_config

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
        if key in ("defaults", "url", "path"):
            continue
        _assert_holds(cfg, chosen, f"{group}.{key}", key)


def _assert_holds(cfg, chosen, dotted: str, key: str) -> None:
    """Every value the option's file sets (nested ones too) is in the composed config (the schema
    may add keys the file leaves at their defaults)."""
    if OmegaConf.is_interpolation(chosen, key):
        return
    if OmegaConf.is_dict(chosen[key]):
        for inner in chosen[key]:
            _assert_holds(cfg, chosen[key], f"{dotted}.{inner}", inner)
        return
    assert OmegaConf.select(cfg, dotted) == chosen[key], dotted


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

    kwargs = trainer_kwargs(compose_config(["trainer=gpu_fsdp"]).trainer)
    assert isinstance(kwargs["strategy"], ModelParallelStrategy)
    assert kwargs["accelerator"] == "gpu" and kwargs["devices"] == 8
    assert kwargs["strategy"]._data_parallel_size == 8 and kwargs["strategy"]._tensor_parallel_size == 1


def _choices(*overrides: str) -> dict:
    """``{group: option}`` Hydra selects for ``overrides``."""
    return dict(compose_config(list(overrides), hydra_config=True).hydra.runtime.choices)


def test_help_lists_groups_options_and_yaml_comments():
    from r3lightning.app.job.help import format_help

    text = format_help(CONF_DIR, _choices())
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
        "sglang, vllm: a directory the engine can read; weights are saved there and loaded with POST "
        "/update_weights_from_disk (sglang) or /collective_rpc (vllm)"
    )


def test_help_flag_prints_the_help_and_exits_0(capsys):
    from r3lightning.app.job.help import format_help

    with pytest.raises(SystemExit) as info:
        train_cli("--help")  # Hydra's --help, through the app help template
    assert info.value.code == 0
    assert capsys.readouterr().out == format_help(CONF_DIR, _choices()) + "\n"


def _section(text: str, title: str) -> list[str]:
    """The lines of one ``title:`` section of the help (up to the next blank line)."""
    lines = text.splitlines()
    start = lines.index(f"{title}:") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


def test_help_shows_the_selected_groups_and_their_keys(capsys):
    from r3lightning.app.job.help import format_help

    with pytest.raises(SystemExit) as info:
        train_cli("task=prompts_file", "--help")
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text == format_help(CONF_DIR, _choices("task=prompts_file")) + "\n"
    marked = [line.split()[1] for line in text.splitlines() if line.startswith("   * ")]
    # the selected option of every group: task and (through reward: ${task}) reward follow the override
    assert marked == [  # algorithm callbacks data (no experiment) model module replay reward rollout task trainer
        "grpo", "default", "default", "tiny_qwen3_moe", "grpo", "r3", "prompts_file", "embedded", "prompts_file", "cpu",
    ]  # fmt: skip
    assert "task (token_class):" not in text
    keys = [line.split("=")[0].strip() for line in _section(text, "task (prompts_file)")]
    assert keys == [
        "task.path", "task.tokenizer", "task.columns.prompt", "task.columns.data_source",
        "task.columns.ground_truth", "task.columns.extra_info", "task.max_prompt_length", "task.response_length", "task.overlong",
        "task.shuffle", "task.seed",
    ]  # fmt: skip
    assert not any(line.strip().startswith("task.num_classes") for line in text.splitlines())
    assert _section(text, "reward (prompts_file)")[-1].startswith("  reward.timeout_s=60")
    # an experiment's own group overrides, and its keys at the top level (@package _global_)
    text = format_help(CONF_DIR, _choices("experiment=fsdp_moe", "steps=3"))
    assert "   * gpu_fsdp" in text and "   * hf_checkpoint" in text and "   * sglang" in text
    assert _section(text, "experiment (fsdp_moe)")[0].startswith("  steps=200")
    assert "trainer (gpu_fsdp):" in text and "trainer (cpu):" not in text


def test_help_with_an_option_that_does_not_exist_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        train_cli("task=nope", "--help")
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "r3lightning-train: error: In 'config': Could not find 'task/nope' Available options in 'task': "
        "calculator, prompts_file, token_class\n"
    )
