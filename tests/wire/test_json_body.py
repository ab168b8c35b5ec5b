"""Body parsing (r3lightning.wire.json_body.JsonBody) against json.loads and the standard base64.

Bodies are random JSON with strings that look like the payload keys, escapes, unicode and every
layout json.dumps can write; the cut threshold is lowered so that every payload is cut.
"""

from __future__ import annotations

import base64
import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from route_samples import distinct_routes, naive_decode

from r3lightning import MalformedResponseError
from r3lightning.wire import json_body
from r3lightning.wire.codec import decode_routes, encode_routes
from r3lightning.wire.json_body import JsonBody, read_capped, unescaped

TRICKY_STRINGS = [
    "plain",
    'quote " inside',
    'escaped \\" backslash',
    '"data": "AAAA"',
    '\\"data\\": \\"',
    "ends with backslash \\",
    "unicode é ✓ \u2028",
    '{"routed_experts": "QUJD"}',
]


def random_body(rng: random.Random, n_choices: int) -> tuple[dict, list[np.ndarray]]:
    choices, expected = [], []
    for i in range(n_choices):
        routes = distinct_routes(rng.randint(0, 6), rng.randint(1, 3), 2, rng.choice([8, 300]), seed=i)
        expected.append(routes)
        envelope = encode_routes(routes)
        keys = ["dtype", "shape", "data"]
        rng.shuffle(keys)
        choice = {
            "index": i,
            "text": rng.choice(TRICKY_STRINGS),
            "token_ids": [rng.randint(0, 99) for _ in range(rng.randint(0, 5))],
            "routed_experts": {k: envelope[k] for k in keys},
            "finish_reason": rng.choice(["stop", "length", None]),
        }
        keys = list(choice)
        rng.shuffle(keys)
        choices.append({k: choice[k] for k in keys})
    body = {"id": rng.choice(TRICKY_STRINGS), "choices": choices, "note": {"k": rng.choice(TRICKY_STRINGS)}}
    return body, expected


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), n_choices=st.integers(1, 3), indent=st.sampled_from([None, 0, 2, "\t"]),
       ensure_ascii=st.booleans(), compact=st.booleans(), cut_min=st.sampled_from([0, 8, 1 << 12]))  # fmt: skip
def test_body_parsing_matches_json_loads(seed, n_choices, indent, ensure_ascii, compact, cut_min):
    rng = random.Random(seed)
    body, expected = random_body(rng, n_choices)
    separators = (",", ":") if compact else (" , ", " :\n ")
    text = json.dumps(body, indent=indent, ensure_ascii=ensure_ascii, separators=separators).encode()
    reference = json.loads(text)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(json_body, "_CUT_MIN", cut_min)
        parsed = JsonBody(text)
    for i, choice in enumerate(parsed.value["choices"]):
        envelope = choice["routed_experts"]
        data = parsed.take(envelope, "data")
        text = reference["choices"][i]["routed_experts"]["data"]
        assert isinstance(data, memoryview) == (len(text) >= cut_min)  # long ones are cut
        decoded = decode_routes({**envelope, "data": data})
        np.testing.assert_array_equal(decoded, expected[i])
        np.testing.assert_array_equal(decoded, naive_decode(reference["choices"][i]["routed_experts"]))
        reference["choices"][i]["routed_experts"]["data"] = None  # taken: None in the raw response
    assert parsed.finish() == reference  # everything else is parsed exactly as json.loads does


def test_a_long_payload_is_a_view_of_the_body_never_a_string():
    envelope = encode_routes(distinct_routes(600, 4, 2, 16))  # 6.4 KB of base64: cut
    text = json.dumps({"choices": [{"routed_experts": envelope, "token_ids": [1]}]}).encode()
    parsed = JsonBody(text)
    slot = parsed.value["choices"][0]["routed_experts"]
    assert slot["shape"] == envelope["shape"] and slot["dtype"] == envelope["dtype"]
    assert len(slot["data"]) < 16  # a marker, not the base64 text
    view = parsed.take(slot, "data")
    assert isinstance(view, memoryview) and view.obj is text
    assert bytes(view) == envelope["data"].encode()
    assert parsed.finish()["choices"][0]["routed_experts"]["data"] is None


def test_markers_never_taken_become_none():
    one, two = (encode_routes(distinct_routes(600, 4, 2, 16, seed=s)) for s in (1, 2))
    text = json.dumps({"choices": [{"routed_experts": one}, {"routed_experts": two}], "data": "x" * 5000})
    parsed = JsonBody(text.encode())
    parsed.take(parsed.value["choices"][0]["routed_experts"], "data")
    value = parsed.finish()
    assert value["data"] is None and value["choices"][1]["routed_experts"]["data"] is None
    assert value["choices"][1]["routed_experts"]["shape"] == two["shape"]


@pytest.mark.parametrize("rows", [40, 13_000])  # short: parsed by orjson; long: cut, then unescaped
def test_escaped_slashes_in_a_payload_are_unescaped(rows):
    routes = distinct_routes(rows, 2, 2, 256, seed=1)
    envelope = encode_routes(routes)
    assert "/" in envelope["data"]
    text = json.dumps({"routed_experts": envelope}).replace("/", "\\/").encode()
    parsed = JsonBody(text)
    data = parsed.take(parsed.value["routed_experts"], "data")
    assert isinstance(data, str if rows == 40 else memoryview)
    if rows == 40:
        np.testing.assert_array_equal(decode_routes({**envelope, "data": data}), routes)
    else:  # strict base64 refuses the backslashes: the parse resolves them after a failed decode
        with pytest.raises(MalformedResponseError, match="base64"):
            decode_routes({**envelope, "data": data})
        resolved = unescaped({**envelope, "data": data})
        assert resolved["data"] == envelope["data"]
        np.testing.assert_array_equal(decode_routes(resolved), routes)
    assert unescaped({**envelope, "data": memoryview(envelope["data"].encode())}) is None  # no escapes


def test_an_escaped_quote_does_not_end_a_long_string():
    long = "QUJD" * 2000 + '\\"' + "QUJD" * 2000
    text = ('{"routed_experts": "' + long + '", "data": "QUJD"}').encode()
    parsed = JsonBody(text)
    assert bytes(parsed.take(parsed.value, "routed_experts")) == long.encode()
    assert parsed.finish() == {**json.loads(text), "routed_experts": None}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b'{"data": "QUJD', "unterminated string at byte 9"),
        (b'{"data": "QUJD\\"}', "unterminated string"),
        (b'{"data": "QUJD" "x"}', "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"choices": [}', "not valid JSON"),
        (b'{"data": "QU\\qJD"}', "not valid JSON"),
        (b'{"data": "' + b"A" * 5000 + b'" "x"}', "not valid JSON"),
    ],
)
def test_invalid_bodies(text, message):
    with pytest.raises(MalformedResponseError, match=message):
        JsonBody(text)


def test_take_leaves_none_and_gives_what_was_there():
    parsed = JsonBody(b'{"data": 3, "routed_experts": "QUJD", "x": [1]}')
    assert parsed.take(parsed.value, "routed_experts") == "QUJD"  # short: parsed by orjson
    assert parsed.take(parsed.value, "data") == 3  # the decoders refuse what is not a string
    assert parsed.finish() == {"data": None, "routed_experts": None, "x": [1]}


async def _chunks(parts):
    for part in parts:
        yield part


async def test_read_capped_refuses_a_body_past_the_cap():
    def too_large(declared):
        return MalformedResponseError(f"too large: {declared}")

    assert await read_capped(_chunks([b"ab", b"cd"]), None, 4, too_large) == b"abcd"
    with pytest.raises(MalformedResponseError, match="too large: 10"):
        await read_capped(_chunks([b"ab"]), 10, 4, too_large)  # declared: refused before reading
    with pytest.raises(MalformedResponseError, match="too large: None"):
        await read_capped(_chunks([b"abc", b"de"]), None, 4, too_large)
    assert base64.b64decode(await read_capped(_chunks([b"QUJD"]), 4, 4, too_large)) == b"ABC"
