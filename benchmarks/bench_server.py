"""Server responsiveness: ``/health`` while oversized generate bodies arrive.

Each arm is a server in its own process on 127.0.0.1. Four clients each POST one generate body
of ``--mb`` MiB (a prompt far longer than the model context) while a fifth asks for ``/health``
every 10 ms; the worst ``/health`` latency is how long the server left it waiting. Arms:

- ``decode on the event loop``: a plain aiohttp app whose handler decodes the body with orjson
  and checks every token id in Python on the loop (how the server used to handle bodies);
- ``RolloutServer, decoder thread``: ``r3lightning-serve`` with a body cap above the bodies, so
  it reads them, decodes them in its one decoder thread and refuses them from the prompt length;
- ``RolloutServer, default cap``: the default cap (what a full-context prompt needs) refuses
  the bodies from their Content-Length, unread.

Reported: the worst and median ``/health`` latency and how long the four bodies took to be
answered. Every arm must refuse all four bodies (400 or 413) before its figures count.

Readiness: seconds from launching ``r3lightning-serve --port 0`` (the tiny MoE on the CPU) to its
``listening`` line, median and range over several launches; ``--ready-root DIR`` also times the
checkout at DIR (e.g. an older one) in the same, alternating runs.
Usage: ``python benchmarks/bench_server.py [--quick] [--ready-root DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import _common
import aiohttp
import orjson
from aiohttp import web

BODIES = 4


async def _serve_on_loop() -> None:
    """The reference server (run in a child process): prints its URL, serves until killed."""

    async def generate(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        for i, token in enumerate(body["token_ids"]):  # per-token checks on the loop
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                return web.json_response({"error": f"token_ids[{i}]"}, status=400)
        return web.json_response({"error": f"token_ids has {len(body['token_ids'])} tokens"}, status=400)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/skyrl/v1/generate", generate)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


def _start(command: list[str], root: str | None = None) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(root or _common.ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = child.stdout.readline()
    if "listening on " not in line:
        child.kill()
        raise RuntimeError(f"{command} did not start: {line!r}")
    return child, line.split("listening on ")[1].strip()


async def _measure(url: str, body: bytes) -> tuple[list[float], float, list[int]]:
    latencies: list[float] = []
    done = asyncio.Event()

    async def poll() -> None:
        async with aiohttp.ClientSession() as session:
            while not done.is_set():
                start = time.perf_counter()
                async with session.get(f"{url}/health") as response:
                    assert response.status == 200
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(0.01)

    async def post() -> int:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/skyrl/v1/generate", data=body) as r,
        ):
            await r.read()
            return r.status

    poller = asyncio.create_task(poll())
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    statuses = await asyncio.gather(*(post() for _ in range(BODIES)))
    elapsed = time.perf_counter() - start
    done.set()
    await poller
    return latencies, elapsed, list(statuses)


def readiness(launches: int, other_root: str | None) -> None:
    """Seconds from launch to the ``listening`` line, alternating between the checkouts."""
    command = [sys.executable, "-m", "r3lightning.app.serve.cli", "--port", "0", "--device", "cpu"]
    roots = {"this checkout": None, **({f"{other_root}": other_root} if other_root else {})}
    times: dict[str, list[float]] = {name: [] for name in roots}
    for _ in range(launches):
        for name, root in roots.items():
            start = time.perf_counter()
            child, _ = _start(command, root)
            times[name].append(time.perf_counter() - start)
            child.kill()
            child.wait()
    rows = [
        [name, f"{statistics.median(t):.2f}", f"{min(t):.2f} - {max(t):.2f}", len(t)]
        for name, t in times.items()
    ]
    _common.print_table(
        "r3lightning-serve readiness (launch to listening, tiny MoE on the CPU)",
        ["checkout", "median s", "range s", "launches"],
        rows,
    )


async def main(mb: int) -> None:
    tokens = (mb << 20) // 7
    body = b'{"token_ids": [' + b", ".join([b"12345"] * tokens) + b"]}"
    serve = [sys.executable, "-m", "r3lightning.app.serve.cli", "--port", "0", "--device", "cpu"]
    arms = {
        "decode on the event loop": [sys.executable, __file__, "--serve-on-loop"],
        "RolloutServer, decoder thread": [*serve, "--max-request-bytes", str(len(body) + 1)],
        "RolloutServer, default cap": serve,
    }
    results = {}
    for name, command in arms.items():
        child, url = _start(command)
        try:
            results[name] = await _measure(url, body)
        finally:
            child.kill()
            child.wait()

    for name, (_, _, statuses) in results.items():
        assert all(status in (400, 413) for status in statuses), (name, statuses)
    worst_reference = max(results["decode on the event loop"][0])
    rows = [
        [
            name,
            _common.ms(max(latencies)),
            _common.ms(statistics.median(latencies)),
            _common.ratio(worst_reference, max(latencies)),
            _common.ms(elapsed),
            len(latencies),
        ]
        for name, (latencies, elapsed, _) in results.items()
    ]
    print(_common.machine_line())
    _common.print_table(
        f"/health while {BODIES} generate bodies of {len(body) / _common.MiB:.1f} MiB arrive",
        ["arm", "worst ms", "median ms", "worst vs on-loop", "bodies answered ms", "health answers"],
        rows,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 MiB bodies instead of 16 MiB")
    parser.add_argument("--ready-root", default=None, help="also time r3lightning-serve from this checkout")
    parser.add_argument("--serve-on-loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_on_loop:
        asyncio.run(_serve_on_loop())
    else:
        asyncio.run(main(4 if args.quick else 16))
        readiness(3 if args.quick else 7, args.ready_root)
