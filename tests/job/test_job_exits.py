"""Failures in the middle of a job are one line and an exit status, never a traceback: every group
of step 0 dropped, the engine gone at the weight push, a tampered data module state on resume."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from job_cli import train_cli

pytestmark = pytest.mark.slow
QUIET = ["trainer.enable_progress_bar=false", "plot=false", "steps=1", "prompts_per_step=2"]


def _fail(capsys, args: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        train_cli(*args, *QUIET)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return info.value.code, err.strip().splitlines()[-1]


def test_every_group_of_step_0_dropped_is_one_line_exit_2(tmp_path, capsys):
    task = ["task=calculator", "task._target_=broken_task.BrokenToolTask"]
    code, line = _fail(capsys, [*task, f"hydra.run.dir={tmp_path}"])
    assert code == 2
    assert line == (
        "r3lightning-train: error: every group of step 0 was dropped; group 0: RuntimeError: the tool is "
        "broken (the log has each group's error)"
    )


def _answer_health_once(listener: socket.socket) -> None:
    """Answer one ``GET /health`` with 200, the listening socket closed first: the engine is gone
    by the time the job acts on the answer, and its port refuses the weight push."""
    conn, _ = listener.accept()
    with conn:
        request = b""
        while b"\r\n\r\n" not in request:
            request += conn.recv(4096)
        listener.close()
        status = b"200 OK" if request.startswith(b"GET /health ") else b"404 Not Found"
        conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def test_an_engine_gone_at_the_weight_push_is_one_line_exit_3(tmp_path, capsys):
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    thread = threading.Thread(target=_answer_health_once, args=(listener,), daemon=True)
    thread.start()
    code, line = _fail(capsys, [f"rollout.url={url}", f"hydra.run.dir={tmp_path}"])
    thread.join(timeout=30)
    assert code == 3
    prefix = f"r3lightning-train: rollout engine error: weight update at {url} failed: ClientConnectorError: "
    assert line.startswith(prefix) and line.endswith("; is the engine still running?"), line


def test_a_tampered_data_module_state_is_one_line_exit_2(tmp_path, capsys):
    train_cli(f"hydra.run.dir={tmp_path}", *QUIET)  # returns: exit status 0
    last = tmp_path / "replay_r3" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    state = checkpoint["R3DataModule"]
    state["cursor"]["consumed"] = state["cursor"]["batches"] + 1  # past the epoch's batches
    torch.save(checkpoint, last)
    capsys.readouterr()
    code, line = _fail(capsys, [f"hydra.run.dir={tmp_path}", "steps=2"])
    assert code == 2
    assert line.startswith(f"r3lightning-train: error: checkpoint {last}: its data module state is refused (")
    assert "cursor.consumed" in line and line.endswith("or set resume=false or another hydra.run.dir")
