"""Pause and resume around a weight update, and the weight version the trainer sets: the engine
starts no batch while paused, ``/update_weights?weight_version=N`` makes every later answer carry
``N``, and a bad version is a 400 naming the parameter."""

from __future__ import annotations

import asyncio

import aiohttp
from safetensors.torch import save
from server_support import GOOD, post

from r3lightning.app.serve.engine import GenerationRequest
from r3lightning.app.serve.sampling import SamplingParams


async def test_a_paused_engine_runs_no_batch_until_resumed(srv):
    engine = srv.engine
    await asyncio.to_thread(engine.pause)
    assert engine.paused
    request = GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=2, seed=1))
    future = engine.submit(request)
    await asyncio.sleep(0.3)  # the worker would have finished a 2-token request by far
    assert not future.done() and engine._queue.qsize() == 0  # taken from the queue, held back
    engine.resume()
    output = await asyncio.wait_for(asyncio.wrap_future(future), timeout=60)
    assert len(output.token_ids) == 2 and not engine.paused


async def test_pause_waits_for_the_running_batch(srv):
    engine = srv.engine
    request = GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=40, seed=1, ignore_eos=True))
    future = engine.submit(request)
    while not engine._busy:  # the batch has started
        await asyncio.sleep(0.01)
    await asyncio.to_thread(engine.pause)
    assert future.done()  # pause() returned only after the running batch answered
    engine.resume()


async def test_http_pause_update_with_a_version_resume(srv):
    body = save({k: v.contiguous() for k, v in srv.engine.model.state_dict().items()})
    status, answer, _ = await post(f"{srv.url}/pause")
    assert status == 200 and answer == {"paused": True, "weight_version": 0} and srv.engine.paused
    status, answer, _ = await post(f"{srv.url}/update_weights?weight_version=7", data=body)
    assert status == 200 and answer["weight_version"] == 7
    status, answer, _ = await post(f"{srv.url}/resume")
    assert status == 200 and answer == {"paused": False, "weight_version": 7}
    status, answer, _ = await post(f"{srv.url}/generate", json_body=GOOD)
    assert status == 200 and answer["meta_info"]["weight_version"] == 7
    async with aiohttp.ClientSession() as session, session.get(f"{srv.url}/health") as r:
        assert (await r.json())["weight_version"] == 7
    for bad in ("-1", "x", "1.5"):
        status, answer, _ = await post(f"{srv.url}/update_weights?weight_version={bad}", data=body)
        assert status == 400, answer
        assert "weight_version must be an integer >= 0" in answer["error"]["message"]
    assert srv.engine.weight_version == 7  # refused before anything changed
