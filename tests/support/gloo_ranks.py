"""The one launcher of the multi-process tests: ``run_ranks(fn, *args, nprocs=2)``.

Each rank is a fresh spawned process that sees what ``torchrun`` would set on 127.0.0.1
(``MASTER_ADDR``, ``MASTER_PORT`` on a free port, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``NODE_RANK``), so ``dist.init_process_group("gloo")`` and Lightning's ``ddp`` / FSDP2 strategies
join the group without more set-up.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables a launcher sets for ``rank`` of a ``world``-rank job on one host."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "NODE_RANK": "0",
    }


def run_ranks(fn: Callable[..., Any], *args: Any, nprocs: int = 2) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes and re-raise a rank's failure.

    ``spawn``, not ``fork``: the test process may hold live threads (thread pools, servers, torch
    workers) whose locks a forked child would inherit mid-acquire and wait on forever.
    """
    port = free_port()
    mp.start_processes(
        _rank_main, args=(fn, nprocs, port, *args), nprocs=nprocs, join=True, start_method="spawn"
    )


def _rank_main(rank: int, fn: Callable[..., Any], world: int, port: int, *args: Any) -> None:
    """``fn(rank, *args)`` in the rank's environment, then the rank's process group torn down if
    ``fn`` (or Lightning, which leaves it up after ``fit``) did not: gloo's threads still alive at
    interpreter exit can abort the rank after its work is done."""
    os.environ.update(rank_environment(rank, world, port))
    try:
        fn(rank, *args)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
