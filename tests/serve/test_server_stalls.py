"""The embedded server against what stalls it: a client trickling its body a byte at a time (real
loopback sockets), a batch wait too long for the batching thread, a batching thread that died.
No wall-clock bound: each test waits for an event, with a generous guard against a hang."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from safetensors.torch import save
from server_support import post, raw_request, status_line, still_serving

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.serve.engine import GenerationRequest
from r3lightning.app.serve.server import RolloutServer

GUARD_S = 120  # generous: only a server that never cuts the trickle reaches it


async def _trickled_request(srv: RolloutServer, head: bytes, body: bytes) -> tuple[int, bytes]:
    """Send the request ``head`` (up to ``Content-Length: N``), then ``body`` one byte every 20 ms
    until the server answers; returns the answer's status and bytes (the trickle stops there)."""
    reader, writer = await raw_request(srv, head + b"\r\n\r\n")
    answered = asyncio.Event()

    async def trickle() -> None:  # until the body ends, the server closes or has answered
        with contextlib.suppress(ConnectionError):
            for i in range(len(body)):
                if answered.is_set():
                    return
                writer.write(body[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0.02)

    trickler = asyncio.create_task(trickle())
    try:
        return await status_line(reader, timeout=GUARD_S)
    finally:
        answered.set()
        await trickler
        writer.close()


async def test_a_trickled_weight_upload_is_cut_and_the_next_upload_goes_through():
    limits = ServerLimits(body_timeout_s=0.5, min_body_rate=1 << 20)
    async with RolloutServer(build_tiny_moe(seed=0), limits=limits) as srv:
        embed = srv.engine.model.get_input_embeddings().weight.detach().clone()
        upload = save({"model.embed_tokens.weight": (embed + 1).contiguous()})
        head = b"POST /update_weights HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(upload)).encode()
        # each byte comes well within body_timeout_s: only the minimum rate cuts it
        status, answer = await _trickled_request(srv, head, upload)
        assert status == 408 and b"request body too slow" in answer and b"min_body_rate" in answer
        assert srv.weight_version == 0
        status, payload, _ = await post(f"{srv.url}/update_weights", upload)  # not 409: the slot is free
        assert status == 200 and payload["weight_version"] == 1, payload
        await still_serving(srv)


async def test_trickled_generate_bodies_are_cut_and_free_their_slots():
    """max_batch_size 1 and max_queue 0: one generate slot. A trickler holding it makes everyone
    else a 429 until the server cuts it."""
    limits = ServerLimits(body_timeout_s=0.5, min_body_rate=1 << 20, max_queue=0)
    engine = EngineConfig(max_batch_size=1)
    async with RolloutServer(build_tiny_moe(seed=0), engine=engine, limits=limits) as srv:
        body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}'
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
        status, answer = await _trickled_request(srv, head + str(len(body)).encode(), body)
        assert status == 408 and b"request body too slow" in answer
        await still_serving(srv)  # the slot is free again


def test_min_body_rate_is_checked_when_built():
    with pytest.raises(ValueError, match=r"^min_body_rate must be an integer >= 1, got 0$"):
        ServerLimits(min_body_rate=0)


@pytest.mark.parametrize("value", [1e10, 10.5, float("inf")])
def test_a_batch_wait_the_batching_thread_cannot_take_is_refused(value):
    with pytest.raises(ValueError, match=r"^batch_wait_s must be a number >= 0 and <= 10"):
        EngineConfig(batch_wait_s=value)
    EngineConfig(batch_wait_s=10.0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death itself
async def test_health_is_503_once_the_generation_thread_has_died():
    async with RolloutServer(build_tiny_moe(seed=0)) as srv:
        engine = srv.engine

        def die() -> None:
            raise RuntimeError("the batching thread fails")

        engine._serve = die  # the thread's target, read when the first request starts it
        with contextlib.suppress(Exception):
            engine.submit(GenerationRequest([1, 2, 3]))
        await asyncio.to_thread(engine._worker.join, GUARD_S)
        assert engine.worker_died
        async with asyncio.timeout(GUARD_S):
            reader, writer = await raw_request(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, answer = await status_line(reader, timeout=GUARD_S)
            writer.close()
        assert status == 503 and b"the generation thread has died" in answer
