"""HTTP JSON bodies: a capped read, and a parse that leaves long route payloads in the raw bytes
(a 16 MiB base64 string costs many times its decode just to become a ``str``)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, Callable
from typing import Any

import orjson

from r3lightning.wire.errors import MalformedResponseError

__all__ = ["JsonBody", "read_capped", "unescaped"]

# shorter strings are parsed by orjson as any other (cutting them out would not pay)
_CUT_MIN = 1 << 12
# a payload key (the envelope's "data", the engines' "routed_experts") opening a string value; in
# valid JSON a match is never inside a string (its quotes there would be escaped)
_KEY = re.compile(rb'"(?:data|routed_experts)"[ \t\n\r]*:[ \t\n\r]*"')
_MARK = "\x00payload:"  # what orjson yields for a cut string, b'"\\u0000payload:<i>"'


def _escaped(raw: bytes, index: int) -> bool:  # after an odd run of backslashes
    start = index
    while index > 0 and raw[index - 1] == 0x5C:
        index -= 1
    return (start - index) % 2 == 1


class JsonBody:
    """A JSON body parsed with its long payload strings left in ``raw``.

    ``value`` holds a marker string for each cut payload; `take` turns one into a ``memoryview`` of
    the body, `finish` the others into None. Cost: a ``memchr`` pass over each long string and an
    orjson parse of the rest. Not thread-safe (one response, one parser).

    Args:
        raw: The whole response body.

    Raises:
        MalformedResponseError: An unterminated string or invalid JSON.
    """

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.spans: list[tuple[int, int]] = []  # (content start, closing quote) of each cut string
        self._taken: set[int] = set()
        pieces = []
        copied = 0
        searched = 0
        while True:
            match = _KEY.search(raw, searched)
            if match is None:
                break
            start = match.end()
            end = raw.find(b'"', start)
            while end > 0 and _escaped(raw, end):  # an escaped quote: not the end
                end = raw.find(b'"', end + 1)
            if end < 0:
                raise MalformedResponseError(f"response body: unterminated string at byte {start - 1}")
            searched = end + 1
            if end - start < _CUT_MIN:
                continue  # short: orjson reads it
            pieces += (raw[copied:start], b"\\u0000payload:%d" % len(self.spans))
            self.spans.append((start, end))
            copied = end
        text = b"".join([*pieces, raw[copied:]]) if self.spans else raw
        try:
            self.value: Any = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise MalformedResponseError(f"response body is not valid JSON: {exc}") from None

    def _index(self, value: Any) -> int | None:
        """The span a marker stands for (None for any other value)."""
        digits = value.removeprefix(_MARK) if isinstance(value, str) and value.startswith(_MARK) else ""
        return int(digits) if digits.isdecimal() and int(digits) < len(self.spans) else None

    def take(self, container: dict[str, Any], key: str) -> Any:
        """``container[key]``, left as None in ``value`` (a raw response never holds its route payload).

        Args:
            container: A dict inside ``value``.
            key: The payload's key.

        Returns:
            The value; a cut string comes back as a ``memoryview`` of its base64 text in ``raw``.

        Raises:
            KeyError: ``key`` is absent.
        """
        value = container[key]
        container[key] = None
        index = self._index(value)
        if index is None:
            return value
        self._taken.add(index)
        start, end = self.spans[index]
        return memoryview(self.raw)[start:end]

    def finish(self) -> Any:
        """``value`` with the markers never taken (another choice's routes, a long ``data``
        string elsewhere) replaced by None; walks the tree only when there are some."""
        if len(self._taken) < len(self.spans):
            self.value = self._clear(self.value)
        return self.value

    def _clear(self, node: Any) -> Any:
        if isinstance(node, dict):
            return {key: self._clear(item) for key, item in node.items()}
        if isinstance(node, list):
            return [self._clear(item) for item in node]
        return None if self._index(node) is not None else node


def unescaped(value: Any) -> Any:
    """A value from `JsonBody.take` with its cut string unescaped, when it holds JSON escapes (``\\/``
    from some writers, which strict base64 refuses).

    Args:
        value: An envelope dict or a payload.

    Returns:
        The value with its payload as a ``str``, or None when there was nothing to unescape.
    """
    data = value.get("data") if isinstance(value, dict) else value
    if not isinstance(data, memoryview):
        return None
    text = data.tobytes()
    if text.find(b"\\") < 0:
        return None
    try:
        data = orjson.loads(b'"' + text + b'"')
    except orjson.JSONDecodeError:
        return None
    return {**value, "data": data} if isinstance(value, dict) else data


async def read_capped(
    chunks: AsyncIterable[bytes],
    content_length: int | None,
    cap: int,
    too_large: Callable[[int | None], Exception],
) -> bytes:
    """An HTTP body of at most ``cap`` bytes, refused before reading past it; one join at the end.

    Args:
        chunks: The body's chunks as they arrive.
        content_length: The declared length, or None.
        cap: The largest body accepted.
        too_large: Builds the error from ``declared``: ``content_length`` when that alone exceeds
            ``cap``, else None.

    Returns:
        The body.

    Raises:
        Exception: What ``too_large`` builds.
    """
    if content_length is not None and content_length > cap:
        raise too_large(content_length)
    parts: list[bytes] = []
    size = 0  # one join of the chunks at the end
    async for chunk in chunks:
        size += len(chunk)
        if size > cap:
            raise too_large(None)
        parts.append(chunk)
    return b"".join(parts)
