"""The streaming safetensors reader of weight uploads: byte-sized chunks, unaligned tensors, the
caller's check before any data is read, and every malformed header or body refused by name."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from r3lightning.wire.safetensors import UploadError, read_safetensors


def _upload(header: dict, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


async def _read(body: bytes, check=None, *, chunk: int = 1, content_length: int | None = None, sent=None):
    async def chunks():
        for i in range(0, len(body), chunk):
            if sent is not None:
                sent.append(i + chunk)
            yield body[i : i + chunk]

    return await read_safetensors(
        chunks(),
        content_length=content_length,
        max_bytes=1 << 20,
        check=check or (lambda specs: None),
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
    specs = []
    got = await _read(body, specs.append, content_length=len(body))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    assert specs == [{"a": (torch.float16, (3,)), "b": (torch.float32, (2,))}]


async def test_the_check_refuses_before_any_tensor_data_is_read():
    header = {"w": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}
    body = _upload(header, b"\0" * 4096)
    header_end = len(body) - 4096

    def refuse(specs):
        raise UploadError(f"no {sorted(specs)}")

    sent: list[int] = []
    with pytest.raises(UploadError, match=r"^no \['w'\]$"):
        await _read(body, refuse, chunk=64, sent=sent)
    assert sent[-1] < header_end + 64  # the chunk holding the end of the header, no more


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
    with pytest.raises(UploadError, match=message):
        await _read(_upload(header, data))
