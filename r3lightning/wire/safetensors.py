"""Safetensors bodies read from a stream (the embedded server's ``POST /update_weights``), checked
from their header before any tensor data is read, then streamed into one flat host buffer."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable, Mapping

import torch
from torch import Tensor

__all__ = ["SAFETENSORS_DTYPES", "UploadError", "read_safetensors"]

_DTYPE_NAMES = "F64:float64 F32:float32 F16:float16 BF16:bfloat16 F8_E4M3:float8_e4m3fn F8_E5M2:float8_e5m2 "
_DTYPE_NAMES += "I64:int64 I32:int32 I16:int16 I8:int8 U64:uint64 U32:uint32 U16:uint16 U8:uint8 BOOL:bool"
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, dtype) for name, dtype in (pair.split(":") for pair in _DTYPE_NAMES.split())
}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own reader refuses larger headers
_NOT_SAFETENSORS = "request body is not a safetensors file"


class UploadError(ValueError):
    """A weight upload is refused.

    Args:
        message: Why, naming the field.
        status: The HTTP status to answer: 400, or 413 for a body over the cap.

    Attributes:
        status: As given.
    """

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _parse_header(header: bytes) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
    """``(name, dtype, shape, begin, end)`` per tensor, sorted by offset, tiling the data exactly."""
    try:
        meta = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # deep nesting too
        raise UploadError(f"{_NOT_SAFETENSORS}: header is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise UploadError(f"{_NOT_SAFETENSORS}: header is not a JSON object")
    entries = []
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        where = f"safetensors header[{name!r}]"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise UploadError(f"{where} must hold dtype, shape and data_offsets")
        dtype = SAFETENSORS_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise UploadError(f"{where}: unknown dtype {info['dtype']!r}")
        shape = info["shape"]
        offsets = info["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise UploadError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
        pair = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        if not pair or not 0 <= offsets[0] <= offsets[1]:
            raise UploadError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end")
        size = math.prod(shape) * dtype.itemsize
        if offsets[1] - offsets[0] != size:
            raise UploadError(
                f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes, shape {shape} of "
                f"{info['dtype']} needs {size}"
            )
        entries.append((name, dtype, tuple(shape), offsets[0], offsets[1]))
    entries.sort(key=lambda e: e[3])
    position = 0
    for name, _, _, begin, end in entries:
        if begin != position:
            raise UploadError(
                f"safetensors header[{name!r}]: data starts at byte {begin}, expected {position} "
                "(tensors must tile the data without gaps or overlaps)"
            )
        position = end
    return entries


class _Stream:
    """Exact-size reads over an async iterator of byte chunks."""

    def __init__(self, chunks: AsyncIterator[bytes]):
        self._chunks = chunks
        self._left = memoryview(b"")

    async def read_into(self, out: memoryview) -> int:
        """Fill ``out``; how many bytes came before the stream ended."""
        filled = 0
        while filled < len(out):
            if not self._left:
                self._left = memoryview(await anext(self._chunks, b""))
                if not self._left:
                    break
            n = min(len(self._left), len(out) - filled)
            out[filled : filled + n] = self._left[:n]
            self._left = self._left[n:]
            filled += n
        return filled


async def read_safetensors(
    chunks: AsyncIterator[bytes],
    *,
    content_length: int | None,
    max_bytes: int,
    check: Callable[[Mapping[str, tuple[torch.dtype, tuple[int, ...]]]], None],
) -> dict[str, Tensor]:
    """A safetensors body streamed into host tensors that view one flat buffer.

    Everything is checked from the header before any tensor data is read: no allocation beyond
    ``max_bytes``.

    Args:
        chunks: The body's chunks as they arrive.
        content_length: The declared length, or None.
        max_bytes: The largest body accepted.
        check: Called with ``name -> (dtype, shape)`` before the data is read; raises to refuse.

    Returns:
        ``name -> tensor`` on the CPU (unaligned tensors copied, the others views).

    Raises:
        UploadError: A malformed header, a size other than ``content_length``, a body over
            ``max_bytes`` (status 413), or a body that ends early or runs on.
    """
    stream = _Stream(chunks)
    prefix = bytearray(8)
    if await stream.read_into(memoryview(prefix)) < 8:
        raise UploadError(f"{_NOT_SAFETENSORS}: shorter than its 8-byte header length")
    header_len = int.from_bytes(prefix, "little")
    limit = min(MAX_HEADER_BYTES, max_bytes)
    if header_len > limit:
        raise UploadError(f"{_NOT_SAFETENSORS}: header length {header_len} exceeds {limit} bytes")
    if content_length is not None and 8 + header_len > content_length:
        raise UploadError(
            f"{_NOT_SAFETENSORS}: its {header_len}-byte header exceeds the {content_length}-byte body"
        )
    header = bytearray(header_len)
    if await stream.read_into(memoryview(header)) < header_len:
        raise UploadError(f"{_NOT_SAFETENSORS}: the body ends inside its header")
    entries = _parse_header(bytes(header))
    data_bytes = entries[-1][4] if entries else 0
    total = 8 + header_len + data_bytes
    if total > max_bytes:
        raise UploadError(f"safetensors body of {total} bytes exceeds the cap of {max_bytes} bytes", 413)
    if content_length is not None and content_length != total:
        raise UploadError(
            f"safetensors header describes a body of {total} bytes, but Content-Length is {content_length}"
        )
    check({name: (dtype, shape) for name, dtype, shape, _, _ in entries})
    flat = torch.empty(data_bytes, dtype=torch.uint8)  # [data_bytes]
    got = await stream.read_into(memoryview(flat.numpy()))
    if got < data_bytes:
        raise UploadError(f"request body ended after {8 + header_len + got} of {total} bytes")
    if await stream.read_into(memoryview(bytearray(1))):
        raise UploadError(f"request body continues past the {total} bytes its safetensors header describes")
    tensors = {}
    for name, dtype, shape, begin, end in entries:
        raw = flat[begin:end] if begin % dtype.itemsize == 0 else flat[begin:end].clone()  # aligned views
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors
