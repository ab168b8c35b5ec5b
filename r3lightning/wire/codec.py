"""Route wire codec: ndarray envelopes ``{"data": base64 of C-order little-endian bytes, "shape",
"dtype": "uint8" | "int16" | "uint16" | "int32"}``, SGLang's base64 flat int32 ids and vLLM's base64
``.npy`` file (its header read as a literal). Each decoder checks the declared size against
``max_bytes`` before it allocates, decodes with pybase64 into one buffer that numpy views, and runs
the route check; uint16 ids come back as int16 (int32 from 32768 on)."""

from __future__ import annotations

import binascii
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64

from r3lightning.routes import WIRE_DTYPES, check_layers, compact_dtype, mark_missing, missing_rows
from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.route_check import check_routes

__all__ = [
    "DEFAULT_MAX_BYTES",
    "RouteSchema",
    "checked_routes",
    "decode_array",
    "decode_flat_routes",
    "decode_npy_routes",
    "decode_routes",
    "encode_flat_routes",
    "encode_routes",
]

MISSING_ROWS = ("error", "native", "drop_trajectory")  # RouteSchema.missing_rows
DEFAULT_MAX_BYTES = 1 << 30  # cap on one decoded array, checked before anything is allocated
Base64Text = str | bytes | bytearray | memoryview


@dataclass(frozen=True)
class RouteSchema:
    """What decoded routes must look like: ``[rows, num_layers, top_k]`` expert ids.

    Args:
        num_layers: Decoder layers, dense ones included (None: unchecked; SGLang's flat routes
            need it).
        top_k: Experts per token and layer (None: unchecked; SGLang's flat routes need it).
        num_experts: Ids must be below it (None: unchecked).
        check_unique: Check that a row's experts are distinct while parsing (several times the
            decode's cost).
        max_bytes: The largest route array accepted.
        layers: The decoder layers this rank holds (None: all): the only columns the parse keeps.
        missing_rows: What a response with missing route rows (a -1 id in a row, or no routes
            where the engine says it lost them, as vLLM's ``null``) becomes: ``error`` refuses it,
            ``native`` keeps the trajectory with those rows marked -1 (the trainer routes them
            natively and counts them), ``drop_trajectory`` marks them too and the collector drops
            the trajectory from the loss.

    Raises:
        ValueError: A field of the wrong type or out of range.
    """

    num_layers: int | None = None
    top_k: int | None = None
    num_experts: int | None = None
    check_unique: bool = False
    max_bytes: int = DEFAULT_MAX_BYTES
    layers: tuple[int, ...] | None = None
    missing_rows: str = "error"

    def __post_init__(self) -> None:
        if self.missing_rows not in MISSING_ROWS:
            raise ValueError(f"missing_rows must be one of {list(MISSING_ROWS)}, got {self.missing_rows!r}")
        for name in ("num_layers", "top_k", "num_experts"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        layers = check_layers("layers", self.layers)
        object.__setattr__(self, "layers", layers)
        if layers is not None and (self.num_layers is None or layers[-1] >= self.num_layers):
            raise ValueError(f"layers {layers} must be ids below num_layers={self.num_layers}")


def encode_routes(array: Any, *, dtype: str | None = None) -> dict[str, Any]:
    """Routes as a JSON-ready ndarray envelope ``{"data", "shape", "dtype"}``.

    Args:
        array: Non-negative integer expert ids, any shape (an ndarray, a CPU tensor or nested lists).
        dtype: The wire dtype name (``uint8``, ``int16``, ``uint16``, ``int32``); default: the
            smallest that holds the largest id.

    Returns:
        The envelope (``data``: base64 of the C-order little-endian bytes). Cost: a min/max, a cast,
        a base64 encode.

    Raises:
        ValueError: Non-integer or negative ids, an unknown ``dtype``, or an id ``dtype`` cannot hold.
    """
    a = np.asarray(array)  # a CPU torch tensor converts without a copy
    if a.dtype.kind not in "iu":
        raise ValueError(f"routes: expected an integer array, got dtype {a.dtype}")
    if a.size and a.dtype.kind == "i" and int(a.min()) < 0:
        raise ValueError(f"routes: expert ids must be non-negative, got {int(a.min())}")
    if dtype is not None and dtype not in WIRE_DTYPES:
        raise ValueError(f"routes: unknown dtype {dtype!r}, expected one of {sorted(WIRE_DTYPES)}")
    max_id = int(a.max()) if a.size else 0
    name = dtype or next(n for n, d in WIRE_DTYPES.items() if d == compact_dtype(max_id))
    if max_id > np.iinfo(WIRE_DTYPES[name]).max:
        raise ValueError(f"routes: id {max_id} does not fit in dtype {dtype!r}")
    data = np.ascontiguousarray(a, dtype=WIRE_DTYPES[name]).reshape(-1).view(np.uint8)
    return {"data": pybase64.b64encode_as_string(data), "shape": list(a.shape), "dtype": name}


def encode_flat_routes(array: Any) -> str:
    """Routes encoded as SGLang sends them: base64 of the flat little-endian int32 ids (no shape: the
    reader needs ``num_layers`` and ``top_k``).

    Args:
        array: Non-negative integer expert ids, any shape.

    Raises:
        ValueError: As `encode_routes`.
    """
    return encode_routes(array, dtype="int32")["data"]


def _bad(field: str, message: str) -> MalformedResponseError:
    return MalformedResponseError(f"{field}: {message}")


def _check_size(shape: list[int], itemsize: int, max_bytes: int, field: str) -> int:
    """Bytes of an array of ``shape``, refused above ``max_bytes`` before anything is allocated."""
    nbytes = math.prod(shape) * itemsize
    if nbytes > max_bytes:
        raise _bad(field, f"payload of {nbytes} bytes exceeds the cap of {max_bytes} bytes")
    if any(d > max_bytes for d in shape):  # beside a 0: numpy refuses huge dimensions anyway
        raise _bad(field, f"shape {shape} has a dimension above max_bytes={max_bytes}")
    return nbytes


def _b64decode(data: Any, field: str, expected: int | None, max_bytes: int) -> bytearray:
    """Strict base64 decode of ``data`` once its size (from length and padding) is checked."""
    if not isinstance(data, Base64Text):
        raise _bad(field, f"expected a base64 string, got {type(data).__name__}")
    n = len(data)
    if n % 4:
        raise _bad(field, f"base64 length {n} is not a multiple of 4 (truncated?)")
    tail = data[-2:].encode("utf-8", "replace") if isinstance(data, str) else bytes(data[-2:])
    size = n // 4 * 3 - tail.count(b"=")
    if expected is not None and size != expected:
        raise _bad(field, f"base64 payload holds {size} bytes but the shape and dtype need {expected}")
    if size > max_bytes:
        raise _bad(field, f"payload of {size} bytes exceeds the cap of {max_bytes} bytes")
    try:
        return pybase64.b64decode_as_bytearray(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad(field, f"invalid base64 ({exc})") from None


def decode_array(
    envelope: Mapping[str, Any], *, max_bytes: int = DEFAULT_MAX_BYTES, field: str = "array"
) -> np.ndarray:
    """An ndarray envelope as an array, without the route check.

    Args:
        envelope: ``{"data": base64 text, "shape": [...], "dtype": name}``.
        max_bytes: The largest array accepted, checked from the shape before anything is allocated.
        field: The envelope's path in the response, first in the error message.

    Returns:
        A writable array viewing the one buffer the base64 decode fills (the only cost).

    Raises:
        MalformedResponseError: A missing key, an unknown dtype, a bad shape, a payload whose size
            does not match the shape or exceeds ``max_bytes``, or invalid base64.
    """
    if not isinstance(envelope, Mapping):
        raise _bad(field, f"expected an ndarray envelope object, got {type(envelope).__name__}")
    missing = [key for key in ("data", "shape", "dtype") if key not in envelope]
    if missing:
        raise _bad(field, f"envelope is missing {missing}")
    name = envelope["dtype"]
    shape = envelope["shape"]
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise _bad(f"{field}.dtype", f"unknown dtype {name!r}, expected one of {sorted(WIRE_DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(f"{field}.shape", f"expected a list of non-negative ints, got {shape!r}")
    nbytes = _check_size(shape, WIRE_DTYPES[name].itemsize, max_bytes, field)
    raw = _b64decode(envelope["data"], f"{field}.data", nbytes, max_bytes)
    return np.frombuffer(raw, WIRE_DTYPES[name]).reshape(shape)


def decode_flat_array(
    data: Any, num_layers: int | None, top_k: int | None, *, max_bytes: int, field: str
) -> np.ndarray:
    """SGLang's base64 flat int32 ids as routes, without the route check.

    Args:
        data: The base64 text (``str``, bytes or a ``memoryview`` of the body).
        num_layers, top_k: The model's route row shape.
        max_bytes: The largest payload accepted, checked before the decode.
        field: The payload's path in the response, for errors.

    Returns:
        int32 ``[rows, num_layers, top_k]``.

    Raises:
        ValueError: ``num_layers`` or ``top_k`` is None (the caller's schema, not the response).
        MalformedResponseError: Bad base64, a payload above ``max_bytes``, or not whole rows.
    """
    if num_layers is None or top_k is None:  # the caller's schema, not the response
        raise ValueError("SGLang's flat routes need num_layers and top_k to be reshaped")
    raw = _b64decode(data, field, None, max_bytes)
    if len(raw) % (num_layers * top_k * 4):
        rows = f"int32 rows of num_layers={num_layers} x top_k={top_k}"
        raise _bad(field, f"{len(raw)} bytes is not a whole number of {rows}")
    return np.frombuffer(raw, "<i4").reshape(-1, num_layers, top_k)


_NPY_MAX_HEADER = 10_000  # numpy's own default cap (np.load's max_header_size)
_NPY_LEAD = ((12 + _NPY_MAX_HEADER) * 4 // 3 + 4) // 4 * 4  # base64 characters a header can span


def _npy_header(data: Any, field: str) -> tuple[int, np.dtype, list[int]]:
    """``(data offset, dtype, shape)`` of a base64 ``.npy`` file (versions 1-3), from its header."""
    try:  # whole groups of 4 characters
        lead = pybase64.b64decode(data[: min(len(data) // 4 * 4, _NPY_LEAD)], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad(field, f"invalid base64 ({exc})") from None
    header = io.BytesIO(lead)
    try:
        major, minor = np.lib.format.read_magic(header)
    except ValueError as exc:
        raise _bad(field, f"not a .npy file ({exc})") from None
    if major not in (1, 2, 3):
        raise _bad(field, f"unsupported .npy format version {major}.{minor}")
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    try:
        shape, fortran_order, dtype = read(header, max_header_size=_NPY_MAX_HEADER)
    except (ValueError, MemoryError, RecursionError) as exc:
        raise _bad(field, f"unreadable .npy header ({exc})") from None
    if dtype not in WIRE_DTYPES.values():
        expected = f"one of {sorted(WIRE_DTYPES)} (little-endian)"
        raise _bad(field, f".npy dtype {dtype.str!r} is not a route dtype, expected {expected}")
    if fortran_order:
        raise _bad(field, ".npy array must be C-ordered (fortran_order=False)")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(field, f".npy shape must be a tuple of non-negative ints, got {shape!r}")
    return header.tell(), dtype, list(shape)


def decode_npy_array(data: Any, *, max_bytes: int = DEFAULT_MAX_BYTES, field: str) -> np.ndarray:
    """vLLM's base64 ``.npy`` routes as an array, without the route check: the header (versions 1-3)
    is read as a literal, never unpickled, and its size checked before the payload is decoded.

    Args:
        data: The base64 text of the ``.npy`` file.
        max_bytes: The largest array accepted.
        field: The payload's path in the response, for errors.

    Returns:
        The array in its wire dtype, viewing the decoded buffer.

    Raises:
        MalformedResponseError: Not base64 or not ``.npy``, an unsupported version, a non-route
            dtype, Fortran order, or a size above ``max_bytes``.
    """
    if not isinstance(data, Base64Text):
        raise _bad(field, f"expected a base64 string, got {type(data).__name__}")
    offset, dtype, shape = _npy_header(data, field)
    nbytes = _check_size(shape, dtype.itemsize, max_bytes, field)
    raw = _b64decode(data, field, offset + nbytes, max_bytes + offset)
    return np.frombuffer(raw, dtype, count=math.prod(shape), offset=offset).reshape(shape)


def checked_routes(
    routes: np.ndarray,
    schema: RouteSchema,
    *,
    rows: range | None = None,
    rows_rule: str = "",
    compact: bool = False,
    field: str = "routed_experts",
) -> np.ndarray:
    """Decoded routes after the route check, cut to ``schema.layers`` (a copy: the payload is freed).

    Args:
        routes: ``[rows, L, K]`` integer ids from one of the decoders.
        schema: The sizes, layers and missing-row policy to apply.
        rows: The allowed row counts (None: any).
        rows_rule: How ``rows`` was derived, shown in the error.
        compact: Return the smallest dtype holding the largest id.
        field: The payload's path in the response, for errors.

    Returns:
        ``[rows, len(layers) or L, K]`` in the host dtype (uint16 as int16, or int32 from 32768 on),
        or compact. Unless ``schema.missing_rows`` is ``error``, a row holding -1 is a missing row:
        all its ids become -1, in a signed dtype.

    Raises:
        MalformedResponseError: The route check's refusal (shape, dtype, range, rows, repeats).
    """
    bounds = {"num_experts": schema.num_experts, "num_layers": schema.num_layers, "top_k": schema.top_k}
    check = {"rows": rows, "rows_rule": rows_rule, "where": field, "error": MalformedResponseError}
    allowed = schema.missing_rows != "error"
    high = check_routes(routes, distinct=schema.check_unique, missing=allowed, **bounds, **check)
    absent = missing_rows(routes) if allowed else None
    if schema.layers is not None:  # a copy of the kept columns: the whole payload is freed
        routes = routes[:, list(schema.layers)]
    if absent is not None and absent.any():  # every id of a missing row is -1, on every kept layer
        return mark_missing(routes, absent)
    if compact:
        return routes.astype(compact_dtype(high), copy=False)
    if routes.dtype == WIRE_DTYPES["uint16"]:  # torch has few uint16 operations
        return routes.view("<i2") if high < 1 << 15 else routes.astype("<i4")
    return routes


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
    """A routes envelope, decoded and checked: ``[rows, num_layers, top_k]`` in its wire dtype
    (uint16 as int16 or int32).

    Args:
        envelope: ``{"data", "shape", "dtype"}`` (`encode_routes`).
        num_experts, num_layers, top_k: Expected sizes (None: unchecked).
        check_unique: Refuse a row that repeats an expert (several times the decode's cost).
        max_bytes: The largest array accepted.
        field: The envelope's path, for errors.

    Raises:
        MalformedResponseError: A malformed envelope or routes that fail the check.
    """
    schema = RouteSchema(num_layers, top_k, num_experts, check_unique, max_bytes)
    return checked_routes(decode_array(envelope, max_bytes=max_bytes, field=field), schema, field=field)


def decode_flat_routes(
    data: Base64Text,
    *,
    num_layers: int,
    top_k: int,
    num_experts: int | None = None,
    check_unique: bool = True,
    compact: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    field: str = "meta_info.routed_experts",
) -> np.ndarray:
    """SGLang's base64 flat int32 routes, decoded and checked, as ``[rows, num_layers, top_k]``.

    Args:
        data: The base64 text.
        num_layers, top_k: The model's route row shape (required: the ids are flat).
        num_experts: Ids must be below it (None: unchecked).
        check_unique: Refuse a row that repeats an expert.
        compact: Return the smallest dtype that holds the largest id (4x less host memory).
        max_bytes: The largest payload accepted.
        field: The payload's path, for errors.

    Raises:
        MalformedResponseError: A malformed payload or routes that fail the check.
    """
    schema = RouteSchema(num_layers, top_k, num_experts, check_unique, max_bytes)
    routes = decode_flat_array(data, num_layers, top_k, max_bytes=max_bytes, field=field)
    return checked_routes(routes, schema, compact=compact, field=field)


def decode_npy_routes(
    data: Base64Text,
    *,
    num_experts: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    check_unique: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    field: str = "choices[0].routed_experts",
) -> np.ndarray:
    """vLLM's base64 ``.npy`` routes, decoded and checked: ``[rows, num_layers, top_k]`` in their
    wire dtype (uint16 as int16 or int32).

    Args:
        data: The base64 text of the ``.npy`` file.
        num_experts, num_layers, top_k: Expected sizes (None: unchecked).
        check_unique: Refuse a row that repeats an expert.
        max_bytes: The largest array accepted.
        field: The payload's path, for errors.

    Raises:
        MalformedResponseError: A malformed file or routes that fail the check.
    """
    schema = RouteSchema(num_layers, top_k, num_experts, check_unique, max_bytes)
    return checked_routes(decode_npy_array(data, max_bytes=max_bytes, field=field), schema, field=field)
