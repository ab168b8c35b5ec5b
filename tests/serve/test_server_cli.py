"""``r3lightning-serve``: one-line startup errors, serving until a signal, readiness time."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from runif import run_if

# --------------------------------------------------------------------------- command line


def _free_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def _cli_error(capsys, argv: list[str]) -> str:
    from r3lightning.app.serve.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("r3lightning-serve: error: "), err
    return err


def test_cli_model_that_is_not_a_local_directory_fails_in_one_line_without_network(
    capsys, monkeypatch, tmp_path
):
    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    err = _cli_error(capsys, ["--model", "/nonexistent"])
    assert (
        "--model /nonexistent is not a directory; expected a local Hugging Face checkpoint directory" in err
    )
    err = _cli_error(capsys, ["--model", "Qwen/Qwen3-30B-A3B"])  # a hub name is not downloaded
    assert "is not a directory" in err
    err = _cli_error(capsys, ["--model", str(tmp_path)])
    assert "has no config.json" in err
    (tmp_path / "config.json").write_text("{not json")
    err = _cli_error(capsys, ["--model", str(tmp_path)])
    assert f"--model {tmp_path}: cannot load the checkpoint" in err


@run_if(cuda=False)  # checks the error on a machine without CUDA
def test_cli_cuda_device_without_cuda(capsys):
    err = _cli_error(capsys, ["--device", "cuda"])
    assert "--device 'cuda': CUDA is not available on this machine; use 'cpu'" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "argument --port: expected an integer in [0, 65535], got 99999"),
        (["--port", "x"], "argument --port: expected an integer in [0, 65535], got 'x'"),
        (["--device", "tpu:0"], "--device must be None, 'cpu', 'cuda' or 'cuda:N', got 'tpu:0'"),
        (["--host", "0.0.0.0"], "host '0.0.0.0' is reachable from other machines but no api_key is set"),
        # --model names no checkpoint so that a CLI accepting the key fails on the model, not serves
        (
            ["--host", "0.0.0.0", "--api-key", "", "--model", "/nonexistent"],
            "--api-key must be a non-empty token",
        ),
        (["--api-key", "  ", "--model", "/nonexistent"], "--api-key must be a non-empty token, got '"),
        (["--max-queue", "-1"], "max_queue must be an integer >= 0, got -1"),
        (["--max-weights-bytes", "0"], "max_weights_bytes must be an integer >= 1, got 0"),
        (["--header-timeout-s", "0"], "header_timeout_s must be a number > 0, got 0"),
        (["--max-batch-size", "two"], "max_batch_size must be an integer >= 1, got 'two'"),
        (["--batch-invariant", "maybe"], "batch_invariant must be None or a bool, got 'maybe'"),
        (["--dtype", "int8"], "dtype must be one of ['bfloat16', 'float16', 'float32'], got 'int8'"),
        (["--nope"], "unrecognized arguments: --nope"),
    ],
)
def test_cli_bad_arguments_fail_in_one_line(capsys, argv, message):
    assert message in _cli_error(capsys, argv)


def test_cli_has_a_flag_per_engine_and_limit_setting():
    import dataclasses

    from r3lightning.app.serve import cli
    from r3lightning.app.serve.config import EngineConfig, ServerLimits

    # the flag set comes from the dataclasses' fields: a new setting gets its flag
    parser_flags = _flags()
    for cls in (EngineConfig, ServerLimits):
        for field in dataclasses.fields(cls):
            assert f"--{field.name.replace('_', '-')}" in parser_flags, field.name
    limit_flags = ["--max-queue", "3", "--max-request-bytes", "none", "--header-timeout", "2.5"]
    engine_flags = [
        "--dtype",
        "float32",
        "--batch-invariant",
        "false",
        "--batch-wait-s",
        "0.01",
        "--seed",
        "7",
    ]
    engine_flags += ["--simulated-disagreement", "0.1", "--copy-model", "true", "--device", "cpu"]
    args = cli._parse_args([*limit_flags, "--body-timeout", "4", *engine_flags])
    limits = ServerLimits(**cli._settings(ServerLimits, args))
    assert limits == ServerLimits(max_queue=3, max_request_bytes=None, header_timeout_s=2.5, body_timeout_s=4)
    engine = EngineConfig(**cli._settings(EngineConfig, args))
    expected = {
        "dtype": "float32",
        "device": "cpu",
        "batch_wait_s": 0.01,
        "seed": 7,
        "batch_invariant": False,
    }
    assert engine == EngineConfig(**expected, simulated_disagreement=0.1, copy_model=True)
    # unset: the dataclass's defaults, except copy_model (the CLI loads a model of its own)
    defaults = EngineConfig(**cli._settings(EngineConfig, cli._parse_args([])))
    assert defaults == EngineConfig(copy_model=False)


def _flags() -> set[str]:
    """Every option string ``r3lightning-serve --help`` lists."""
    import contextlib
    import io

    from r3lightning.app.serve import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli._parse_args(["--help"])
    return {word.rstrip(",") for word in out.getvalue().split() if word.startswith("--")}


def test_cli_port_in_use_fails_in_one_line(capsys):
    sock, port = _free_port()
    with sock:
        err = _cli_error(capsys, ["--port", str(port), "--device", "cpu"])
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_cli_entry_point_exits_2_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "r3lightning.app.serve.cli", "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == (
        "r3lightning-serve: error: argument --port: expected an integer in [0, 65535], got 99999\n"
    )


def test_cli_serves_until_sigint_and_exits_0():
    import os
    import signal

    command = [sys.executable, "-m", "r3lightning.app.serve.cli", "--port", "0", "--device", "cpu"]
    command += ["--max-new-tokens-cap", "8"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("r3lightning rollout server listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            assert json.load(r)["status"] == "ok"
        request = urllib.request.Request(
            f"{url}/skyrl/v1/generate",
            data=json.dumps({"token_ids": [5, 6], "sampling_params": {"max_tokens": 9}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 400 and b"must be <= 8 (this server's cap)" in info.value.read()
        os.kill(child.pid, signal.SIGINT)
        assert child.wait(timeout=60) == 0
        assert "Traceback" not in child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_help_and_a_bad_limit_flag_do_not_import_torch(tmp_path):
    """The heavy imports wait until a model is built: ``--help`` and a bad limit answer without
    torch, transformers or aiohttp in the process (what the import costs is in protocols.md)."""
    from python_process import run_python

    probe = (
        "import sys\n"
        "from r3lightning.app.serve import cli\n"
        "try:\n"
        "    code = cli.main(sys.argv[1:])\n"
        "except SystemExit as exc:  # --help\n"
        "    code = exc.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'aiohttp') if m in sys.modules)\n"
        "print(code, heavy)\n"
    )
    help_run = run_python(tmp_path, "-c", probe, "--help")
    assert "--simulated-disagreement" in help_run.stdout
    assert help_run.stdout.strip().endswith("0 []"), help_run.stdout[-200:] + help_run.stderr
    bad = run_python(tmp_path, "-c", probe, "--max-queue", "-1")
    assert bad.stdout.strip() == "2 []", bad.stdout + bad.stderr
    assert bad.stderr.strip() == "r3lightning-serve: error: max_queue must be an integer >= 0, got -1"


# the packages of training: a server that imported them would pay their start-up for nothing
_TRAINING_ONLY = ("lightning", "lightning_fabric", "pytorch_lightning", "hydra", "omegaconf", "megatron")
_TRAINING_ONLY += ("datasets", "pandas", "matplotlib")
_TRAINING_MODULES = (
    "r3lightning.app.job",
    "r3lightning.app.tasks",
    "r3lightning.data",
    "r3lightning.rollout",
)
_TRAINING_MODULES += ("r3lightning.correction", "r3lightning.replay.megatron", "r3lightning.replay.callback")

_SERVE_PROBE = """
import json, os, signal, sys, threading, time, urllib.request
from r3lightning.app.serve import cli

url = f"http://127.0.0.1:{sys.argv[1]}"
seen = {}


def client():  # the first 200 on /health, one greedy request, then SIGINT as a user would
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                break
        except OSError:
            time.sleep(0.05)
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}}
    request = urllib.request.Request(url + "/skyrl/v1/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        seen["answer"] = json.load(response)["choices"][0]
    seen["modules"] = sorted(sys.modules)
    os.kill(os.getpid(), signal.SIGINT)


threading.Thread(target=client, daemon=True).start()
code = cli.main(["--port", sys.argv[1], "--device", "cpu"])
print(json.dumps({"code": code, **seen}))
"""


def test_the_server_start_imports_no_training_package_and_answers_like_the_tiny_model(tmp_path):
    """``r3lightning-serve``'s start loads torch, transformers' model code and aiohttp, and none of
    the training stack (where start-up time goes: docs/protocols.md); its greedy answer is the
    tiny model's, checked against a forward pass of that model here."""
    import torch
    from python_process import run_python

    from r3lightning.app.models.tiny import build_tiny_moe

    sock, port = _free_port()
    sock.close()
    run = run_python(tmp_path, "-c", _SERVE_PROBE, str(port))
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0, run.stderr[-2000:]
    modules = seen["modules"]
    assert "transformers" in modules and "torch" in modules  # the probe saw the serving process
    assert [m for m in modules if m.split(".")[0] in _TRAINING_ONLY] == []
    assert [m for m in modules if m.startswith(_TRAINING_MODULES)] == []
    # the served model is the bf16 tiny MoE of seed 0: a forward pass over the answer agrees
    answer = seen["answer"]
    tokens = answer["token_ids"]
    assert len(tokens) == 5
    with torch.no_grad():
        logits = build_tiny_moe(seed=0, dtype=torch.bfloat16)(torch.tensor([[5, 6, 7, *tokens]])).logits
    logprobs = torch.log_softmax(logits[0, 2:-1].float(), dim=-1)  # [5, vocab]: each answer token's
    chosen = logprobs[torch.arange(5), tokens]
    served = torch.tensor([entry["logprob"] for entry in answer["logprobs"]["content"]])
    # bf16: the server's batch-invariant kernels and this eager pass differ by bf16 rounding
    assert torch.allclose(served, chosen, atol=0.1), (served, chosen)
    assert bool((chosen >= logprobs.max(dim=-1).values - 0.1).all())  # greedy: a top token each time
