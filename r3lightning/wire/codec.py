"""Route wire codec: ndarray envelopes, SGLang's flat int32 routes and vLLM's ``.npy`` routes.

Three encodings of a route array ``[rows, num_layers, top_k]`` travel over HTTP:

- the ndarray envelope ``{"data": base64 of C-order little-endian bytes, "shape": [...],
  "dtype": "uint8" | "int16" | "uint16" | "int32"}`` (``encode_routes`` / ``decode_routes``); the
  encoder picks the smallest dtype that holds the largest expert id;
- SGLang's bare base64 string of flat int32 ids, reshaped with the model's ``(num_layers, top_k)``
  (``encode_flat_routes`` / ``decode_flat_routes``);
- vLLM's base64 string of a whole ``.npy`` file (``np.save(..., allow_pickle=False)`` of a uint8 or
  uint16 ``[rows, num_hidden_layers, top_k]`` array; ``decode_npy_routes``). Its header is parsed
  here as a literal (never unpickled) and checked before the payload is decoded.

Decoded uint16 routes come back as int16 (a view while every id is below 32768, else int32):
torch has few operations for uint16.

A generate response is mostly that one base64 string; :mod:`r3lightning.wire.json_body`
parses the body around it and hands the payload here already decoded or as a zero-copy view,
which is decoded straight into the numpy array's buffer. Decoding is one SIMD base64 pass plus
one validation pass (:mod:`r3lightning.wire.route_check`), or, where the parse decoded the
payload with the route check fused in (:mod:`r3lightning.wire.route_decode`), that one pass
alone; nothing is ever unpickled.

Every decoder validates before it allocates (dtype, shape, byte count, size cap) and raises
:class:`MalformedResponseError` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import ast
import binascii
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import pybase64

from r3lightning.routes import WIRE_DTYPES, compact_dtype
from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.json_body import PAYLOAD_KEYS, DecodedPayload, ParsedBody, parse_body, read_capped
from r3lightning.wire.route_check import check_range, check_shape, check_unique_rows, validate_routes
from r3lightning.wire.route_decode import decode_payload

__all__ = [
    "DEFAULT_MAX_BYTES",
    "PAYLOAD_KEYS",
    "WIRE_DTYPES",
    "DecodedPayload",
    "ParsedBody",
    "compact_dtype",
    "decode_array",
    "decode_flat_routes",
    "decode_npy_routes",
    "decode_routes",
    "encode_flat_routes",
    "encode_routes",
    "parse_body",
    "read_capped",
    "read_npy_header",
    "validate_routes",
]

# Default cap on the decoded size of one array; checked before anything is allocated.
DEFAULT_MAX_BYTES = 1 << 30


def _wire_name(dtype: np.dtype) -> str:
    return next(name for name, d in WIRE_DTYPES.items() if d == dtype)


def _as_id_array(array: Any, field: str) -> tuple[np.ndarray, int]:
    """The array as a non-negative integer ndarray and its largest id (0 when empty)."""
    a = np.asarray(array)  # a CPU torch tensor converts without a copy
    if a.dtype.kind not in "iu":
        raise ValueError(f"{field}: expected an integer array, got dtype {a.dtype}")
    if a.size == 0:
        return a, 0
    if a.dtype.kind == "i" and int(a.min()) < 0:
        raise ValueError(f"{field}: expert ids must be non-negative, got {int(a.min())}")
    return a, int(a.max())


def encode_routes(array: Any, *, dtype: str | None = None) -> dict[str, Any]:
    """Encode a non-negative integer array (routes ``[rows, L, K]``) as an ndarray envelope.

    ``dtype`` forces a wire dtype (``"uint8"``, ``"int16"``, ``"int32"``); by default the smallest
    one that holds the largest id is used. Cost: one min/max pass, one cast when the dtype
    changes, and one SIMD base64 encode. The envelope serialises with ``orjson.dumps``.
    """
    a, max_id = _as_id_array(array, "routes")
    if dtype is None:
        target = compact_dtype(max_id)
    elif dtype in WIRE_DTYPES:
        target = WIRE_DTYPES[dtype]
        if max_id > np.iinfo(target).max:
            raise ValueError(f"routes: id {max_id} does not fit in dtype {dtype!r}")
    else:
        raise ValueError(f"routes: unknown dtype {dtype!r}, expected one of {sorted(WIRE_DTYPES)}")
    data = np.ascontiguousarray(a, dtype=target)
    return {
        "data": pybase64.b64encode_as_string(data.reshape(-1).view(np.uint8)),
        "shape": list(a.shape),
        "dtype": _wire_name(target),
    }


def encode_flat_routes(array: Any) -> str:
    """Encode routes as SGLang does: base64 of the flat little-endian int32 ids."""
    a, _ = _as_id_array(array, "routes")
    data = np.ascontiguousarray(a, dtype=WIRE_DTYPES["int32"])
    return pybase64.b64encode_as_string(data.reshape(-1).view(np.uint8))


Base64Text = str | bytes | bytearray | memoryview
Payload = Base64Text | DecodedPayload


def _check_payload_type(data: Any, field: str) -> None:
    if not isinstance(data, Payload):
        raise MalformedResponseError(f"{field}: expected a base64 string, got {type(data).__name__}")


def _decoded_size(data: Payload, field: str) -> int:
    """Byte count the base64 ``data`` decodes to, from its length and padding alone."""
    if isinstance(data, DecodedPayload):
        return len(data.raw)
    n = len(data)
    if n % 4:
        raise MalformedResponseError(
            f"{field}: base64 length {n} is not a multiple of 4 (truncated or invalid base64)"
        )
    if n == 0:
        return 0
    tail = data[-2:]
    tail = tail.encode("utf-8", "replace") if isinstance(tail, str) else bytes(tail)
    return n // 4 * 3 - tail.count(b"=")


def _b64_to_buffer(data: Any, expected_bytes: int, field: str) -> bytearray | np.ndarray:
    _check_payload_type(data, field)
    size = _decoded_size(data, field)
    if size != expected_bytes:
        raise MalformedResponseError(
            f"{field}: base64 payload holds {size} bytes but the shape and dtype need {expected_bytes}"
        )
    if isinstance(data, DecodedPayload):
        return data.raw
    try:
        return decode_payload(data).raw
    except (binascii.Error, ValueError) as exc:
        raise MalformedResponseError(f"{field}: invalid base64 ({exc})") from None


def _check_size(nbytes: int, max_bytes: int, field: str) -> None:
    if nbytes > max_bytes:
        raise MalformedResponseError(
            f"{field}: payload of {nbytes} bytes exceeds the cap of {max_bytes} bytes (max_bytes)"
        )


def decode_array(
    envelope: Mapping[str, Any], *, max_bytes: int = DEFAULT_MAX_BYTES, field: str = "array"
) -> np.ndarray:
    """Decode an ndarray envelope into a writable, C-contiguous array.

    ``envelope["data"]`` may be a ``str``, ``bytes``, a ``memoryview`` or a
    :class:`DecodedPayload` (both from :meth:`ParsedBody.payload`). The declared size is checked
    against ``max_bytes`` and the payload length against the shape before any allocation (a
    payload the parse already decoded is checked the same way, after; its size was bounded by
    the body's). Cost: one SIMD base64 decode into the array's own buffer, no other copy.
    """
    if not isinstance(envelope, Mapping):
        raise MalformedResponseError(
            f"{field}: expected an ndarray envelope object, got {type(envelope).__name__}"
        )
    missing = [key for key in ("data", "shape", "dtype") if key not in envelope]
    if missing:
        raise MalformedResponseError(f"{field}: envelope is missing {missing}")
    name = envelope["dtype"]
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise MalformedResponseError(
            f"{field}.dtype: unknown dtype {name!r}, expected one of {sorted(WIRE_DTYPES)}"
        )
    dtype = WIRE_DTYPES[name]
    shape = envelope["shape"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise MalformedResponseError(f"{field}.shape: expected a list of non-negative ints, got {shape!r}")
    nbytes = math.prod(shape) * dtype.itemsize
    _check_size(nbytes, max_bytes, field)
    buffer = _b64_to_buffer(envelope["data"], nbytes, f"{field}.data")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def decode_routes(
    envelope: Mapping[str, Any],
    *,
    num_experts: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    check_unique: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    field: str = "routed_experts",
) -> np.ndarray:
    """Decode and validate a routes envelope into ``[rows, num_layers, top_k]`` in its wire dtype.

    See :func:`decode_array` for the decoding and :func:`validate_routes` for the checks.
    """
    routes = decode_array(envelope, max_bytes=max_bytes, field=field)
    return _validated(
        routes,
        envelope["data"],
        0,
        num_experts=num_experts,
        num_layers=num_layers,
        top_k=top_k,
        check_unique=check_unique,
        field=field,
    )


def _checked_by_decode(data: Payload, routes: np.ndarray, offset: int, num_experts: int | None) -> int | None:
    """The largest id of ``routes`` (the bytes of ``data`` from ``offset`` to its end) when the
    decode already ran a route check on exactly these rows at least as strict as the one asked
    for (:func:`~r3lightning.wire.route_decode.decode_payload`), else None."""
    if not isinstance(data, DecodedPayload) or data.checked is None or data.rows_from != offset:
        return None
    return data.largest if data.checked.covers(routes, num_experts) else None


def _validated(
    routes: np.ndarray,
    data: Payload,
    offset: int,
    *,
    num_experts: int | None,
    num_layers: int | None,
    top_k: int | None,
    check_unique: bool,
    field: str,
) -> np.ndarray:
    """``routes`` checked (:func:`validate_routes`, or only their shape where the decode already
    checked their ids), uint16 ids as int16 where they fit."""
    largest = _checked_by_decode(data, routes, offset, num_experts)
    if largest is None:
        validate_routes(
            routes,
            num_experts=num_experts,
            num_layers=num_layers,
            top_k=top_k,
            check_unique=check_unique,
            field=field,
        )
    else:
        check_shape(routes, num_layers, top_k, field)
    return _signed(routes, largest)


def _signed(routes: np.ndarray, largest: int | None = None) -> np.ndarray:
    """uint16 routes as int16 (a free view when every id is below 32768, else an int32 copy);
    ``largest``: their largest id, when known."""
    if routes.dtype != WIRE_DTYPES["uint16"]:
        return routes
    if routes.size == 0 or (largest if largest is not None else int(routes.max())) < 32768:
        return routes.view(WIRE_DTYPES["int16"])
    return routes.astype(WIRE_DTYPES["int32"])


def decode_flat_routes(
    data: Payload,
    *,
    num_layers: int,
    top_k: int,
    num_experts: int | None = None,
    check_unique: bool = True,
    compact: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    field: str = "meta_info.routed_experts",
) -> np.ndarray:
    """Decode SGLang's base64 flat int32 routes into ``[rows, num_layers, top_k]``.

    With ``compact`` the result is cast to the smallest dtype that holds its largest id (one
    extra pass, 4x less host memory downstream). Validated like :func:`decode_routes`.
    """
    for name, value in (("num_layers", num_layers), ("top_k", top_k)):
        # the caller's schema, not the response: a plain ValueError
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    _check_payload_type(data, field)
    nbytes = _decoded_size(data, field)
    _check_size(nbytes, max_bytes, field)
    row_bytes = num_layers * top_k * 4
    if nbytes % row_bytes:
        raise MalformedResponseError(
            f"{field}: {nbytes} bytes is not a whole number of int32 rows of "
            f"num_layers={num_layers} x top_k={top_k}"
        )
    buffer = _b64_to_buffer(data, nbytes, field)
    routes = np.frombuffer(buffer, dtype=WIRE_DTYPES["int32"]).reshape(-1, num_layers, top_k)
    checked = _checked_by_decode(data, routes, 0, num_experts)
    # int32 is signed: the range pass always yields the largest id, reused for the compact dtype
    high = checked if checked is not None else check_range(routes, num_experts, field) if routes.size else 0
    if compact:
        routes = routes.astype(compact_dtype(high or 0), copy=False)
    if check_unique and checked is None:  # on the compact copy: up to 4x less memory traffic
        check_unique_rows(routes, field)
    return routes


_NPY_MAGIC = b"\x93NUMPY"
# numpy's own default cap on a header (np.load's max_header_size)
_NPY_MAX_HEADER = 10_000


def _b64_prefix(data: Payload, nbytes: int, field: str) -> bytes:
    """The first ``nbytes`` decoded bytes of base64 ``data`` (decodes only what it needs)."""
    if isinstance(data, DecodedPayload):
        if nbytes > len(data.raw):
            raise MalformedResponseError(f"{field}: payload too short for a .npy header")
        return bytes(data.raw[:nbytes])
    chars = -(-nbytes // 3) * 4
    if chars > len(data):
        raise MalformedResponseError(f"{field}: payload too short for a .npy header")
    try:
        return pybase64.b64decode(data[:chars], validate=True)[:nbytes]
    except (binascii.Error, ValueError) as exc:
        raise MalformedResponseError(f"{field}: invalid base64 ({exc})") from None


def read_npy_header(data: Payload, field: str) -> tuple[int, np.dtype, list[int]]:
    """``(data offset, dtype, shape)`` from the header of a base64 ``.npy`` file.

    The header is a Python dict literal (format versions 1-3); it is read with
    ``ast.literal_eval`` after a length cap, so nothing is executed or unpickled.
    """
    lead = _b64_prefix(data, 12, field)
    if lead[:6] != _NPY_MAGIC:
        raise MalformedResponseError(f"{field}: not a .npy file (magic {lead[:6]!r})")
    major = lead[6]
    if major not in (1, 2, 3):
        raise MalformedResponseError(f"{field}: unsupported .npy format version {major}.{lead[7]}")
    size_bytes = 2 if major == 1 else 4
    header_len = int.from_bytes(lead[8 : 8 + size_bytes], "little")
    if header_len > _NPY_MAX_HEADER:
        raise MalformedResponseError(f"{field}: .npy header of {header_len} bytes exceeds {_NPY_MAX_HEADER}")
    offset = 8 + size_bytes + header_len
    text = _b64_prefix(data, offset, field)[8 + size_bytes :]
    header = _header_dict(text, major, field)
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise MalformedResponseError(
            f"{field}: .npy header must hold exactly 'descr', 'fortran_order' and 'shape', got {header!r}"
        )
    descr, shape = header["descr"], header["shape"]
    dtype = next((d for d in WIRE_DTYPES.values() if isinstance(descr, str) and _same_dtype(descr, d)), None)
    if dtype is None:
        raise MalformedResponseError(
            f"{field}: .npy dtype {descr!r} is not a route dtype, expected one of {sorted(WIRE_DTYPES)} "
            "(little-endian)"
        )
    if header["fortran_order"] is not False:
        raise MalformedResponseError(f"{field}: .npy array must be C-ordered (fortran_order=False)")
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise MalformedResponseError(
            f"{field}: .npy shape must be a tuple of non-negative ints, got {shape!r}"
        )
    return offset, dtype, list(shape)


# The header np.save writes (numpy's format.write_array_header): its keys in this order and
# spacing, the shape a tuple of ints. Read without a parser; anything else takes the slow path.
_NPY_HEADER = re.compile(
    rb"\{'descr': '([<>|=][a-z][0-9]+)', 'fortran_order': (False|True), 'shape': \(([0-9]+(?:, [0-9]+)*,?)?\), \} *\n?\Z"
)


def _header_dict(text: bytes, major: int, field: str) -> dict[str, Any]:
    """The header dict of a ``.npy`` file (a Python literal, never executed: ``ast.literal_eval``
    reads anything but np.save's own layout, which a regex reads ten times faster)."""
    if (match := _NPY_HEADER.match(text)) is not None:
        descr, order, dims = match.groups()
        shape = tuple(int(d) for d in dims.split(b",") if d.strip()) if dims else ()
        return {"descr": descr.decode(), "fortran_order": order == b"True", "shape": shape}
    try:
        return ast.literal_eval(text.decode("latin1" if major < 3 else "utf-8"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        raise MalformedResponseError(f"{field}: unreadable .npy header {text[:200]!r}") from None


def _same_dtype(descr: str, dtype: np.dtype) -> bool:
    try:
        return np.dtype(descr) == dtype
    except TypeError:
        return False


def decode_npy_routes(
    data: Payload,
    *,
    num_experts: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    check_unique: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    field: str = "choices[0].routed_experts",
) -> np.ndarray:
    """Decode vLLM's base64 ``.npy`` routes into ``[rows, num_layers, top_k]``.

    The header (dtype, order, shape) is read from the first few hundred base64 characters and
    the payload length checked against it and ``max_bytes`` before the whole payload is decoded
    (one SIMD base64 pass into one buffer; the array is a view past the header). Validated like
    :func:`decode_routes`; uint16 ids come back as int16.
    """
    _check_payload_type(data, field)
    offset, dtype, shape = read_npy_header(data, field)
    count = math.prod(shape)
    _check_size(count * dtype.itemsize, max_bytes, field)
    buffer = _b64_to_buffer(data, offset + count * dtype.itemsize, field)
    routes = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
    return _validated(
        routes,
        data,
        offset,
        num_experts=num_experts,
        num_layers=num_layers,
        top_k=top_k,
        check_unique=check_unique,
        field=field,
    )
