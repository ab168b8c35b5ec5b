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
    mp.start_processes(_rank_main, args=(fn, *args), nprocs=nprocs, join=True, start_method="spawn")


def _rank_main(rank: int, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(rank, *args)``, then the rank's process group torn down if ``fn`` (or Lightning, which
    leaves it up after ``fit``) did not: gloo's threads still alive at interpreter exit can abort
    the rank ("terminate called without an active exception") after its work is done."""
    try:
        fn(rank, *args)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
