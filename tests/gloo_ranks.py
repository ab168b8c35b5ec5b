"""Helpers for the multi-process (gloo) tests: a free loopback port and a 2-rank launcher."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(fn: Callable[..., Any], *args: Any, nprocs: int = 2) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes and re-raise a rank's failure.

    ``spawn``, not ``fork``: the test process may hold live threads (thread pools, servers, torch
    workers) whose locks a forked child would inherit mid-acquire and wait on forever.
    """
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")
