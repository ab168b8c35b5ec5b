"""HTTP JSON bodies: a capped read, and a parse that leaves the route payloads in the raw bytes.

A generate response is mostly one base64 string (16 MB of uint8 routes for 32k tokens of a
48-layer top-8 model). :func:`parse_body` parses such a body once without turning that string
into a Python ``str``: it finds the value spans of the payload keys in the raw bytes, hands the
rest of the (small) JSON to orjson, and :meth:`ParsedBody.payload` later gives the payload
decoded, or a zero-copy ``memoryview`` of its base64 text.
"""

from __future__ import annotations

import binascii
import functools
import re
from collections.abc import AsyncIterable, Callable
from concurrent import futures
from typing import Any, TypeVar

import orjson

from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.helper_threads import helper_pool
from r3lightning.wire.route_decode import DecodedPayload, decode_payload

__all__ = [
    "PAYLOAD_KEYS",
    "DecodedPayload",
    "ParsedBody",
    "PayloadDecoder",
    "parse_body",
    "parse_body_with",
    "read_capped",
]

T = TypeVar("T")

# JSON keys whose string values are route payloads: the envelope's "data", the engines' key.
PAYLOAD_KEYS = ("data", "routed_experts")

# Decodes one payload's base64 text (a view of the body), raising binascii.Error or ValueError
# when it is not valid base64; the default is decode_payload without a row check.
PayloadDecoder = Callable[[memoryview], DecodedPayload]


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


# Strings at least this long are decoded during the parse when the caller will decode them.
_DECODE_MIN = 1 << 16
# Bytes per probe of the payload-end guess; base64 text never holds a byte outside its alphabet,
# JSON after it holds one within a few bytes (a quote, a comma, a bracket).
_PROBE = 256
_BASE64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def _all_base64(buf: bytes, at: int) -> bool:
    """Whether the probe window at ``at`` lies in the body and holds base64 characters only
    (deleting the alphabet leaves nothing: 0.5 us a probe, a third of a regex search)."""
    return at + _PROBE <= len(buf) and not buf[at : at + _PROBE].translate(None, _BASE64_ALPHABET)


def _guess_string_end(buf: bytes, start: int) -> int:
    """The likely closing quote of a base64 string starting at ``start`` (-1: none found).

    Gallops from ``start`` in doubling steps while probe windows hold base64 only, bisects
    between the last such window and the first that does not, and takes the first quote after.
    A guess, not an answer (a second payload later in the body can fool it): the caller proves
    it by decoding ``buf[start:end]`` strictly. Cost: about ``2 * log2(length / 256)`` probes
    of 256 bytes, independent of the payload length for practical purposes.
    """
    low, step = start, _PROBE
    while _all_base64(buf, start + step):
        low, step = start + step, step * 2
    high = start + step
    while high - low > _PROBE:
        middle = (low + high) // 2
        if _all_base64(buf, middle):
            low = middle
        else:
            high = middle
    return buf.find(b'"', low)


class ParsedBody:
    """A JSON body parsed with its payload strings left in the raw bytes.

    ``value`` is the parsed JSON in which each payload string (the string value of a key in
    ``PAYLOAD_KEYS``) is a placeholder; :meth:`payload` resolves one. Keep the object alive
    while views are in use.
    """

    __slots__ = ("_buf", "_decoded", "_keys", "_spans", "_taken", "value")

    def __init__(
        self,
        value: Any,
        buf: bytes,
        spans: list[tuple[int, int, bool]],
        decoded: dict[int, DecodedPayload],
        keys: tuple[str, ...],
    ):
        self.value = value
        self._buf = buf
        self._spans = spans
        self._decoded = decoded
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

    def payload(self, value: Any, field: str) -> str | memoryview | DecodedPayload:
        """A payload slot: decoded (when the parse decoded it), else its base64 text as a
        memoryview of the body or a plain ``str``.

        A slot that held an escaped string (rare: ``\\/`` from some JSON writers) or that the
        scanner did not splice is returned as ``str``. Anything but a string raises.
        """
        index = self._index(value)
        if index is None:
            if isinstance(value, str):
                return value
            raise MalformedResponseError(f"{field}: expected a base64 string, got {type(value).__name__}")
        self._taken.add(index)
        if (decoded := self._decoded.pop(index, None)) is not None:
            return decoded
        start, end, escaped = self._spans[index]
        if escaped:  # found by the scan in parse_body, so the payload is not read again here
            return self._text(index, field)
        return memoryview(self._buf)[start:end]

    def discard(self, value: Any) -> None:
        """Mark a payload slot as handled without reading it (so :meth:`restore` skips it)."""
        index = self._index(value)
        if index is not None:
            self._taken.add(index)
            self._decoded.pop(index, None)

    def restore(self) -> Any:
        """Put the text of payload slots never taken back into ``value`` (which is returned).

        Only walks the tree when such slots exist (a ``data`` key outside the route fields).
        """
        if len(self._taken) < len(self._spans):
            self.value = self._restore(self.value)
        self._decoded.clear()
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


def parse_body(
    body: bytes | bytearray | memoryview,
    *,
    keys: tuple[str, ...] = PAYLOAD_KEYS,
    decode: bool | PayloadDecoder = False,
) -> ParsedBody:
    """Parse a JSON body once, leaving the string values of ``keys`` unparsed in the raw bytes.

    A regex finds each ``"key": "`` outside a string (the opening quote must not be escaped;
    inside a valid JSON string every quote is), the end of the string is found, and the span is
    replaced by a short placeholder before orjson parses what is left.

    ``decode``: the caller will decode the payloads, so strings of 64 KiB or more are decoded
    here, by ``decode`` itself when it is a :data:`PayloadDecoder` (one that can also check the
    routes it decodes, see :func:`~r3lightning.wire.route_decode.decode_payload`), else by
    ``decode_payload``. Their ends are guessed from a few probes (:func:`_guess_string_end`) and
    proved by the strict base64 decode itself: a span that decodes holds neither a quote nor an
    escape. So the payload is read once, by the decode, which runs on this thread while a helper
    thread parses the rest of the JSON. A wrong guess (a body with two large payloads can cause
    one) falls back to the exact parse below, after one wasted decode attempt.

    Otherwise ``memchr`` finds each closing quote (noting on the way whether the span holds an
    escape): one more streaming pass over the payload. Cost beyond the payload: one copy of the
    non-payload bytes and an orjson parse of them. Raises :class:`MalformedResponseError` for
    invalid JSON.
    """
    return parse_body_with(body, _nothing, keys=keys, decode=decode)[0]


def _nothing(parsed: ParsedBody) -> None:
    return None


def parse_body_with(
    body: bytes | bytearray | memoryview,
    then: Callable[[ParsedBody], T],
    *,
    keys: tuple[str, ...] = PAYLOAD_KEYS,
    decode: bool | PayloadDecoder = False,
) -> tuple[ParsedBody, T]:
    """:func:`parse_body`, then ``then(parsed)``: with ``decode``, on the helper thread while
    this one decodes the payloads, so the caller's own pass over the JSON fields costs nothing.

    ``then`` must leave payload slots alone except for :meth:`ParsedBody.discard` (their
    decoded bytes arrive once it has returned) and may run twice: a wrong guess discards the
    first parse and its outcome. What it raises is raised here.
    """
    buf = bytes(body) if not isinstance(body, bytes) else body
    text, spans, guessed = _splice(buf, keys, guess=bool(decode))
    if guessed:
        decoder = decode_payload if decode is True else decode
        if (outcome := _parse_decoding(buf, keys, text, spans, guessed, then, decoder)) is not None:
            return outcome
        text, spans, _ = _splice(buf, keys, guess=False)  # a wrong guess: the exact parse
    parsed = ParsedBody(_loads(text), buf, spans, {}, keys)
    return parsed, then(parsed)


def _splice(
    buf: bytes, keys: tuple[str, ...], *, guess: bool
) -> tuple[bytes, list[tuple[int, int, bool]], list[int]]:
    """The body with each payload string replaced by a placeholder, the payload spans
    ``(content start, closing quote, has escapes)``, and which spans end at a guessed quote."""
    pattern = _key_pattern(tuple(keys))
    pieces: list[bytes] = []
    spans: list[tuple[int, int, bool]] = []
    guessed: list[int] = []
    copied = searched = 0
    while (match := pattern.search(buf, searched)) is not None:
        if _escaped(buf, match.start()):
            searched = match.start() + 1
            continue
        start = match.end()
        end = _guess_string_end(buf, start) if guess else -1
        if end - start >= _DECODE_MIN:
            escaped = False
            guessed.append(len(spans))
        else:
            end, escaped = _string_end(buf, start)
        if end < 0:
            raise MalformedResponseError(f"response body: unterminated string at byte {start - 1}")
        pieces.append(buf[copied : start - 1])
        pieces.append(b'"\\u0000payload:%d"' % len(spans))
        spans.append((start, end, escaped))
        copied = searched = end + 1
    if not spans:
        return buf, spans, guessed
    pieces.append(buf[copied:])
    return b"".join(pieces), spans, guessed


def _loads(text: bytes) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise MalformedResponseError(f"response body is not valid JSON: {exc}") from None


def _submit(work: Callable[[], T]) -> futures.Future[T] | None:
    """``work`` on a helper thread; None (the caller runs it) on a single core or once the
    interpreter is shutting down (the pool then refuses new work)."""
    pool = helper_pool()
    if pool is None:
        return None
    try:
        return pool.submit(work)
    except RuntimeError:
        return None


def _parse_decoding(
    buf: bytes,
    keys: tuple[str, ...],
    text: bytes,
    spans: list[tuple[int, int, bool]],
    guessed: list[int],
    then: Callable[[ParsedBody], T],
    decoder: PayloadDecoder,
) -> tuple[ParsedBody, T] | None:
    """The decoding parse of :func:`parse_body_with`; None when a guessed end was wrong."""
    parsed = ParsedBody(None, buf, spans, {}, keys)

    def fields() -> T:
        parsed.value = _loads(text)
        return then(parsed)

    # orjson and ``then`` keep the GIL while the decode drops it: they run on a helper meanwhile
    job = _submit(fields)
    decoded: dict[int, DecodedPayload] = {}
    for index in guessed:
        start, end, _ = spans[index]
        try:
            payload = decoder(memoryview(buf)[start:end])
        except (binascii.Error, ValueError):
            # invalid base64, or a quote or escape inside: the exact scan tells which
            exact_end, escaped = _string_end(buf, start)
            if exact_end != end:  # the guess was wrong, and so was the text orjson parses
                if job is not None:
                    futures.wait([job])
                return None
            spans[index] = (start, end, escaped)  # right span, bad payload: its decoder reports it
            continue
        decoded[index] = payload
    outcome = job.result() if job is not None else fields()
    parsed._decoded.update((i, payload) for i, payload in decoded.items() if i not in parsed._taken)
    return parsed, outcome


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
