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
        (["compare=[r3,r5]"], "compare entries must be replay modes"),
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
