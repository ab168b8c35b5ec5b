"""The main job end to end: embedded bf16 engine -> trace -> buffer -> R3DataModule -> Trainer.

Real components throughout (aiohttp server on loopback, tiny Qwen3-MoE, Lightning Trainer).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from r3lightning.job.main import compose_config, main, run
from r3lightning.job.report import agreement_keys, read_csv, summarize
from r3lightning.job.rollout_loop import _step_seed

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
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
    assert {k for r in history for k in agreement_keys(r)} == {f"agreement/layer_{i:02d}" for i in (1, 2, 3)}
    assert len(_agreements(history)) == 3 * cfg.steps and all(a == 1.0 for a in _agreements(history))
    # bf16 engine vs fp32 trainer on the same weights: small but nonzero mismatch
    assert all(0.0 < r["k3_kl"] < 1e-2 for r in history)
    assert all(r["ratio_out_of_band"] < 0.01 for r in history)
    # outputs in the run directory
    assert read_csv(tmp_path / "replay_r3" / "metrics.csv") == history  # repr round-trips floats
    assert (tmp_path / "replay_r3" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert "replay=r3" in (tmp_path / "summary.txt").read_text()
    assert "steps: 18" in (tmp_path / "config.yaml").read_text()


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
    assert all(float(r["router_replay/agreement"]) == 1.0 for r in logged)


def test_external_engine_sglang_protocol(tmp_path):
    from r3lightning.models.tiny import build_tiny_moe
    from r3lightning.rollout.server import RolloutServer

    with RolloutServer(build_tiny_moe(seed=0), max_batch_size=64, copy_model=False) as server:
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


def test_collector_scores_trajectories_and_replays_deterministically():
    import torch

    from r3lightning.job.grpo import group_advantages
    from r3lightning.job.rollout_loop import ClientConfig, RolloutCollector, RouteSchema, SamplingConfig
    from r3lightning.job.task import TokenClassTask
    from r3lightning.models.tiny import build_tiny_moe
    from r3lightning.rollout.server import RolloutServer

    task = TokenClassTask(vocab_size=96, prompt_length=6, response_length=4)
    with RolloutServer(build_tiny_moe(seed=0), max_batch_size=64, copy_model=False) as server:

        def collector(request_routes: bool) -> RolloutCollector:
            return RolloutCollector(
                ClientConfig(server.url),
                task,
                group_size=4,
                sampling=SamplingConfig(max_new_tokens=4),
                schema=RouteSchema(num_layers=4, top_k=2, num_experts=8),
                request_routes=request_routes,
                seed=7,
            )

        first, stats = collector(True).collect(3, 2, progress=False)
        again, _ = collector(True).collect(3, 2, progress=False)
        no_routes, _ = collector(False).collect(3, 2, progress=False)
    assert len(first) == 8
    prompts = task.sample_prompts(2, torch.Generator().manual_seed(_step_seed(7, 3)))
    rewards = []
    for i, t in enumerate(first):
        assert t.prompt_ids.tolist() == prompts[i // 4] and t.response_length == 4
        # one route row per forwarded token: prompt (6) + response (4) - the last sampled token
        assert t.routed_experts.shape == (9, 4, 2) and t.routed_experts.dtype == torch.uint8
        assert not t.routed_experts[:, 0].any()  # layer 0 is dense: no routes
        assert t.reward == task.reward(t.prompt_ids.tolist(), t.response_ids.tolist())
        rewards.append(t.reward)
        assert t.rollout_logprobs.shape == (4,) and bool((t.rollout_logprobs < 0).all())
    expected = group_advantages(torch.tensor(rewards), 4).tolist()
    assert [t.advantage for t in first] == pytest.approx(expected, abs=1e-6)
    assert stats["reward"] == pytest.approx(sum(rewards) / 8)
    # per-(seed, step, sample) sampling seeds: the same step samples the same rollouts again
    assert [t.response_ids.tolist() for t in again] == [t.response_ids.tolist() for t in first]
    assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(first, again, strict=True))
    assert all(t.routed_experts is None for t in no_routes)


def test_bad_override_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["steps=0", f"hydra.run.dir={tmp_path}"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "r3lightning-train: error: steps must be an integer >= 1, got 0"
    for override, expected in (
        ("replay=sometimes", "Could not find 'replay/sometimes' Available options in 'replay': off, r2, r3"),
        ("no_such_key=1", "Could not override 'no_such_key'. To append to your config use +no_such_key=1"),
    ):
        with pytest.raises(SystemExit) as info:
            main([override, f"hydra.run.dir={tmp_path}"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("r3lightning-train: error: ") and expected in err


def test_trainer_the_machine_cannot_run_is_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("needs a machine without a GPU")
    for overrides, expected in (
        (
            ["trainer=gpu_fsdp"],
            "trainer.accelerator=gpu but no GPU is visible here; use trainer=cpu, or trainer=cpu_fsdp "
            "for FSDP2 on CPU processes (got trainer.devices=8)",
        ),
        (["trainer.devices=many"], "trainer: `devices` selected with `CPUAccelerator` should be an int > 0."),
    ):
        with pytest.raises(SystemExit) as info:
            main([*overrides, "steps=1", "prompts_per_step=1", f"hydra.run.dir={tmp_path}", *QUIET])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err == f"r3lightning-train: error: {expected}\n"


def test_unreachable_engine_is_one_line_without_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "r3lightning.job.main",
            "rollout.url=http://127.0.0.1:9",
            "rollout.request_timeout_s=5",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert lines[-1] == (
        "r3lightning-train: error: cannot reach the rollout engine at http://127.0.0.1:9 "
        "(GET /health failed within 5s); check rollout.url or start the engine"
    )
