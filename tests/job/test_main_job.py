"""The main job end to end: embedded bf16 engine -> trace -> buffer -> R3DataModule -> Trainer.

Real components throughout (aiohttp server on loopback, tiny Qwen3-MoE, Lightning Trainer).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from job_cli import train_cli
from python_process import REPO, run_python
from runif import run_if

from r3lightning.app.job.main import compose_config, run
from r3lightning.app.job.report import agreement_keys, environment, environment_line, read_csv, summarize

pytestmark = pytest.mark.slow
QUIET = ["trainer.enable_progress_bar=false"]


def _agreements(history):
    return [r[k] for r in history for k in agreement_keys(r)]


def test_main_job_learns_with_full_agreement_under_replay(tmp_path):
    cfg = compose_config(["experiment=smoke", *QUIET])
    runs = run(cfg, tmp_path)
    history = runs["replay=r3"]
    assert [r["step"] for r in history] == list(range(cfg.steps))
    summary = summarize(history)
    # the token-class task starts at chance (0.5) and is learned within the smoke run
    assert summary["reward_start"] < 0.65
    assert summary["reward_end"] > summary["reward_start"] + 0.2, [r["reward"] for r in history]
    # every MoE layer (1..3; layer 0 is dense) of every step used exactly the engine's experts
    assert {k for r in history for k in agreement_keys(r)} == {
        f"used_agreement/layer_{i:02d}" for i in (1, 2, 3)
    }
    assert len(_agreements(history)) == 3 * cfg.steps and all(a == 1.0 for a in _agreements(history))
    # bf16 engine vs fp32 trainer on the same weights: small but nonzero mismatch (heavy-tailed
    # over steps: a sharpened policy's rare sampled tokens weigh in, so the median is bounded
    # tightly and the worst step loosely)
    k3 = sorted(r["k3_kl"] for r in history)
    assert k3[0] > 0.0 and k3[len(k3) // 2] < 1e-3 and k3[-1] < 5e-2
    assert history[0]["k3_kl"] < 1e-3
    assert all(r["ratio_out_of_band"] < 0.01 for r in history)
    # outputs in the run directory
    assert read_csv(tmp_path / "replay_r3" / "metrics.csv") == history  # repr round-trips floats
    assert (tmp_path / "replay_r3" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "summary.txt").read_text().splitlines()
    env = environment_line(environment())  # versions, threads and CPU of the run, in both files
    assert table[0].startswith("run") and table[2].startswith("replay=r3") and table[-1] == env
    config = (tmp_path / "config.yaml").read_text()
    assert config.splitlines()[0] == f"# {env}" and "steps: 18" in config and "seeds: 1" in config


def test_replay_off_measures_the_mismatch_and_resumes_exactly(tmp_path):
    base = ["replay=off", "prompts_per_step=8", "plot=false", *QUIET]
    straight = run(compose_config([*base, "steps=3"]), tmp_path / "straight")["replay=off"]
    agreements = _agreements(straight)
    assert agreements and 0.9 < sum(agreements) / len(agreements) < 1.0  # bf16 vs fp32 routing flips
    # stop after 2 steps, then extend the same run directory to 3: it resumes from the checkpoint
    run(compose_config([*base, "steps=2"]), tmp_path / "resumed")
    resumed = run(compose_config([*base, "steps=3"]), tmp_path / "resumed")["replay=off"]
    keys = ["step", "reward", "reward_std", "k3_kl", "loss", *agreement_keys(straight[0])]
    for a, b in zip(straight, resumed, strict=True):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-5, abs=1e-7)


def test_replay_r2_records_in_the_old_policy_forward_and_replays_it(tmp_path):
    import csv

    cfg = compose_config(["replay=r2", "steps=2", "prompts_per_step=4", "plot=false", *QUIET])
    history = run(cfg, tmp_path)["replay=r2"]
    assert len(history) == 2 and not agreement_keys(history[0])  # the engine sent no routes
    with open(tmp_path / "replay_r2" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        logged = [row for row in csv.DictReader(f) if row.get("router_replay/replayed_fraction")]
    # every real token of both steps replayed the routes of the trainer's own old-policy forward
    assert len(logged) == 2
    assert all(float(r["router_replay/replayed_fraction"]) == 1.0 for r in logged)
    assert all(float(r["router_replay/native_agreement"]) == 1.0 for r in logged)


def test_external_engine_sglang_protocol(tmp_path):
    from r3lightning.app.models.tiny import build_tiny_moe
    from r3lightning.app.serve.config import EngineConfig
    from r3lightning.app.serve.server import RolloutServer

    with RolloutServer(
        build_tiny_moe(seed=0), engine=EngineConfig(max_batch_size=64, copy_model=False)
    ) as server:
        cfg = compose_config(
            [
                f"rollout.url={server.url}",
                "rollout.protocol=sglang",
                "steps=2",
                "prompts_per_step=4",
                "plot=false",
                *QUIET,
            ]
        )
        with pytest.warns(UserWarning, match="weight_sync_dir is not set"):
            history = run(cfg, tmp_path)["replay=r3"]
    assert len(history) == 2 and len(_agreements(history)) == 6
    assert all(a == 1.0 for a in _agreements(history))
    # sglang: weights are synced by the deployment, never pushed; so step 1 is off-policy and
    # its mismatch is much larger than step 0's
    assert server.engine.weight_version == 0
    assert history[1]["k3_kl"] > 100 * history[0]["k3_kl"]


def test_bad_override_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train_cli("steps=0", f"hydra.run.dir={tmp_path}")
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "r3lightning-train: error: steps must be an integer >= 1 and <= 9223372036854775807, got 0"
    for override, expected in (
        ("replay=sometimes", "Could not find 'replay/sometimes' Available options in 'replay': off, r2, r3"),
        ("no_such_key=1", "no_such_key is not a setting of JobConfig (a typo, or a key of another group?)"),
        ("steps=abc", "steps must be an integer, got 'abc'"),  # Hydra's structured config
    ):
        with pytest.raises(SystemExit) as info:
            train_cli(override, f"hydra.run.dir={tmp_path}")
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("r3lightning-train: error: ") and expected in err


@run_if(cuda=False)
def test_trainer_the_machine_cannot_run_is_one_line(tmp_path, capsys):
    for overrides, expected in (
        (
            ["trainer=gpu_fsdp"],
            "trainer.accelerator=gpu but no GPU is visible here; use trainer=cpu, or trainer=cpu_fsdp "
            "for FSDP2 on CPU processes (got trainer.devices=8)",
        ),
        (["trainer.devices=many"], "trainer: `devices` selected with `CPUAccelerator` should be an int > 0."),
    ):
        with pytest.raises(SystemExit) as info:
            train_cli(*overrides, "steps=1", "prompts_per_step=1", f"hydra.run.dir={tmp_path}", *QUIET)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err == f"r3lightning-train: error: {expected}\n"


def test_unreachable_engine_is_one_line_without_traceback(tmp_path):
    proc = run_python(
        tmp_path,
        "-m",
        "r3lightning.app.job.main",
        "rollout.url=http://127.0.0.1:9",
        "rollout.retry.health_timeout_s=5",
        f"hydra.run.dir={tmp_path}",
        timeout=120,
        HYDRA_FULL_ERROR="0",
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert lines[-1] == (
        "r3lightning-train: error: cannot reach the rollout engine at http://127.0.0.1:9: GET /health did "
        "not answer 200 within 5s (rollout.retry.health_timeout_s); check rollout.url or start the engine"
    )
    assert (tmp_path / ".hydra").is_dir()  # a folder that existed before the run is left alone


def test_megatron_backend_through_the_job(tmp_path, monkeypatch):
    """callbacks=router_replay_megatron model=tiny_megatron_moe: a megatron-core MoE trains through
    the job, every training forward replaying the engine's routes through megatron's RouterReplay."""
    import torch

    from r3lightning.replay.megatron.router import MaskedRouterReplay

    installs: list[tuple[int, ...]] = []
    original = MaskedRouterReplay.set_target_indices

    def spy(self, indices, *args, **kwargs):  # the real method runs; the call is only counted
        installs.append(tuple(indices.shape))
        return original(self, indices, *args, **kwargs)

    monkeypatch.setattr(MaskedRouterReplay, "set_target_indices", spy)
    overrides = [
        "callbacks=router_replay_megatron",
        "model=tiny_megatron_moe",
        "steps=2",
        "prompts_per_step=4",
    ]
    cfg = compose_config([*overrides, "plot=false", *QUIET])
    history = run(cfg, tmp_path)["replay=r3"]
    assert [r["step"] for r in history] == [0, 1]
    # layers 1..3 are megatron MoELayers (layer 0 dense): each used exactly the engine's experts
    assert {k for r in history for k in agreement_keys(r)} == {
        f"used_agreement/layer_{i:02d}" for i in (1, 2, 3)
    }
    assert all(a == 1.0 for a in _agreements(history))
    assert all(0.0 < r["k3_kl"] < 1e-2 for r in history)  # bf16 engine vs fp32 trainer
    # one install per MoE layer and training step: the [S * B, top_k] rows of the padded batch
    steps = 2  # one update per RL step (data.batch_size = prompts_per_step x group_size)
    # (twice: the training forward, and the GRPO module's paired-mismatch replayed forward)
    assert len(installs) == 3 * steps * 2 and all(s[1] == 2 and s[0] % 32 == 0 for s in installs)
    assert "backend: megatron" in (tmp_path / "config.yaml").read_text()
    assert "replay=r3" in (tmp_path / "summary.txt").read_text()
    assert not torch.distributed.is_initialized()  # the runtime undid its process group


def _fake_sglang_without_routes():
    """An SGLang-like engine on loopback started without route support: tokens and logprobs,
    never routes. Returns (runner, url) inside a running event loop thread."""
    import asyncio
    import threading

    from aiohttp import web

    async def health(request):
        return web.json_response({})

    async def generate(request):
        body = await request.json()
        count = body["sampling_params"]["max_new_tokens"]
        return web.json_response(
            {
                "output_ids": [10] * count,
                "meta_info": {
                    "finish_reason": {"type": "length"},
                    "output_token_logprobs": [[-1.0, 10]] * count,
                },
            }
        )

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop():
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return f"http://127.0.0.1:{runner.addresses[0][1]}", stop


def test_engine_without_routes_is_one_line_naming_the_flag(tmp_path, capsys):
    url, stop = _fake_sglang_without_routes()
    try:
        with pytest.raises(SystemExit) as info, pytest.warns(UserWarning, match="weight_sync_dir"):
            train_cli(
                f"rollout.url={url}",
                "rollout=sglang",
                "steps=1",
                "prompts_per_step=1",
                f"hydra.run.dir={tmp_path / 'run'}",
                *QUIET,
            )
    finally:
        stop()
    assert info.value.code == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("r3lightning-train: rollout engine error: ")
    assert "meta_info.routed_experts" in err and "--enable-return-routed-experts" in err
    assert not (tmp_path / "run").exists()  # nothing trained: no folder left


def test_failed_runs_leave_no_folder_and_a_sweep_goes_on(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # fails inside the run, after Hydra made its folder: the folder is removed again
    with pytest.raises(SystemExit) as info:
        train_cli("data.batch_size=0", "steps=1", "prompts_per_step=1", *QUIET)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("r3lightning-train: error: data: ")
    assert "batch_size" in err and not (tmp_path / "outputs").exists()
    # a sweep whose jobs Hydra cannot compose is refused as a whole, before any job runs
    with pytest.raises(SystemExit) as info:
        train_cli("-m", "replay=r4,r3", "steps=1", *QUIET)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "r3lightning-train: error: In 'config': Could not find 'replay/r4' Available options in 'replay': "
        "off, r2, r3\n"
    )
    # a bad _target_ and a bad value: each job is reported in one line and the sweep goes on to the
    # next; the summary lists them all
    with pytest.raises(SystemExit) as info:
        train_cli(
            "-m",
            "replay=off,r3",
            "data._target_=does.not.Exist,r3lightning.data.datamodule.R3DataModule",
            "data.batch_size=0",
            "steps=1",
            "prompts_per_step=1",
            *QUIET,
        )
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line or "failed" in line]
    assert len(errors) == 5, errors
    assert errors[0].startswith("r3lightning-train: job #0 (replay=off data._target_=does.not.Exist")
    assert "data._target_: cannot import 'does.not.Exist'" in errors[0]
    assert "job #3" in errors[3] and "error: data: " in errors[3] and "batch_size" in errors[3]
    assert errors[4].startswith("r3lightning-train: 4 of 4 jobs failed: #0 (replay=off ")
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


def test_bad_checkpoint_is_one_line_and_kept(tmp_path, capsys):
    last = tmp_path / "replay_r3" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as info:
        train_cli("steps=2", "prompts_per_step=1", f"hydra.run.dir={tmp_path}", *QUIET)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"r3lightning-train: error: checkpoint {last} cannot be read (")
    assert last.read_bytes() == b"not a checkpoint"  # nothing lost


def test_ctrl_c_exits_130_saying_how_to_resume(tmp_path):
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = ["steps=200", "prompts_per_step=2", "plot=false", *QUIET, f"hydra.run.dir={tmp_path}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "r3lightning.app.job.main", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    checkpoint = tmp_path / "replay_r3" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # mid-training, after the first step's checkpoint
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last == (
        "r3lightning-train: interrupted; the checkpoint keeps the last finished step, resume with: "
        f"r3lightning-train {' '.join(args)}"
    )
    assert "Traceback" not in err
    assert checkpoint.is_file()


def test_exposed_embedded_engine_without_a_key_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train_cli(
            "rollout.server.host=0.0.0.0",
            "steps=1",
            "prompts_per_step=1",
            f"hydra.run.dir={tmp_path}",
            *QUIET,
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("r3lightning-train: error: rollout.server: "), err
    assert "0.0.0.0" in err
