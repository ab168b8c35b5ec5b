"""scripts/gpu_check.py on a machine without CUDA.

Without CUDA every check must report ``SKIP: no CUDA`` and the script exit 0; with ``--device cpu``
the checks that keep their meaning on the CPU must pass with the figures they promise, and a
broken replay must turn into a FAIL line and exit status 1. So the script is known to work before
it ever runs on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runif import run_if

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
CHECKS = ("transfer", "hf", "hf-fsdp", "hf-fsdp2", "grpo", "grpo-bf16", "grpo-fsdp2", "megatron", "step")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def run_script(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the script as a user would, from another directory, with CUDA hidden."""
    results = tmp_path / "results.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(results)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert results.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(results.read_text())


def by_name(payload: dict) -> dict[str, dict]:
    return {r["name"]: r for r in payload["results"]}


def test_without_cuda_every_check_skips_and_the_script_exits_0(tmp_path):
    proc, payload = run_script(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for name in CHECKS:
        assert f"[{name}] SKIP: no CUDA (0.0 s)" in lines
    assert re.fullmatch(r"SUMMARY: 0 PASS, 0 FAIL, 9 SKIP in [\d.]+ s", lines[-1])
    assert payload["device"] is None
    assert [(r["name"], r["status"], r["detail"]) for r in payload["results"]] == [
        (name, "SKIP", "no CUDA") for name in CHECKS
    ]


def test_cuda_requested_without_cuda_skips_and_bad_arguments_are_refused(gpu_check, capsys):
    assert gpu_check.main(["--device", "cuda", "--only", "megatron,hf", "--time-limit", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:3] == ["[megatron] SKIP: no CUDA (0.0 s)", "[hf] SKIP: no CUDA (0.0 s)"]
    assert re.fullmatch(r"SUMMARY: 0 PASS, 0 FAIL, 2 SKIP in [\d.]+ s", out[3]) and len(out) == 4
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--only", "transfer,bogus"])
    assert exit_info.value.code == 2
    assert "--only: unknown checks ['bogus']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "tpu"])
    assert "--device must be auto, cuda[:N] or cpu, got 'tpu'" in capsys.readouterr().err


@pytest.mark.slow
def test_on_the_cpu_every_check_that_keeps_its_meaning_passes(tmp_path):
    proc, payload = run_script(tmp_path, "--device", "cpu")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = by_name(payload)
    assert {name: r["status"] for name, r in results.items()} == {
        "transfer": "PASS",
        "hf": "PASS",
        "hf-fsdp": "SKIP",
        "hf-fsdp2": "PASS",
        "grpo": "PASS",
        "grpo-bf16": "PASS",
        "grpo-fsdp2": "PASS",
        "megatron": "PASS",
        "step": "PASS",
    }
    assert results["hf-fsdp"]["detail"] == "Lightning's fsdp strategy needs CUDA"
    for name in ("transfer", "hf", "hf-fsdp2", "grpo", "grpo-bf16", "grpo-fsdp2"):
        assert results[name]["figures"]["replay_agreement"] == 1.0
    # activation checkpointing, bf16-true and the module's own FSDP2 sharding: the same steps
    assert {results[n]["figures"]["steps"] for n in ("grpo", "grpo-bf16", "grpo-fsdp2")} == {3}
    assert results["transfer"]["figures"]["batches"] == 4
    # the engine (bf16, perturbed routers) disagrees with the trainer's own routing: replay matters
    assert 0.3 < results["hf"]["figures"]["native_agreement"] < 0.95
    assert results["hf"]["figures"]["slots"] == results["hf-fsdp2"]["figures"]["slots"] > 0
    megatron = results["megatron"]["figures"]
    assert megatron["tokens"] == 24 and megatron["replayed_rows"] == 6 + 3 + 4
    assert megatron["max_out_err"] < 1e-5 and megatron["max_router_grad_err"] < 1e-5
    assert megatron["native_agreement"] < 1.0
    step = results["step"]["figures"]
    assert set(step) == {"tiny_off_ms", "tiny_r3_ms", "tiny_ratio", "tiny_route_work_share"}  # CPU: tiny only
    assert step["tiny_ratio"] == pytest.approx(step["tiny_r3_ms"] / step["tiny_off_ms"])
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"\[megatron\] PASS \([\d.]+ s\) \| tokens=24, replayed_rows=13, .*", lines[-3])
    assert re.fullmatch(r"\[step\] PASS \([\d.]+ s\) \| tiny_off_ms=[\d.]+, tiny_r3_ms=.*", lines[-2])
    assert re.fullmatch(r"SUMMARY: 8 PASS, 0 FAIL, 1 SKIP in [\d.]+ s \| transfer\.batches=4 .*", lines[-1])


def test_a_broken_replay_is_a_fail_line_and_exit_status_1(gpu_check, monkeypatch, capsys, tmp_path):
    from r3lightning.replay.hf.replay import HFRouterReplay

    install = HFRouterReplay.install

    def shifted(self, routes, replay_mask=None):  # every replayed expert off by one
        install(self, (routes + 1) % self.num_experts, replay_mask)

    monkeypatch.setattr(HFRouterReplay, "install", shifted)
    results = tmp_path / "results.json"
    argv = ["--device", "cpu", "--only", "transfer", "--time-limit", "0", "--json", str(results)]
    assert gpu_check.main(argv) == 1
    out = capsys.readouterr().out.splitlines()
    fail = next(line for line in out if line.startswith("[transfer]"))
    match = re.fullmatch(
        r"\[transfer\] FAIL: CheckFailed: forward used the installed experts on (\d+)/(\d+) slots \([\d.]+ s\)",
        fail,
    )
    assert match and int(match[1]) < int(match[2])
    assert out[-1].startswith("SUMMARY: 0 PASS, 1 FAIL, 0 SKIP")
    assert json.loads(results.read_text())["results"][0]["status"] == "FAIL"


@run_if(megatron=True)
def test_megatron_runtime_undoes_its_cpu_shims(gpu_check):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    current_device = torch.cuda.current_device
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    owned = not dist.is_initialized()
    try:
        with gpu_check.megatron_runtime(torch.device("cpu")):
            assert torch.cuda.current_device() == "cpu"
            assert parallel_state.model_parallel_is_initialized()
        assert torch.cuda.current_device is current_device
        assert hasattr(moe_utils, "te_general_gemm") == had_gemm
        assert not parallel_state.model_parallel_is_initialized()
    finally:
        gpu_check.shutdown_process_group()
    assert dist.is_initialized() != owned  # only a process group the script created is destroyed
