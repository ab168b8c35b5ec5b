"""Shared pieces of the embedded-server fault tests: raw and JSON requests on loopback, and the
checks that a server still serves and lost nothing."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import torch

from r3lightning.app.serve.server import RolloutServer

GOOD = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}


async def post(url: str, data=None, *, json_body=None, headers=None) -> tuple[int, dict, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, json=json_body, headers=headers) as r,
    ):
        return r.status, json.loads(await r.read()), dict(r.headers)


async def still_serving(srv: RolloutServer, headers: dict | None = None) -> None:
    """``/health`` answers and a good request generates."""
    async with aiohttp.ClientSession() as session, session.get(f"{srv.url}/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    status, payload, _ = await post(f"{srv.url}/generate", json_body=GOOD, headers=headers)
    assert status == 200 and len(payload["output_ids"]) == 3, payload


def weights_of(srv: RolloutServer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in srv.engine.model.state_dict().items()}


def same_weights(srv: RolloutServer, before: dict[str, torch.Tensor]) -> bool:
    after = srv.engine.model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


async def raw_request(
    srv: RolloutServer, head: bytes, body: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(srv.host, srv.port)
    writer.write(head + body)
    await writer.drain()
    return reader, writer


async def status_line(reader: asyncio.StreamReader, timeout: float = 10.0) -> tuple[int, bytes]:
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
