"""Weight uploads to the embedded server on 127.0.0.1: refused from the safetensors header before
the data is read, all or nothing, one at a time, never mid-generation; values that overflow the
serving dtype are refused. The safetensors reader on its own: tests/wire/test_safetensors_body.py."""

from __future__ import annotations

import asyncio
import re
import struct
import time

import aiohttp
import pytest
import torch
from safetensors.torch import save
from server_support import post, raw_request, same_weights, status_line, still_serving, weights_of

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.serve.server import RolloutServer

# --------------------------------------------------------------------------- weight uploads


def _safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({k: v.contiguous() for k, v in tensors.items()})


def _head(length: int, path: bytes = b"/update_weights") -> bytes:
    return b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(length).encode() + b"\r\n\r\n"


EMBED = "model.embed_tokens.weight"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "int64",
            r"upload\['model.embed_tokens.weight'\] has dtype torch.int64; the model's floating tensor",
        ),
        ("bool", r"has dtype torch.bool"),
        ("uint8", r"has dtype torch.uint8"),
        ("fp8", r"has dtype torch.float8_e4m3fn"),
        (
            "nan",
            r"^state_dict\['model.embed_tokens.weight'\] holds 1 values that are not finite in the serving "
            r"dtype torch.float32 \(NaN, inf, or beyond its range\)$",
        ),
        ("inf", r"holds 1 values that are not finite in the serving dtype torch.float32"),
        # finite in float64, inf once cast into the float32 the server serves
        (
            "float64 1e300",
            r"'model.embed_tokens.weight'\] holds 2 values that are not finite in .*torch.float32",
        ),
        (
            "inv_freq",
            r"not parameters or persistent buffers of the model, e.g. \['model.rotary_emb.inv_freq'\]",
        ),
        ("shape", r"upload\['model.embed_tokens.weight'\] has shape \(95, 64\)"),
    ],
)
async def test_bad_weight_uploads_are_refused_all_or_nothing(srv, case, message):
    new = build_tiny_moe(seed=3).state_dict()
    embed = new[EMBED]
    bad = {
        "int64": embed.long(),
        "bool": embed > 0,
        "uint8": embed.to(torch.uint8),
        "fp8": embed.to(torch.float8_e4m3fn),
        "nan": embed.clone().index_put_((torch.tensor([2]), torch.tensor([5])), torch.tensor(float("nan"))),
        "inf": embed.clone().index_put_((torch.tensor([2]), torch.tensor([5])), torch.tensor(float("inf"))),
        "float64 1e300": embed.double().index_put_(
            (torch.tensor([2, 7]), torch.tensor([5, 1])), torch.tensor(1e300, dtype=torch.float64)
        ),
        "shape": embed[:95],
    }
    upload = dict(new)
    if case == "inv_freq":
        upload["model.rotary_emb.inv_freq"] = torch.zeros_like(srv.engine.model.model.rotary_emb.inv_freq)
    else:
        upload[EMBED] = bad[case]
    before = weights_of(srv)
    inv_freq = srv.engine.model.model.rotary_emb.inv_freq.clone()
    status, payload, _ = await post(f"{srv.url}/update_weights", _safetensors(upload))
    assert status == 400, payload
    assert re.search(message, payload["error"]["message"]), payload
    assert same_weights(srv, before) and srv.weight_version == 0
    assert torch.equal(srv.engine.model.model.rotary_emb.inv_freq, inv_freq)
    await still_serving(srv)
    status, payload, _ = await post(f"{srv.url}/update_weights", _safetensors(new))
    assert status == 200 and payload == {"updated": len(new), "weight_version": 1}
    assert torch.equal(srv.engine.model.state_dict()[EMBED], embed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_finite_float32_values_beyond_the_serving_dtype_are_refused(dtype):
    """3.4e38 is a finite float32 but inf in bf16 and fp16; 70000 overflows fp16 only (its largest value is 65504)."""
    async with RolloutServer(build_tiny_moe(seed=0), engine=EngineConfig(dtype=dtype)) as srv:
        new = build_tiny_moe(seed=3).state_dict()
        head = "lm_head.weight"
        for value, refused in ((3.4e38, True), (70000.0, dtype == torch.float16)):
            upload = dict(new)
            upload[head] = new[head].clone().index_fill_(0, torch.tensor([4]), value)  # one row of 64
            assert torch.isfinite(upload[head]).all()
            before = weights_of(srv)
            status, payload, _ = await post(f"{srv.url}/update_weights", _safetensors(upload))
            if refused:
                assert status == 400 and payload["error"]["message"] == (
                    f"state_dict['{head}'] holds 64 values that are not finite in the serving dtype "
                    f"{dtype} (NaN, inf, or beyond its range)"
                )
                assert same_weights(srv, before) and srv.weight_version == 0
            else:
                assert status == 200 and torch.isfinite(srv.engine.model.lm_head.weight).all()
        await still_serving(srv)


async def test_uploads_are_refused_from_the_header_before_the_data_is_read(srv):
    """The body announces 512 MiB; only the header is sent, and the answer comes anyway."""
    before = weights_of(srv)
    announced = 512 << 20
    # garbage: its first 8 bytes read as an absurd header length
    reader, writer = await raw_request(srv, _head(announced), b"\x7f" * 4096)
    status, answer = await status_line(reader)
    assert status == 400 and b"not a safetensors file: header length" in answer
    writer.close()
    # a well-formed header whose tensor is int64
    upload = _safetensors({EMBED: torch.zeros(96, 64, dtype=torch.int64)})
    header_end = 8 + struct.unpack("<Q", upload[:8])[0]
    reader, writer = await raw_request(srv, _head(len(upload)), upload[:header_end])
    status, answer = await status_line(reader)
    assert status == 400 and b"has dtype torch.int64" in answer
    writer.close()
    # Content-Length disagreeing with the header's size
    good = _safetensors({EMBED: torch.zeros(96, 64)})
    header_end = 8 + struct.unpack("<Q", good[:8])[0]
    reader, writer = await raw_request(srv, _head(announced), good[:header_end])
    status, answer = await status_line(reader)
    assert status == 400 and b"but Content-Length is 536870912" in answer
    writer.close()
    assert same_weights(srv, before) and srv.weight_version == 0
    await still_serving(srv)


async def test_upload_over_the_cap_is_413_from_its_header():
    async with RolloutServer(build_tiny_moe(seed=0), limits=ServerLimits(max_weights_bytes=20_000)) as srv:
        before = weights_of(srv)
        upload = _safetensors({EMBED: torch.zeros(96, 64)})  # 24 KiB of data
        status, payload, _ = await post(f"{srv.url}/update_weights", upload)
        assert status == 413 and "exceeds the cap of 20000 bytes" in payload["error"]["message"]

        async def chunks():  # no Content-Length: the header's size decides before any data
            yield upload[:4096]
            yield upload[4096:]

        status, payload, _ = await post(f"{srv.url}/update_weights", chunks())
        assert (
            status == 413
            and f"safetensors body of {len(upload)} bytes exceeds" in payload["error"]["message"]
        )
        assert same_weights(srv, before)
        await still_serving(srv)


async def test_one_weight_upload_at_a_time():
    async with RolloutServer(build_tiny_moe(seed=0), limits=ServerLimits(body_timeout_s=1.0)) as srv:
        new = build_tiny_moe(seed=4).state_dict()
        upload = _safetensors(new)
        reader, writer = await raw_request(srv, _head(len(upload)), upload[: len(upload) // 2])  # then stalls
        await asyncio.sleep(0.2)
        status, payload, _ = await post(f"{srv.url}/update_weights", upload)
        assert status == 409 and payload["error"]["type"] == "Conflict"
        status, _ = await status_line(reader)  # the stalled upload times out, nothing loaded
        assert status == 408
        writer.close()
        assert srv.weight_version == 0
        status, payload, _ = await post(f"{srv.url}/update_weights", upload)
        assert status == 200 and payload["weight_version"] == 1
        assert all(torch.equal(srv.engine.model.state_dict()[k], v.bfloat16()) for k, v in new.items())
        await still_serving(srv)


async def test_a_client_that_disconnects_mid_upload_loses_nothing(srv):
    before = weights_of(srv)
    upload = _safetensors(build_tiny_moe(seed=4).state_dict())
    _, writer = await raw_request(srv, _head(len(upload)), upload[: len(upload) // 3])
    writer.close()
    await writer.wait_closed()
    deadline = time.monotonic() + 10
    while srv._uploading and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not srv._uploading
    assert same_weights(srv, before) and srv.weight_version == 0
    await still_serving(srv)


@pytest.mark.slow
async def test_weights_load_off_the_loop_and_never_mid_generation():
    """An upload that waits for a running generation waits in a worker thread: /health answers
    meanwhile; the generation finishes on the old weights, the next one sees the new ones."""
    async with RolloutServer(
        build_tiny_moe(seed=0),
        engine=EngineConfig(dtype=torch.float32),
        limits=ServerLimits(max_new_tokens_cap=250),
    ) as srv:
        new = build_tiny_moe(seed=6).state_dict()
        long = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 250, "ignore_eos": True}}
        generation = asyncio.create_task(post(f"{srv.url}/skyrl/v1/generate", json_body=long))
        await asyncio.sleep(0.2)  # the batch is running
        upload = asyncio.create_task(post(f"{srv.url}/update_weights", _safetensors(new)))
        await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session, session.get(f"{srv.url}/health") as r:
            health = await r.json()
        # answered while the upload waited for the running batch
        assert health["status"] == "ok" and not generation.done() and not upload.done()
        status, payload, _ = await generation
        assert status == 200 and payload["weight_version"] == 0
        status, payload, _ = await upload
        assert status == 200 and payload["weight_version"] == 1
        assert all(torch.equal(srv.engine.model.state_dict()[k], v) for k, v in new.items())
        await still_serving(srv)
