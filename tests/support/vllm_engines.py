"""Real vLLM engines for the tests (tests/engines/conftest.py holds the session's fixtures)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from engine_procs import group_members, wait_gone

from r3lightning.app.vllm import VllmServer, VllmSettings


def start_engine(model: Path, python: Path, log_dir: Path, **settings) -> Iterator[VllmServer]:
    """A started engine for the ``with`` body; on exit, every process of its group must be gone."""
    config = VllmSettings(model=str(model), python=str(python), **settings)
    server = VllmServer(config, log_path=log_dir / f"vllm-{config.dtype}.log")
    with server:
        members = group_members(server.pid)
        yield server
    assert not wait_gone(members), f"engine processes outlived the launcher (log: {server.log_path})"
