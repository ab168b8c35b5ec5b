"""Route wire codec: ndarray envelopes, SGLang's flat int32 routes, and fast body parsing.

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

A generate response is mostly that one base64 string (50 MB of int32 routes for 32k tokens of
a 48-layer top-8 model). ``parse_body`` parses such a body once without turning the string into a
Python ``str``: it finds the value spans of the payload keys in the raw bytes, hands the rest of
the (small) JSON to orjson, and ``ParsedBody.payload`` later gives a zero-copy ``memoryview`` of a
span that pybase64 decodes straight into the numpy array's buffer. Decoding is one SIMD base64
pass plus the validation passes below; nothing is ever unpickled.

Every decoder validates before it allocates (dtype, shape, byte count, size cap) and raises
:class:`MalformedResponseError` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import ast
import binascii
import functools
import math
import re
from collections.abc import AsyncIterable, Callable, Mapping
from typing import Any

import numpy as np
import orjson
import pybase64

from ..routes import WIRE_DTYPES, compact_dtype
from .errors import MalformedResponseError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "PAYLOAD_KEYS",
    "WIRE_DTYPES",
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
    "validate_routes",
]

# Default cap on the decoded size of one array; checked before anything is allocated.
DEFAULT_MAX_BYTES = 1 << 30
# JSON keys whose string values are route payloads: the envelope's "data", SGLang's meta_info key.
PAYLOAD_KEYS = ("data", "routed_experts")


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


def _decoded_size(data: str | bytes | bytearray | memoryview, field: str) -> int:
    """Byte count the base64 ``data`` decodes to, from its length and padding alone."""
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


def _b64_to_buffer(data: Any, expected_bytes: int, field: str) -> bytearray:
    if not isinstance(data, str | bytes | bytearray | memoryview):
        raise MalformedResponseError(f"{field}: expected a base64 string, got {type(data).__name__}")
    size = _decoded_size(data, field)
    if size != expected_bytes:
        raise MalformedResponseError(
            f"{field}: base64 payload holds {size} bytes but the shape and dtype need {expected_bytes}"
        )
    try:
        return pybase64.b64decode_as_bytearray(data, validate=True)
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

    ``envelope["data"]`` may be a ``str``, ``bytes`` or a ``memoryview`` (from
    :meth:`ParsedBody.payload`). The declared size is checked against ``max_bytes`` and the
    payload length against the shape before any allocation. Cost: one SIMD base64 decode into
    the array's own buffer, no other copy.
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


# Rows per block of the distinct-experts check: a block's columns ([top_k, block] in the wire
# dtype) and its pairwise comparisons ([top_k*(top_k-1)/2, block] bools) stay in a core's L2 cache.
_UNIQUE_BLOCK = 1 << 15


def _check_range(routes: np.ndarray, num_experts: int | None, field: str) -> int | None:
    """Ids must be non-negative and below ``num_experts``; one pass over a non-empty ``routes``
    when they are. Returns the largest id when that pass computed it (else None).

    Signed ids are viewed as unsigned of the same width, where a negative id is at least
    ``2**(bits-1)``: a single max then bounds both ends. The exact min/max (for the message) are
    only computed once a bad id is known to exist.
    """
    signed = routes.dtype.kind == "i"
    if signed:
        bound = 1 << (8 * routes.dtype.itemsize - 1)  # unsigned images of negatives are >= this
        limit = bound if num_experts is None else min(num_experts, bound)
        as_unsigned = routes.view(routes.dtype.str.replace("i", "u"))
        if (high := int(as_unsigned.max())) < limit:
            return high
    elif num_experts is None:
        return None
    if signed and (low := int(routes.min())) < 0:
        raise MalformedResponseError(f"{field}: expert id {low} is negative")
    high = int(routes.max())
    if num_experts is not None and high >= num_experts:
        raise MalformedResponseError(
            f"{field}: expert id {high} is out of range for num_experts={num_experts}"
        )
    return high


def _first_repeat(routes: np.ndarray) -> int | None:
    """Flat ``row * num_layers + layer`` index of the first ``[top_k]`` row repeating an expert.

    All-zero rows (dense-layer filler) do not count. Works block by block: each block of rows is
    transposed into contiguous columns (the dominant cost, one strided copy) and every column is
    compared with the columns after it in one broadcast call, all within cache.
    """
    k = routes.shape[-1]
    rows = routes.reshape(-1, k)  # [rows*layers, top_k]
    block = min(_UNIQUE_BLOCK, rows.shape[0])
    columns = np.empty((k, block), dtype=rows.dtype)  # [top_k, block]
    pairs = np.empty((k * (k - 1) // 2, block), dtype=bool)  # [pair, block]
    for first in range(0, rows.shape[0], block):
        chunk = rows[first : first + block]
        n = chunk.shape[0]
        cols, equal = columns[:, :n], pairs[:, :n]
        np.copyto(cols, chunk.T)
        offset = 0
        for i in range(k - 1):
            np.equal(cols[i + 1 :], cols[i], out=equal[offset : offset + k - 1 - i])
            offset += k - 1 - i
        repeated = np.logical_or.reduce(equal, axis=0)  # [block]
        if repeated.any():
            repeated &= cols.any(axis=0)
            if repeated.any():
                return first + int(np.flatnonzero(repeated)[0])
    return None


def validate_routes(
    routes: np.ndarray,
    *,
    num_experts: int | None = None,
    num_layers: int | None = None,
    top_k: int | None = None,
    check_unique: bool = True,
    field: str = "routed_experts",
) -> None:
    """Check a route array ``[rows, num_layers, top_k]``; raise ``MalformedResponseError`` if bad.

    Ids must be non-negative and, when ``num_experts`` is given, below it. With ``check_unique``
    the ``top_k`` ids of a row must be distinct (dispatch assumes it); an all-zero row is the
    filler of a dense layer and is allowed. Cost: one max pass for the range (plus a min or max
    only when an id is bad), and for ``check_unique`` a cache-blocked transpose and
    ``top_k*(top_k-1)/2`` contiguous comparisons (about 9 ms on one core for 32k x 48 x 8 int16
    ids, half of it the transpose; the range check is about 1 ms). Never modifies ``routes``.
    """
    if routes.ndim != 3:
        raise MalformedResponseError(
            f"{field}: expected shape [rows, num_layers, top_k], got {list(routes.shape)}"
        )
    for axis, expected, name in ((1, num_layers, "num_layers"), (2, top_k, "top_k")):
        if expected is not None and routes.shape[axis] != expected:
            raise MalformedResponseError(
                f"{field}: shape {list(routes.shape)} has {routes.shape[axis]} on axis {axis}, "
                f"expected {name}={expected}"
            )
    if routes.size == 0:
        return
    _check_range(routes, num_experts, field)
    if check_unique:
        _check_unique(routes, field)


def _check_unique(routes: np.ndarray, field: str) -> None:
    """Raise for the first ``[top_k]`` row of ``routes`` ``[rows, L, K]`` that repeats an expert."""
    if routes.size == 0 or routes.shape[2] < 2:
        return
    index = _first_repeat(routes)
    if index is not None:
        row, layer = divmod(index, routes.shape[1])
        raise MalformedResponseError(
            f"{field}: row {row} layer {layer} repeats an expert: {routes[row, layer].tolist()}"
        )


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
    validate_routes(
        routes,
        num_experts=num_experts,
        num_layers=num_layers,
        top_k=top_k,
        check_unique=check_unique,
        field=field,
    )
    return _signed(routes)


def _signed(routes: np.ndarray) -> np.ndarray:
    """uint16 routes as int16 (a free view when every id is below 32768, else an int32 copy)."""
    if routes.dtype != WIRE_DTYPES["uint16"]:
        return routes
    if routes.size == 0 or int(routes.max()) < 32768:
        return routes.view(WIRE_DTYPES["int16"])
    return routes.astype(WIRE_DTYPES["int32"])


def decode_flat_routes(
    data: str | bytes | bytearray | memoryview,
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
    if not isinstance(data, str | bytes | bytearray | memoryview):
        raise MalformedResponseError(f"{field}: expected a base64 string, got {type(data).__name__}")
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
    # int32 is signed: the range pass always yields the largest id, reused for the compact dtype
    high = _check_range(routes, num_experts, field) if routes.size else 0
    if compact:
        routes = routes.astype(compact_dtype(high or 0), copy=False)
    if check_unique:  # on the compact copy: up to 4x less memory traffic
        _check_unique(routes, field)
    return routes


_NPY_MAGIC = b"\x93NUMPY"
# numpy's own default cap on a header (np.load's max_header_size)
_NPY_MAX_HEADER = 10_000


def _b64_prefix(data: str | bytes | bytearray | memoryview, nbytes: int, field: str) -> bytes:
    """The first ``nbytes`` decoded bytes of base64 ``data`` (decodes only what it needs)."""
    chars = -(-nbytes // 3) * 4
    if chars > len(data):
        raise MalformedResponseError(f"{field}: payload too short for a .npy header")
    try:
        return pybase64.b64decode(data[:chars], validate=True)[:nbytes]
    except (binascii.Error, ValueError) as exc:
        raise MalformedResponseError(f"{field}: invalid base64 ({exc})") from None


def _npy_header(data: str | bytes | bytearray | memoryview, field: str) -> tuple[int, np.dtype, list[int]]:
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
    try:
        header = ast.literal_eval(text.decode("latin1" if major < 3 else "utf-8"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        raise MalformedResponseError(f"{field}: unreadable .npy header {text[:200]!r}") from None
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


def _same_dtype(descr: str, dtype: np.dtype) -> bool:
    try:
        return np.dtype(descr) == dtype
    except TypeError:
        return False


def decode_npy_routes(
    data: str | bytes | bytearray | memoryview,
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
    if not isinstance(data, str | bytes | bytearray | memoryview):
        raise MalformedResponseError(f"{field}: expected a base64 string, got {type(data).__name__}")
    offset, dtype, shape = _npy_header(data, field)
    count = math.prod(shape)
    _check_size(count * dtype.itemsize, max_bytes, field)
    buffer = _b64_to_buffer(data, offset + count * dtype.itemsize, field)
    routes = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
    validate_routes(
        routes,
        num_experts=num_experts,
        num_layers=num_layers,
        top_k=top_k,
        check_unique=check_unique,
        field=field,
    )
    return _signed(routes)


# --------------------------------------------------------------------------- body parsing

_PLACEHOLDER = "\x00payload:"  # what orjson yields for the spliced-in b'"\\u0000payload:<i>"'


@functools.lru_cache(maxsize=8)
def _key_pattern(keys: tuple[str, ...]) -> re.Pattern[bytes]:
    names = b"|".join(re.escape(k.encode()) for k in keys)
    return re.compile(rb'"(?:' + names + rb')"[ \t\n\r]*:[ \t\n\r]*"')


def _escaped(buf: bytes, index: int) -> bool:
    """Whether the byte at ``index`` is escaped by an odd run of backslashes before it."""
    start = index
    while index > 0 and buf[index - 1] == 0x5C:
        index -= 1
    return (start - index) % 2 == 1


# Bytes per step of the closing-quote scan: the backslash search re-reads a step from L2 cache.
_SCAN_CHUNK = 1 << 19


def _string_end(buf: bytes, start: int) -> tuple[int, bool]:
    """Closing quote of the JSON string whose content starts at ``start`` (-1 if unterminated),
    and whether the content holds a backslash (an escape, to be resolved by a JSON parser).

    Both searches are ``memchr``: the quote search streams the payload from memory once, and
    the backslash search re-reads each step while it is still in cache.
    """
    size = len(buf)
    while start < size:
        stop = min(start + _SCAN_CHUNK, size)
        quote = buf.find(b'"', start, stop)
        if buf.find(b"\\", start, stop if quote < 0 else quote) >= 0:
            break  # escapes: the slow scan below, which skips escaped quotes
        if quote >= 0:
            return quote, False
        start = stop
    else:
        return -1, False
    while (quote := buf.find(b'"', start)) >= 0 and _escaped(buf, quote):
        start = quote + 1
    return quote, True


class ParsedBody:
    """A JSON body parsed with its payload strings left in the raw bytes.

    ``value`` is the parsed JSON in which each payload string (the string value of a key in
    ``PAYLOAD_KEYS``) is a placeholder; :meth:`payload` resolves one to a zero-copy
    ``memoryview`` of the base64 text. Keep the object alive while views are in use.
    """

    __slots__ = ("_buf", "_keys", "_spans", "_taken", "value")

    def __init__(self, value: Any, buf: bytes, spans: list[tuple[int, int, bool]], keys: tuple[str, ...]):
        self.value = value
        self._buf = buf
        self._spans = spans
        self._keys = frozenset(keys)
        self._taken: set[int] = set()

    def _text(self, index: int, field: str) -> str:
        """The span as a ``str``, JSON escapes resolved (the slow path, for rare or small slots)."""
        start, end, _ = self._spans[index]
        try:
            return orjson.loads(self._buf[start - 1 : end + 1])
        except orjson.JSONDecodeError as exc:
            raise MalformedResponseError(f"{field}: invalid JSON string ({exc})") from None

    def _index(self, value: Any) -> int | None:
        if isinstance(value, str) and value.startswith(_PLACEHOLDER):
            digits = value[len(_PLACEHOLDER) :]
            if digits.isdecimal() and int(digits) < len(self._spans):
                return int(digits)
        return None

    def payload(self, value: Any, field: str) -> str | memoryview:
        """The base64 text of a payload slot: a memoryview of the body, or a plain ``str``.

        A slot that held an escaped string (rare: ``\\/`` from some JSON writers) or that the
        scanner did not splice is returned as ``str``. Anything but a string raises.
        """
        index = self._index(value)
        if index is None:
            if isinstance(value, str):
                return value
            raise MalformedResponseError(f"{field}: expected a base64 string, got {type(value).__name__}")
        self._taken.add(index)
        start, end, escaped = self._spans[index]
        if escaped:  # found by the scan in parse_body, so the payload is not read again here
            return self._text(index, field)
        return memoryview(self._buf)[start:end]

    def discard(self, value: Any) -> None:
        """Mark a payload slot as handled without reading it (so :meth:`restore` skips it)."""
        index = self._index(value)
        if index is not None:
            self._taken.add(index)

    def restore(self) -> Any:
        """Put the text of payload slots never taken back into ``value`` (which is returned).

        Only walks the tree when such slots exist (a ``data`` key outside the route fields).
        """
        if len(self._taken) < len(self._spans):
            self.value = self._restore(self.value)
        return self.value

    def _restore(self, node: Any, key: str | None = None) -> Any:
        if isinstance(node, dict):
            return {k: self._restore(item, k) for k, item in node.items()}
        if isinstance(node, list):
            return [self._restore(item) for item in node]
        index = self._index(node) if key in self._keys else None
        if index is None or index in self._taken:
            return node
        return self._text(index, key or "")


def parse_body(body: bytes | bytearray | memoryview, *, keys: tuple[str, ...] = PAYLOAD_KEYS) -> ParsedBody:
    """Parse a JSON body once, leaving the string values of ``keys`` unparsed in the raw bytes.

    A regex finds each ``"key": "`` outside a string (the opening quote must not be escaped;
    inside a valid JSON string every quote is), ``memchr`` jumps to the closing quote (noting
    on the way whether the span holds an escape), and the span is replaced by a short
    placeholder before orjson parses what is left. Cost: one copy of the non-payload bytes and
    an orjson parse of them; the payload bytes are streamed once by ``memchr`` (about half a
    SIMD base64 decode of them). Raises :class:`MalformedResponseError` for invalid JSON.
    """
    buf = bytes(body) if not isinstance(body, bytes) else body
    pattern = _key_pattern(tuple(keys))
    pieces: list[bytes] = []
    spans: list[tuple[int, int, bool]] = []  # (content start, closing quote, has escapes)
    copied = searched = 0
    while (match := pattern.search(buf, searched)) is not None:
        if _escaped(buf, match.start()):
            searched = match.start() + 1
            continue
        start = match.end()
        end, escaped = _string_end(buf, start)
        if end < 0:
            raise MalformedResponseError(f"response body: unterminated string at byte {start - 1}")
        pieces.append(buf[copied : start - 1])
        pieces.append(b'"\\u0000payload:%d"' % len(spans))
        spans.append((start, end, escaped))
        copied = searched = end + 1
    if spans:
        pieces.append(buf[copied:])
        text = b"".join(pieces)
    else:
        text = buf
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise MalformedResponseError(f"response body is not valid JSON: {exc}") from None
    return ParsedBody(value, buf, spans, tuple(keys))


async def read_capped(
    chunks: AsyncIterable[bytes],
    content_length: int | None,
    cap: int,
    too_large: Callable[[int | None], Exception],
) -> bytes:
    """An HTTP body (request or response) of at most ``cap`` bytes, refused before reading past it.

    ``chunks``: the body stream (e.g. ``StreamReader.iter_any()``); ``content_length``: the
    declared size, if any. ``too_large(declared)`` builds the error raised, with the declared
    size when that alone exceeds ``cap``, else ``None`` (found while streaming). Cost: one join
    of the chunks.
    """
    if content_length is not None and content_length > cap:
        raise too_large(content_length)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > cap:
            raise too_large(None)
        parts.append(chunk)
    return b"".join(parts)
