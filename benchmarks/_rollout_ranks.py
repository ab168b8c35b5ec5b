"""The loopback engine and the gloo ranks of the rollouts-on-many-ranks benchmarks
(``bench_scale.py``, ``bench_scale_pipeline.py``).

The engine speaks the ``skyrl`` protocol: response ids from the request's seed and, for every
answer, one route envelope ``[tokens - 1, 48, 8]`` uint8 encoded once at start-up (so the
engine's own cost stays small). Its routes are :func:`known_routes`, a closed form every rank can
recompute to check what it holds without the code under test. Run as a script, this module is
the engine: ``python _rollout_ranks.py PORT_FILE TOKENS``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import _common
import numpy as np

LAYERS, TOP_K, EXPERTS = 48, 8, 128
ROUTE_BYTES_PER_TOKEN = LAYERS * TOP_K  # uint8
PROMPT_TOKENS = 256


def known_routes(rows: int) -> np.ndarray:
    """The engine's routes ``[rows, 48, 8]`` uint8: expert ``(7 t + 3 l + 16 k) % 128`` at token
    ``t``, layer ``l``, slot ``k`` (distinct within a row; every layer's columns differ, so a
    wrong column is caught)."""
    t, layer, k = np.ogrid[:rows, :LAYERS, :TOP_K]
    return ((7 * t + 3 * layer + 16 * k) % EXPERTS).astype(np.uint8)


# ---------------------------------------------------------------------------- the engine


def serve(port_file: str, tokens: int) -> None:
    """Serve ``POST /skyrl/v1/generate`` on 127.0.0.1 (a free port, written to ``port_file``)."""
    import orjson
    from aiohttp import web

    from r3lightning.wire.codec import encode_routes

    routes = encode_routes(known_routes(tokens - 1), dtype="uint8")

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seed = int(body["sampling_params"]["seed"])
        count = int(body["sampling_params"]["max_tokens"])
        ids = [(seed + 31 * i) % 50_000 for i in range(count)]
        choice = {
            "token_ids": ids,
            "finish_reason": "length",
            "logprobs": {"content": [{"logprob": -0.5} for _ in ids]},
            "routed_experts": routes,
        }
        return web.Response(body=orjson.dumps({"choices": [choice]}), content_type="application/json")

    async def main() -> None:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post("/skyrl/v1/generate", generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        Path(port_file).write_text(str(runner.addresses[0][1]))
        await asyncio.Event().wait()

    asyncio.run(main())


@contextmanager
def engine(tokens: int) -> Iterator[str]:
    """The engine in its own process for the ``with`` block; yields its URL."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp, "port")
        process = subprocess.Popen(
            [sys.executable, __file__, str(port_file), str(tokens)],
            env={**os.environ, "PYTHONPATH": str(_common.ROOT)},
        )
        try:
            deadline = time.monotonic() + 120
            while not port_file.exists() or not port_file.read_text():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the benchmark engine did not start")
                time.sleep(0.1)
            yield f"http://127.0.0.1:{port_file.read_text()}"
        finally:
            process.terminate()
            process.wait(30)


# ---------------------------------------------------------------------------- the ranks


def collector(url: str, args: dict, *, layers: Sequence[int] | None = None, process_group: Any = None) -> Any:
    """A ``RolloutCollector`` of ``args["group_size"]``-trajectory groups of ``args["tokens"]``
    tokens (``PROMPT_TOKENS`` of prompt), keeping routes on ``layers`` (None: all 48), spreading
    the groups over ``process_group`` (None: the default group)."""
    from r3lightning import RolloutCollector, SamplingConfig
    from r3lightning.app.job.grpo import GRPOAdvantages
    from r3lightning.rollout.config import CollectorConfig
    from r3lightning.wire.request import RouteSchema

    return RolloutCollector(
        url,
        lambda prompt, response: float(response[0] % 2),
        CollectorConfig(group_size=args["group_size"], max_in_flight=8, progress=False),
        advantages=GRPOAdvantages(),
        schema=RouteSchema(LAYERS, TOP_K, EXPERTS, layers=layers),
        sampling=SamplingConfig(max_new_tokens=args["tokens"] - PROMPT_TOKENS, ignore_eos=True),
        process_group=process_group,
    )


def prompts(groups: int) -> list[list[int]]:
    """One prompt per group, told apart by its token (trajectory keys: see :func:`held`)."""
    return [[1000 + g] * PROMPT_TOKENS for g in range(groups)]


def held(trajectories: Any) -> list[tuple[int, ...]]:
    """A key per trajectory (its group's prompt token, its first response ids), for checking
    which ranks hold which trajectories."""
    return [(t.prompt_ids[0].item(), *t.response_ids[:4].tolist()) for t in trajectories]


def start_step(buffer: Any) -> tuple[int, float]:
    """Empty ``buffer``, collect garbage and line the ranks up before a timed step; returns the
    peak-RSS base and the start time."""
    import torch.distributed as dist

    buffer.clear()
    gc.collect()
    dist.barrier()
    return _common.reset_peak_rss(), time.perf_counter()


def launch(fn: Callable[..., None], world: int, *args: Any) -> None:
    """``fn(rank, world, *args)`` on ``world`` fresh gloo processes (one torch thread each);
    ``fn`` must be a module-level function (it is pickled by name)."""
    import socket

    # glibc then returns every freed buffer of 64 KiB or more to the OS at once; otherwise it keeps
    # some resident and a later step reuses them, so a rank's peak RSS growth reads low (set before
    # the ranks start: they inherit it)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 << 10))

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_entry, args=(fn, world, port, args), nprocs=world, join=True, start_method="spawn")


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    fn(rank, world, *args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
