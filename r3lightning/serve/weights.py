"""Weight updates for a serving model: what may be loaded, and safetensors uploads read safely.

One rule set, used by the in-process path (:meth:`GenerationEngine.update_weights`) and by the
server's ``POST /update_weights``:

- names: the model's parameters and persistent buffers (its ``state_dict`` keys); a
  non-persistent buffer such as ``rotary_emb.inv_freq`` is derived state, never loaded;
- shapes equal the model's;
- a floating tensor is loaded only from a floating source of 16 bits or more (fp8 and integer
  or bool sources would be cast silently); a non-floating buffer only from its own dtype;
- values are finite (a NaN weight makes every later generation sample token 0);
- ``strict`` also requires every name.

:func:`read_safetensors_upload` checks a safetensors body from its header (names, dtypes,
shapes, offsets, total size) before reading any tensor data, then streams the data into one
flat host buffer that the tensors view: one copy of the upload in memory, none for garbage.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SAFETENSORS_DTYPES", "UploadError", "check_finite", "check_weights", "read_safetensors_upload"]

# floating sources a floating parameter may be loaded from (casting them is exact or rounding)
_LOADABLE_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# safetensors' own reader refuses larger headers
MAX_HEADER_BYTES = 100 << 20


class UploadError(ValueError):
    """A weight upload is refused; ``status`` is the HTTP status to answer (400 or 413)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def loadable_targets(model: torch.nn.Module) -> dict[str, Tensor]:
    """Name -> the model's tensor for every parameter and persistent buffer (tied ones twice)."""
    return model.state_dict(keep_vars=True)


def check_weights(
    targets: Mapping[str, Tensor],
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    *,
    strict: bool,
    where: str = "state_dict",
) -> None:
    """Refuse (``ValueError`` naming the tensor) ``specs`` (name -> dtype, shape) for ``targets``.

    The metadata half of the rules above; :func:`check_finite` is the values half. Cost: one dict
    pass, no tensor data touched.
    """
    unknown = sorted(set(specs) - set(targets))
    if unknown:
        raise ValueError(
            f"{where} has {len(unknown)} names that are not parameters or persistent buffers of the "
            f"model, e.g. {unknown[:3]}"
        )
    if strict:
        missing = sorted(set(targets) - set(specs))
        if missing:
            raise ValueError(f"{where} lacks {len(missing)} model names, e.g. {missing[:3]}")
    for name, (dtype, shape) in specs.items():
        target = targets[name]
        if tuple(shape) != tuple(target.shape):
            raise ValueError(
                f"{where}[{name!r}] has shape {tuple(shape)}, the model expects {tuple(target.shape)}"
            )
        if target.is_floating_point():
            if dtype not in _LOADABLE_FLOATS:
                raise ValueError(
                    f"{where}[{name!r}] has dtype {dtype}; the model's floating tensor takes only "
                    f"float16, bfloat16, float32 or float64"
                )
        elif dtype != target.dtype:
            raise ValueError(f"{where}[{name!r}] has dtype {dtype}, the model's buffer is {target.dtype}")


def check_finite(
    state_dict: Mapping[str, Tensor], targets: Mapping[str, Tensor], *, where: str = "state_dict"
) -> None:
    """``ValueError`` naming the first floating tensor that is not finite once cast to its
    target's dtype: NaN, inf, or a finite value beyond that dtype's range (float64 ``1e300`` into
    float32, float32 ``3.4e38`` into bfloat16 or float16 would install ``inf``).

    One cast and one finiteness pass per floating tensor (one tensor at a time: no second copy
    of the weights) and one device->host sync per device.
    """
    by_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    for name, value in state_dict.items():
        if value.is_floating_point():
            by_device.setdefault(value.device, []).append((name, value))
    for items in by_device.values():
        flags = torch.stack([torch.isfinite(v.to(targets[n].dtype)).all() for n, v in items]).cpu()
        if not bool(flags.all()):
            name, value = items[int((~flags).nonzero()[0, 0])]
            dtype = targets[name].dtype
            bad = int((~torch.isfinite(value.to(dtype))).sum())
            raise ValueError(
                f"{where}[{name!r}] holds {bad} values that are not finite in the serving dtype "
                f"{dtype} (NaN, inf, or beyond its range)"
            )


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _parse_header(header: bytes) -> list[_Entry]:
    """The tensor entries of a safetensors header, sorted by offset, tiling the data exactly."""
    try:
        meta = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UploadError(f"request body is not a safetensors file: header is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise UploadError("request body is not a safetensors file: header is not a JSON object")
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
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise UploadError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise UploadError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * dtype.itemsize:
            raise UploadError(
                f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes, shape {shape} of "
                f"{info['dtype']} needs {numel * dtype.itemsize}"
            )
        entries.append(_Entry(name, dtype, tuple(shape), offsets[0], offsets[1]))
    entries.sort(key=lambda e: e.begin)
    position = 0
    for entry in entries:
        if entry.begin != position:
            raise UploadError(
                f"safetensors header[{entry.name!r}]: data starts at byte {entry.begin}, expected "
                f"{position} (tensors must tile the data without gaps or overlaps)"
            )
        position = entry.end
    return entries


class _Stream:
    """Exact-size reads over an async iterator of byte chunks."""

    def __init__(self, chunks: AsyncIterator[bytes]):
        self._chunks = chunks
        self._left = memoryview(b"")
        self.read = 0

    async def _next(self) -> memoryview:
        if not self._left:
            chunk = await anext(self._chunks, b"")
            self._left = memoryview(chunk)
        return self._left

    async def read_into(self, out: memoryview) -> int:
        """Fill ``out``; returns how many bytes came before the stream ended."""
        filled = 0
        while filled < len(out):
            chunk = await self._next()
            if not chunk:
                break
            n = min(len(chunk), len(out) - filled)
            out[filled : filled + n] = chunk[:n]
            self._left = chunk[n:]
            filled += n
        self.read += filled
        return filled

    async def at_end(self) -> bool:
        return not await self._next()


async def read_safetensors_upload(
    chunks: AsyncIterator[bytes],
    *,
    content_length: int | None,
    max_bytes: int,
    targets: Mapping[str, Tensor],
    strict: bool,
    too_large: Callable[[int], UploadError],
) -> dict[str, Tensor]:
    """Read a safetensors body into host tensors, refusing it from its header when it cannot load.

    The header (8-byte length + JSON) is read and checked with :func:`check_weights` against
    ``targets`` before any tensor data is read; the body size it implies must match
    ``content_length`` (when given) and stay within ``max_bytes`` (``too_large(size)`` otherwise).
    The data is then streamed into one flat buffer; the returned tensors are views of it (a copy
    only for a tensor whose offset is not a multiple of its element size). Values are not checked
    here (see :func:`check_finite`). Raises :class:`UploadError`.
    """
    stream = _Stream(chunks)
    prefix = bytearray(8)
    if await stream.read_into(memoryview(prefix)) < 8:
        raise UploadError("request body is not a safetensors file: shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > min(MAX_HEADER_BYTES, max_bytes):
        raise UploadError(
            f"request body is not a safetensors file: header length {header_len} exceeds "
            f"{min(MAX_HEADER_BYTES, max_bytes)} bytes"
        )
    if content_length is not None and 8 + header_len > content_length:
        raise UploadError(
            f"request body is not a safetensors file: header of {header_len} bytes does not fit in "
            f"the body of {content_length} bytes"
        )
    header = bytearray(header_len)
    if await stream.read_into(memoryview(header)) < header_len:
        raise UploadError("request body is not a safetensors file: the body ends inside its header")
    entries = _parse_header(bytes(header))
    data_bytes = entries[-1].end if entries else 0
    total = 8 + header_len + data_bytes
    if total > max_bytes:
        raise too_large(total)
    if content_length is not None and content_length != total:
        raise UploadError(
            f"safetensors header describes a body of {total} bytes, but Content-Length is {content_length}"
        )
    check_weights(targets, {e.name: (e.dtype, e.shape) for e in entries}, strict=strict, where="upload")

    flat = torch.empty(data_bytes, dtype=torch.uint8)  # [data_bytes]
    got = await stream.read_into(memoryview(flat.numpy()))
    if got < data_bytes:
        raise UploadError(f"request body ended after {8 + header_len + got} of {total} bytes")
    if not await stream.at_end():
        raise UploadError(f"request body continues past the {total} bytes its safetensors header describes")
    tensors = {}
    for entry in entries:
        raw = flat[entry.begin : entry.end]
        if entry.begin % entry.dtype.itemsize:
            raw = raw.clone()  # views need the element size to divide the offset
        tensors[entry.name] = raw.view(entry.dtype).reshape(entry.shape)
    return tensors
