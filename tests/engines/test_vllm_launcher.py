"""VllmServer's process handling, with a stand-in engine (tests/engines/fake_engine.py) in place of
vLLM's Python: no engine process outlives a normal exit, an exception, SIGINT or SIGTERM to the
process that owns the launcher, or that process being killed; a failed start is one line plus the
log's tail, fast."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from engine_procs import alive, group_members, wait_gone
from python_process import REPO

from r3lightning.app.vllm import ProcessOptions, ServeOptions, VllmServer, VllmSettings, VllmStartError
from r3lightning.app.vllm.launcher import _healthy
from r3lightning.app.vllm.settings import ENGINE_SIDE_DIR, engine_command, engine_environment, engine_python

FAKE = Path(__file__).with_name("fake_engine.py")


@pytest.fixture
def fake_python(tmp_path, monkeypatch) -> Path:
    """An executable that runs the stand-in engine where the launcher expects the engine's Python."""
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    path.chmod(0o755)
    monkeypatch.setenv("FAKE_ENGINE_PIDS", str(tmp_path / "pids"))
    return path


def settings(python: Path, model: str = "healthy", health_timeout_s: float = 600.0) -> VllmSettings:
    process = ProcessOptions(health_timeout_s=health_timeout_s, health_interval_s=0.05, stop_timeout_s=5)
    return VllmSettings(model=model, python=str(python), process=process)


def engine_pids(tmp_path: Path) -> list[int]:
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


def test_stops_every_engine_process_after_a_normal_exit(fake_python, tmp_path):
    with VllmServer(settings(fake_python)) as server:
        assert _healthy(server.url, timeout_s=5)
        pids = engine_pids(tmp_path)
        assert all(alive(p) for p in pids)
        assert set(pids) <= set(group_members(server.pid))  # the child is in the engine's group
    assert wait_gone(pids) == []
    assert server.pid is None
    server.stop()  # idempotent


def test_stops_every_engine_process_after_an_exception(fake_python, tmp_path):
    with pytest.raises(KeyError), VllmServer(settings(fake_python)):
        pids = engine_pids(tmp_path)
        raise KeyError("boom")
    assert wait_gone(pids) == []


OWNER = """
import sys, time
from r3lightning.app.vllm import ProcessOptions, VllmServer, VllmSettings
process = ProcessOptions(health_interval_s=0.05, stop_timeout_s=5)
settings = VllmSettings(model="healthy", python=sys.argv[1], process=process)
with VllmServer(settings) as server:
    print(server.url, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["sigint", "sigterm", "sigkill"]
)
def test_no_engine_process_outlives_a_signalled_owner(fake_python, tmp_path, signum):
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(OWNER), str(fake_python)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    try:
        assert owner.stdout.readline().startswith("http://127.0.0.1:")  # healthy, inside the with
        pids = engine_pids(tmp_path)
        assert all(alive(p) for p in pids)
        owner.send_signal(signum)
        owner.wait(timeout=30)
        # SIGKILL runs no code in the owner: the kernel's parent-death signal stops the engine
        assert wait_gone(pids) == []
    finally:
        owner.kill()
        owner.wait()


EXITS_WITHOUT_STOP = """
import atexit, os, sys
pids = []
def report():  # registered before the launcher's module is imported: atexit runs it after the launcher's
    print("alive" if any(os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z" for p in pids) else "gone", flush=True)
atexit.register(report)
from r3lightning.app.vllm import ProcessOptions, VllmServer, VllmSettings
process = ProcessOptions(health_interval_s=0.05, stop_timeout_s=5)
settings = VllmSettings(model="healthy", python=sys.argv[1], process=process)
server = VllmServer(settings).start()
pids.extend(int(p) for p in open(os.environ["FAKE_ENGINE_PIDS"]).read().split())
"""


def test_an_engine_never_stopped_by_its_owner_is_stopped_at_interpreter_exit(fake_python, tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXITS_WITHOUT_STOP), str(fake_python)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "gone"  # stopped by the launcher's atexit hook, before the owner ended
    assert wait_gone(engine_pids(tmp_path)) == []


def test_a_start_that_never_becomes_healthy_is_one_line_and_the_log_tail(fake_python, tmp_path):
    log = tmp_path / "engine.log"
    with pytest.raises(VllmStartError) as caught:
        VllmServer(settings(fake_python, "silent", health_timeout_s=1.0), log_path=log).start()
    first, *rest = str(caught.value).splitlines()
    assert "did not answer /health within 1s" in first and str(log) in first
    assert "fake engine silent on 127.0.0.1:" in "\n".join(rest)  # the log's tail
    assert wait_gone(engine_pids(tmp_path)) == []  # the failed start stopped what it started


def test_an_engine_that_exits_fails_at_once_with_its_code(fake_python, tmp_path):
    with pytest.raises(VllmStartError, match="exited with code 3") as caught:
        VllmServer(settings(fake_python, "exit", health_timeout_s=600.0)).start()
    assert "cannot load the model" in str(caught.value)
    assert wait_gone(engine_pids(tmp_path)) == []


def test_an_external_engine_is_never_started_or_stopped(fake_python, tmp_path):
    with VllmServer(settings(fake_python)) as owned:
        with VllmServer.external(owned.url + "/") as external:
            assert external.url == owned.url and external.pid is None
        assert all(alive(p) for p in engine_pids(tmp_path))  # leaving the external one stops nothing


def test_an_external_engine_that_does_not_answer_fails_in_time(fake_python, tmp_path):
    with pytest.raises(VllmStartError, match=r"the external engine at http://127\.0\.0\.1:1 did not answer"):
        VllmServer.external("http://127.0.0.1:1", health_timeout_s=0.2).start()


def test_command_and_environment_carry_each_setting(tmp_path):
    python = tmp_path / "python"
    python.touch()
    config = VllmSettings(
        model="/m",
        dtype="bfloat16",
        python=str(python),
        serve=ServeOptions(max_model_len=300, extra_args=("--max-num-seqs", 4)),
        process=ProcessOptions(threads=2, kv_cache_gib=3),
    )
    command = engine_command(config, Path("/shim.py"), 1234)
    assert command[:4] == [str(python), "/shim.py", "serve", "/m"]
    assert " ".join(command[4:]).startswith(
        "--host 127.0.0.1 --port 1234 --dtype bfloat16 --max-model-len 300"
    )
    assert {"--enable-return-routed-experts", "--enable-scale-out", "--enforce-eager"} <= set(command)
    assert command[-2:] == ["--max-num-seqs", "4"]  # extra arguments last, as strings
    off = engine_command(
        VllmSettings(model="/m", python=str(python), routed_experts=False, serve=ServeOptions(eager=False)),
        FAKE,
        1,
    )
    assert "--enable-return-routed-experts" not in off and "--enforce-eager" not in off
    assert command[command.index("--worker-extension-cls") + 1] == "r3lightning_worker.WeightReload"
    env = engine_environment(config)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    # only the standalone worker extension: none of this Python's paths, nothing to shadow
    assert env["PYTHONPATH"] == str(ENGINE_SIDE_DIR)
    assert sorted(p.name for p in ENGINE_SIDE_DIR.glob("*.py")) == ["r3lightning_worker.py"]
    plain = VllmSettings(model="/m", python=str(python), serve=ServeOptions(dev_mode=False))
    assert "--worker-extension-cls" not in engine_command(plain, FAKE, 1)
    assert not {"VLLM_SERVER_DEV_MODE", "PYTHONPATH"} & set(engine_environment(plain))


def test_a_missing_engine_python_says_make_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("R3_VLLM_PYTHON", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="make vllm"):
        engine_python()


@pytest.mark.parametrize(
    "build, expected",
    [
        (lambda: VllmSettings(model="/m", dtype="fp8"), "dtype must be one of"),
        (lambda: VllmSettings(model="/m", port=70000), "port must be"),
        (lambda: ProcessOptions(threads=0), "threads must be"),
        (lambda: ProcessOptions(health_timeout_s=0), "health_timeout_s must be"),
        (lambda: ServeOptions(max_model_len=0), "max_model_len must be"),
        (lambda: VllmSettings(model="/m", serve={"eager": False}), "serve must be a ServeOptions"),
    ],
    ids=["dtype", "port", "threads", "health_timeout", "max_model_len", "serve"],
)
def test_bad_settings_name_the_field(build, expected):
    with pytest.raises((TypeError, ValueError), match=expected):
        build()


NEEDS_ENGINE = "tests/engines/test_vllm_no_routes.py::test_asking_for_routes_is_one_line_naming_the_flag"


@pytest.mark.parametrize("skip", [False, True], ids=["fails", "skips-when-asked"])
def test_the_vllm_tests_fail_saying_make_vllm_without_the_environment(tmp_path, skip):
    env = {**os.environ, "R3_VLLM_PYTHON": str(tmp_path / "no-python"), "R3_SKIP_VLLM": "1" if skip else "0"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", NEEDS_ENGINE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if skip:
        assert run.returncode == 0 and "2 skipped" in run.stdout
    else:
        assert run.returncode != 0 and "run `make vllm`" in run.stdout and "2 error" in run.stdout
