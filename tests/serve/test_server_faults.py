"""Fault injection against the embedded rollout server on 127.0.0.1.

Each test sends one kind of bad, stalled or hostile traffic, checks the answer (status, error
type, the field named), then checks the server still answers ``/health`` and a good generate
request, and that nothing was lost (the serving weights and their version).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import pytest
import torch
from runif import run_if
from safetensors.torch import save

from r3lightning.serve.server import RolloutServer
from r3lightning.testing.tiny import build_tiny_moe

GOOD = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}


async def _post(url: str, data=None, *, json_body=None, headers=None) -> tuple[int, dict, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, json=json_body, headers=headers) as r,
    ):
        return r.status, json.loads(await r.read()), dict(r.headers)


async def _still_serving(srv: RolloutServer, headers: dict | None = None) -> None:
    """``/health`` answers and a good request generates."""
    async with aiohttp.ClientSession() as session, session.get(f"{srv.url}/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    status, payload, _ = await _post(f"{srv.url}/generate", json_body=GOOD, headers=headers)
    assert status == 200 and len(payload["output_ids"]) == 3, payload


def _weights(srv: RolloutServer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in srv.engine.model.state_dict().items()}


def _same_weights(srv: RolloutServer, before: dict[str, torch.Tensor]) -> bool:
    after = srv.engine.model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


async def _raw(
    srv: RolloutServer, head: bytes, body: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(srv.host, srv.port)
    writer.write(head + body)
    await writer.drain()
    return reader, writer


async def _status_line(reader: asyncio.StreamReader, timeout: float = 10.0) -> tuple[int, bytes]:
    """Status code and the rest of a raw HTTP answer (read until the server closes or times out)."""
    data = b""
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                data += chunk
                if b"\r\n\r\n" in data:
                    head, _, rest = data.partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length")
                        ),
                        None,
                    )
                    if length is not None and len(rest) >= length:
                        break
    except TimeoutError:
        pass
    return int(data.split(b" ", 2)[1]), data


@pytest.fixture
async def srv():
    async with RolloutServer(build_tiny_moe(seed=0), dtype=torch.float32, max_batch_size=8) as server:
        yield server


# --------------------------------------------------------------------------- sampling


async def test_poison_sampling_request_fails_alone_and_its_batch_mates_finish(srv):
    """temperature 1e-300 overflows float32 logits: refused with 400 naming the field, while the
    seven good requests sent with it generate."""
    poison = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "temperature": 1e-300}}
    good = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    results = await asyncio.gather(
        _post(f"{srv.url}/generate", json_body=poison),
        *(_post(f"{srv.url}/generate", json_body=good) for _ in range(7)),
    )
    status, payload, _ = results[0]
    assert status == 400 and payload["error"]["type"] == "BadRequest"
    assert "sampling_params.temperature must be 0 (greedy) or in [0.001, 1000]" in payload["error"]["message"]
    assert [r[0] for r in results[1:]] == [200] * 7
    assert all(len(r[1]["output_ids"]) == 4 for r in results[1:])
    await _still_serving(srv)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": 1e-4}, r"sampling_params.temperature must be 0 \(greedy\) or in \[0.001, 1000\]"),
        ({"temperature": 1e6}, r"sampling_params.temperature must be 0 \(greedy\) or in \[0.001, 1000\]"),
        ({"top_k": 2**40}, r"sampling_params.top_k must be in \[-1, 2147483647\]"),
        ({"top_k": -3}, r"sampling_params.top_k must be in \[-1, 2147483647\]"),
        ({"seed": 2**63}, r"sampling_params.seed must be <= 9223372036854775807"),
        ({"max_token": 4}, r"sampling_params has unknown keys \['max_token'\]"),
        ({"max_tokens": 4, "best_of": 2, "beam": 1}, r"unknown keys \['beam', 'best_of'\]"),
        ({"repetition_penalty": 1.3}, r"sampling_params.repetition_penalty = 1.3 is not supported"),
        ({"stop": ["</s>"]}, r"sampling_params.stop = \['</s>'\] is not supported"),
        ({"logprobs": 5}, r"sampling_params.logprobs = 5 is not supported"),
        ({"skip_special_tokens": "no"}, r"sampling_params.skip_special_tokens must be true or false"),
    ],
)
async def test_out_of_range_and_unknown_sampling_keys_get_400_naming_them(srv, params, message):
    status, payload, _ = await _post(
        f"{srv.url}/skyrl/v1/generate", json_body={"token_ids": [5, 6], "sampling_params": params}
    )
    assert status == 400, payload
    assert re.search(message, payload["error"]["message"]), payload
    await _still_serving(srv)


async def test_neutral_and_text_only_sampling_keys_are_accepted(srv):
    params = {
        "max_tokens": 2,
        "repetition_penalty": 1.0,
        "min_p": 0,
        "presence_penalty": 0.0,
        "logprobs": 0,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "stop": [],
    }
    status, payload, _ = await _post(
        f"{srv.url}/skyrl/v1/generate", json_body={"token_ids": [5, 6], "sampling_params": params}
    )
    assert status == 200 and len(payload["choices"][0]["token_ids"]) <= 2


async def test_max_tokens_above_the_server_cap_is_refused():
    async with RolloutServer(build_tiny_moe(seed=0), max_new_tokens_cap=8) as srv:
        body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 1_000_000_000}}
        status, payload, _ = await _post(f"{srv.url}/skyrl/v1/generate", json_body=body)
        assert status == 400
        assert payload["error"]["message"] == (
            "sampling_params.max_tokens must be <= 8 (this server's cap), got 1000000000"
        )
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 9}}
        status, payload, _ = await _post(f"{srv.url}/generate", json_body=body)
        assert status == 400 and "sampling_params.max_new_tokens must be <= 8" in payload["error"]["message"]
        body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 8, "ignore_eos": True}}
        status, payload, _ = await _post(f"{srv.url}/skyrl/v1/generate", json_body=body)
        assert status == 200 and len(payload["choices"][0]["token_ids"]) == 8
        await _still_serving(srv)


# --------------------------------------------------------------------------- skyrl routes


async def test_skyrl_returns_routes_whenever_recorded_and_the_start_only_narrows(srv):
    prompt = [5, 6, 7, 8, 9]
    params = {"max_tokens": 4, "seed": 3, "ignore_eos": True}
    url = f"{srv.url}/skyrl/v1/generate"
    _, full, _ = await _post(url, json_body={"token_ids": prompt, "sampling_params": params})
    routes = full["choices"][0]["routed_experts"]
    assert routes is not None and routes["shape"] == [5 + 4 - 1, 4, 2]  # SkyRL's batched path sends no start
    _, part, _ = await _post(
        url, json_body={"token_ids": prompt, "sampling_params": {**params, "routed_experts_prompt_start": 3}}
    )
    narrowed = part["choices"][0]["routed_experts"]
    assert narrowed["shape"] == [5 - 3 + 4 - 1, 4, 2]

    def decode(envelope):
        return np.frombuffer(base64.b64decode(envelope["data"]), dtype=envelope["dtype"]).reshape(
            envelope["shape"]
        )

    assert (decode(narrowed) == decode(routes)[3:]).all()
    body = {"token_ids": prompt, "sampling_params": params, "return_routed_experts": False}
    _, off, _ = await _post(url, json_body=body)
    assert off["choices"][0]["routed_experts"] is None


# --------------------------------------------------------------------------- timeouts and queue


async def test_a_connection_that_never_finishes_its_headers_is_closed():
    async with RolloutServer(build_tiny_moe(seed=0), header_timeout_s=0.5) as srv:
        start = time.monotonic()
        reader, writer = await _raw(srv, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le")
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # closed by the server, no answer
        assert 0.4 < time.monotonic() - start < 5
        writer.close()
        await _still_serving(srv)


async def test_a_stalled_body_gets_408():
    async with RolloutServer(build_tiny_moe(seed=0), body_timeout_s=0.5) as srv:
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        reader, writer = await _raw(srv, head, b'{"input_ids": [')
        status, answer = await _status_line(reader)
        assert status == 408 and b"request body stalled" in answer and b"RequestTimeout" in answer
        writer.close()
        await _still_serving(srv)


async def test_past_max_queue_the_answer_is_429_with_retry_after():
    """Two requests that never send their bodies hold the whole budget (batch 1 + queue 1)."""
    async with RolloutServer(build_tiny_moe(seed=0), max_batch_size=1, max_queue=1, retry_after_s=3) as srv:
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n"
        stalled = [await _raw(srv, head, b"{") for _ in range(2)]
        deadline = time.monotonic() + 10
        while True:
            status, payload, headers = await _post(f"{srv.url}/generate", json_body=GOOD)
            if status == 429 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert status == 429 and headers["Retry-After"] == "3"
        assert payload["error"]["type"] == "TooManyRequests"
        assert "max_batch_size 1 + max_queue 1" in payload["error"]["message"]
        for _, writer in stalled:
            writer.close()
        deadline = time.monotonic() + 10
        while srv._generating and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await _still_serving(srv)


async def test_generate_bodies_beyond_a_full_context_prompt_are_refused_unread():
    async with RolloutServer(build_tiny_moe(seed=0)) as srv:
        assert srv.max_request_bytes == (64 << 10) + 24 * 256  # full context of the tiny model
        body = b'{"token_ids": [' + b", ".join([b"12345"] * ((16 << 20) // 7)) + b"]}"
        results = await asyncio.gather(*(_post(f"{srv.url}/skyrl/v1/generate", body) for _ in range(4)))
        for status, payload, _ in results:
            assert status == 413
            assert payload["error"]["message"] == (
                f"request body of {len(body)} bytes exceeds the cap of {srv.max_request_bytes} bytes"
            )
        prompt = [95] * 255  # a full-context prompt fits, pretty-printed
        body = json.dumps({"token_ids": prompt, "sampling_params": {"max_tokens": 1}}, indent=8).encode()
        status, payload, _ = await _post(f"{srv.url}/skyrl/v1/generate", body)
        assert status == 200 and len(payload["choices"][0]["token_ids"]) == 1
        await _still_serving(srv)


async def test_large_generate_bodies_do_not_stall_health():
    """Four 16 MB prompts (far past the context) are decoded off the event loop and refused from
    their length; /health keeps answering meanwhile (the loop used to stall for seconds)."""
    async with RolloutServer(build_tiny_moe(seed=0), max_request_bytes=17 << 20) as srv:
        tokens = b", ".join([b"12345"] * ((16 << 20) // 7))
        body = b'{"token_ids": [' + tokens + b"]}"
        assert len(body) > 15 << 20
        latencies: list[float] = []
        done = asyncio.Event()

        async def poll_health():
            async with aiohttp.ClientSession() as session:
                while not done.is_set():
                    start = time.monotonic()
                    async with session.get(f"{srv.url}/health") as r:
                        assert r.status == 200
                    latencies.append(time.monotonic() - start)
                    await asyncio.sleep(0.01)

        poller = asyncio.create_task(poll_health())
        results = await asyncio.gather(*(_post(f"{srv.url}/skyrl/v1/generate", body) for _ in range(4)))
        done.set()
        await poller
        for status, payload, _ in results:
            assert status == 400
            assert "token_ids has 2396745 tokens, more than the 255" in payload["error"]["message"]
        assert latencies and max(latencies) < 2.5, max(latencies)  # on the loop: 4.6 s
        await _still_serving(srv)


# --------------------------------------------------------------------------- auth and exposure


async def test_non_utf8_authorization_is_401():
    async with RolloutServer(build_tiny_moe(seed=0), api_key="s3cret") as srv:
        body = json.dumps(GOOD).encode()
        head = (
            b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x80\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        reader, writer = await _raw(srv, head, body)
        status, answer = await _status_line(reader)
        assert status == 401 and b"bearer token" in answer
        writer.close()
        await _still_serving(srv, headers={"Authorization": "Bearer s3cret"})


def test_a_non_loopback_host_needs_an_api_key_or_an_explicit_opt_out():
    model = build_tiny_moe(seed=0)
    with pytest.raises(ValueError, match=r"host '0.0.0.0' is reachable from other machines but no api_key"):
        RolloutServer(model, host="0.0.0.0")
    # constructed, never started: the tests bind loopback only
    RolloutServer(model, host="0.0.0.0", api_key="k")
    RolloutServer(model, host="0.0.0.0", allow_unauthenticated=True)
    RolloutServer(model, host="::1")
    RolloutServer(model, host="localhost")


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
        ("nan", r"state_dict\['model.embed_tokens.weight'\] holds 1 non-finite values"),
        ("inf", r"holds 1 non-finite values"),
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
        "shape": embed[:95],
    }
    upload = dict(new)
    if case == "inv_freq":
        upload["model.rotary_emb.inv_freq"] = torch.zeros_like(srv.engine.model.model.rotary_emb.inv_freq)
    else:
        upload[EMBED] = bad[case]
    before = _weights(srv)
    inv_freq = srv.engine.model.model.rotary_emb.inv_freq.clone()
    status, payload, _ = await _post(f"{srv.url}/update_weights", _safetensors(upload))
    assert status == 400, payload
    assert re.search(message, payload["error"]["message"]), payload
    assert _same_weights(srv, before) and srv.weight_version == 0
    assert torch.equal(srv.engine.model.model.rotary_emb.inv_freq, inv_freq)
    await _still_serving(srv)
    status, payload, _ = await _post(f"{srv.url}/update_weights", _safetensors(new))
    assert status == 200 and payload == {"updated": len(new), "weight_version": 1}
    assert torch.equal(srv.engine.model.state_dict()[EMBED], embed)


async def test_uploads_are_refused_from_the_header_before_the_data_is_read(srv):
    """The body announces 512 MiB; only the header is sent, and the answer comes anyway."""
    before = _weights(srv)
    announced = 512 << 20
    # garbage: its first 8 bytes read as an absurd header length
    reader, writer = await _raw(srv, _head(announced), b"\x7f" * 4096)
    status, answer = await _status_line(reader)
    assert status == 400 and b"not a safetensors file: header length" in answer
    writer.close()
    # a well-formed header whose tensor is int64
    upload = _safetensors({EMBED: torch.zeros(96, 64, dtype=torch.int64)})
    header_end = 8 + struct.unpack("<Q", upload[:8])[0]
    reader, writer = await _raw(srv, _head(len(upload)), upload[:header_end])
    status, answer = await _status_line(reader)
    assert status == 400 and b"has dtype torch.int64" in answer
    writer.close()
    # Content-Length disagreeing with the header's size
    good = _safetensors({EMBED: torch.zeros(96, 64)})
    header_end = 8 + struct.unpack("<Q", good[:8])[0]
    reader, writer = await _raw(srv, _head(announced), good[:header_end])
    status, answer = await _status_line(reader)
    assert status == 400 and b"but Content-Length is 536870912" in answer
    writer.close()
    assert _same_weights(srv, before) and srv.weight_version == 0
    await _still_serving(srv)


async def test_upload_over_the_cap_is_413_from_its_header():
    async with RolloutServer(build_tiny_moe(seed=0), max_weights_bytes=20_000) as srv:
        before = _weights(srv)
        upload = _safetensors({EMBED: torch.zeros(96, 64)})  # 24 KiB of data
        status, payload, _ = await _post(f"{srv.url}/update_weights", upload)
        assert status == 413 and "exceeds the cap of 20000 bytes" in payload["error"]["message"]

        async def chunks():  # no Content-Length: the header's size decides before any data
            yield upload[:4096]
            yield upload[4096:]

        status, payload, _ = await _post(f"{srv.url}/update_weights", chunks())
        assert (
            status == 413
            and f"safetensors body of {len(upload)} bytes exceeds" in payload["error"]["message"]
        )
        assert _same_weights(srv, before)
        await _still_serving(srv)


async def test_one_weight_upload_at_a_time():
    async with RolloutServer(build_tiny_moe(seed=0), body_timeout_s=1.0) as srv:
        new = build_tiny_moe(seed=4).state_dict()
        upload = _safetensors(new)
        reader, writer = await _raw(srv, _head(len(upload)), upload[: len(upload) // 2])  # then stalls
        await asyncio.sleep(0.2)
        status, payload, _ = await _post(f"{srv.url}/update_weights", upload)
        assert status == 409 and payload["error"]["type"] == "Conflict"
        status, _ = await _status_line(reader)  # the stalled upload times out, nothing loaded
        assert status == 408
        writer.close()
        assert srv.weight_version == 0
        status, payload, _ = await _post(f"{srv.url}/update_weights", upload)
        assert status == 200 and payload["weight_version"] == 1
        assert all(torch.equal(srv.engine.model.state_dict()[k], v.bfloat16()) for k, v in new.items())
        await _still_serving(srv)


async def test_a_client_that_disconnects_mid_upload_loses_nothing(srv):
    before = _weights(srv)
    upload = _safetensors(build_tiny_moe(seed=4).state_dict())
    _, writer = await _raw(srv, _head(len(upload)), upload[: len(upload) // 3])
    writer.close()
    await writer.wait_closed()
    deadline = time.monotonic() + 10
    while srv._uploading and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not srv._uploading
    assert _same_weights(srv, before) and srv.weight_version == 0
    await _still_serving(srv)


# --------------------------------------------------------------------------- command line


def _free_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def _cli_error(capsys, argv: list[str]) -> str:
    from r3lightning.serve.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("r3lightning-serve: error: "), err
    return err


def test_cli_model_that_is_not_a_local_directory_fails_in_one_line_without_network(
    capsys, monkeypatch, tmp_path
):
    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    err = _cli_error(capsys, ["--model", "/nonexistent"])
    assert (
        "--model /nonexistent is not a directory; expected a local Hugging Face checkpoint directory" in err
    )
    err = _cli_error(capsys, ["--model", "Qwen/Qwen3-30B-A3B"])  # a hub name is not downloaded
    assert "is not a directory" in err
    err = _cli_error(capsys, ["--model", str(tmp_path)])
    assert "has no config.json" in err
    (tmp_path / "config.json").write_text("{not json")
    err = _cli_error(capsys, ["--model", str(tmp_path)])
    assert f"--model {tmp_path}: cannot load the checkpoint" in err


@run_if(cuda=False)  # checks the error on a machine without a GPU
def test_cli_cuda_device_without_cuda(capsys):
    err = _cli_error(capsys, ["--device", "cuda"])
    assert "--device cuda: CUDA is not available on this machine; use --device cpu" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "argument --port: expected an integer in [0, 65535], got 99999"),
        (["--port", "x"], "argument --port: expected an integer in [0, 65535], got 'x'"),
        (["--device", "tpu:0"], "--device tpu:0: "),
        (["--host", "0.0.0.0"], "host '0.0.0.0' is reachable from other machines but no api_key is set"),
        (["--max-queue", "-1"], "max_queue must be an integer >= 0, got -1"),
        (["--max-weights-bytes", "0"], "max_weights_bytes must be a positive integer, got 0"),
        (["--nope"], "unrecognized arguments: --nope"),
    ],
)
def test_cli_bad_arguments_fail_in_one_line(capsys, argv, message):
    assert message in _cli_error(capsys, argv)


def test_cli_port_in_use_fails_in_one_line(capsys):
    sock, port = _free_port()
    with sock:
        err = _cli_error(capsys, ["--port", str(port), "--device", "cpu"])
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_cli_entry_point_exits_2_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "r3lightning.serve.server", "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == (
        "r3lightning-serve: error: argument --port: expected an integer in [0, 65535], got 99999\n"
    )


# --------------------------------------------------------------------------- safetensors reader


def _upload(header: dict, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


async def _read(body: bytes, targets: dict, *, chunk: int = 1, content_length: int | None = None):
    from r3lightning.serve.weights import UploadError, read_safetensors_upload

    async def chunks():
        for i in range(0, len(body), chunk):
            yield body[i : i + chunk]

    return await read_safetensors_upload(
        chunks(),
        content_length=content_length,
        max_bytes=1 << 20,
        targets=targets,
        strict=False,
        too_large=lambda size: UploadError(f"too large: {size}", status=413),
    )


async def test_reader_handles_byte_sized_chunks_and_unaligned_tensors():
    """An odd-sized fp16 tensor leaves the fp32 one after it at an unaligned offset."""
    a, b = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float16), torch.tensor([0.5, 7.0], dtype=torch.float32)
    header = {
        "a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 6]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [6, 14]},
        "__metadata__": {"format": "pt"},
    }
    data = a.numpy().tobytes() + b.numpy().tobytes()
    body = _upload(header, data)
    got = await _read(body, {"a": torch.zeros(3), "b": torch.zeros(2)}, content_length=len(body))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"", r"data_offsets span 8 bytes"),
        ({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}}, b"", r"unknown dtype 'Q4'"),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
            },
            b"\0" * 12,
            r"header\['b'\]: data starts at byte 8, expected 4",
        ),
        ({"a": {"dtype": "F32", "shape": [1]}}, b"", r"must hold dtype, shape and data_offsets"),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            b"\0" * 2,
            r"body ended after \d+ of \d+ bytes",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            b"\0" * 9,
            r"continues past the \d+ bytes its safetensors header describes",
        ),
    ],
)
async def test_reader_refuses_malformed_headers_and_bodies(header, data, message):
    from r3lightning.serve.weights import UploadError

    with pytest.raises(UploadError, match=message):
        await _read(_upload(header, data), {"a": torch.zeros(1), "b": torch.zeros(1)})


@pytest.mark.slow
def test_cli_serves_until_sigint_and_exits_0():
    import os
    import signal

    command = [sys.executable, "-m", "r3lightning.serve.server", "--port", "0", "--device", "cpu"]
    command += ["--max-new-tokens-cap", "8"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.startswith("r3lightning rollout server listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            assert json.load(r)["status"] == "ok"
        request = urllib.request.Request(
            f"{url}/skyrl/v1/generate",
            data=json.dumps({"token_ids": [5, 6], "sampling_params": {"max_tokens": 9}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 400 and b"must be <= 8 (this server's cap)" in info.value.read()
        os.kill(child.pid, signal.SIGINT)
        assert child.wait(timeout=60) == 0
        assert "Traceback" not in child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


async def test_weights_load_off_the_loop_and_never_mid_generation():
    """An upload that waits for a running generation waits in a worker thread: /health answers
    meanwhile; the generation finishes on the old weights, the next one sees the new ones."""
    async with RolloutServer(build_tiny_moe(seed=0), dtype=torch.float32, max_new_tokens_cap=250) as srv:
        new = build_tiny_moe(seed=6).state_dict()
        long = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 250, "ignore_eos": True}}
        generation = asyncio.create_task(_post(f"{srv.url}/skyrl/v1/generate", json_body=long))
        await asyncio.sleep(0.2)  # the batch is running
        upload = asyncio.create_task(_post(f"{srv.url}/update_weights", _safetensors(new)))
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
        await _still_serving(srv)
