"""Body parsing (r3lightning.wire.json_body) against json.loads and the standard base64 module.

Both parses are covered: the exact one (``memchr`` finds each closing quote) and the decoding one
(payload ends guessed from probes and proved by a strict decode, falling back to the exact
parse on a wrong guess). The decoding parse is also run with tiny probe windows and size
thresholds, so random small bodies exercise its guesses and every fallback.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import multiprocessing
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from route_samples import distinct_routes, naive_decode
from runif import run_if

from r3lightning import MalformedResponseError, decode_routes, encode_routes
from r3lightning.wire import json_body
from r3lightning.wire.codec import decode_array, decode_flat_routes, decode_npy_routes, encode_flat_routes
from r3lightning.wire.json_body import DecodedPayload, parse_body, parse_body_with

MODES = ["exact", "decoding", "decoding, tiny probes"]


@contextlib.contextmanager
def parser(mode: str):
    """``parse(text) -> ParsedBody`` in one of the MODES."""
    with pytest.MonkeyPatch.context() as patch:
        if mode == "decoding, tiny probes":
            patch.setattr(json_body, "_DECODE_MIN", 4)
            patch.setattr(json_body, "_PROBE", 4)
        yield lambda text: parse_body(text, decode=mode != "exact")


def payload_text(payload) -> bytes:
    """The base64 text of a payload slot (re-encoded when the parse decoded it)."""
    if isinstance(payload, DecodedPayload):
        return base64.b64encode(bytes(payload.raw))
    return payload.encode() if isinstance(payload, str) else bytes(payload)


def test_payload_is_a_view_of_the_body_not_a_string():
    envelope = encode_routes(distinct_routes(64, 4, 2, 16))
    body = json.dumps({"choices": [{"routed_experts": envelope, "token_ids": [1]}]}).encode()
    parsed = parse_body(body)
    slot = parsed.value["choices"][0]["routed_experts"]
    assert slot["shape"] == envelope["shape"] and slot["dtype"] == envelope["dtype"]
    assert len(slot["data"]) < 16  # a placeholder, not the base64 text
    view = parsed.payload(slot["data"], "data")
    assert isinstance(view, memoryview) and view.obj is body
    assert bytes(view) == envelope["data"].encode()


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


def _random_body(rng: random.Random, n_choices: int) -> tuple[dict, list[np.ndarray]]:
    choices, expected = [], []
    for i in range(n_choices):
        routes = distinct_routes(rng.randint(0, 6), rng.randint(1, 3), 2, rng.choice([8, 300]), seed=i)
        expected.append(routes)
        choice = {
            "index": i,
            "text": rng.choice(TRICKY_STRINGS),
            "token_ids": [rng.randint(0, 99) for _ in range(rng.randint(0, 5))],
            "routed_experts": encode_routes(routes),
            "finish_reason": rng.choice(["stop", "length", None]),
        }
        keys = list(choice)
        rng.shuffle(keys)
        choices.append({k: choice[k] for k in keys})
        keys = ["dtype", "shape", "data"]
        rng.shuffle(keys)
        choice["routed_experts"] = {k: choice["routed_experts"][k] for k in keys}
    body = {"id": rng.choice(TRICKY_STRINGS), "choices": choices, "note": {"k": rng.choice(TRICKY_STRINGS)}}
    return body, expected


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n_choices=st.integers(1, 3), indent=st.sampled_from([None, 0, 2, "\t"]),
       ensure_ascii=st.booleans(), compact=st.booleans())  # fmt: skip
@pytest.mark.parametrize("mode", MODES)
def test_body_parsing_matches_naive_json_loads(mode, seed, n_choices, indent, ensure_ascii, compact):
    rng = random.Random(seed)
    body, expected = _random_body(rng, n_choices)
    separators = (",", ":") if compact else (" , ", " :\n ")
    text = json.dumps(body, indent=indent, ensure_ascii=ensure_ascii, separators=separators).encode()
    reference = json.loads(text)
    with parser(mode) as parse:
        parsed = parse(text)
    for i, choice in enumerate(parsed.value["choices"]):
        envelope = dict(choice["routed_experts"])
        envelope["data"] = parsed.payload(envelope["data"], "data")
        decoded = decode_routes(envelope)
        np.testing.assert_array_equal(decoded, expected[i])
        np.testing.assert_array_equal(decoded, naive_decode(reference["choices"][i]["routed_experts"]))
        choice["routed_experts"]["data"] = reference["choices"][i]["routed_experts"]["data"]
    assert parsed.restore() == reference  # everything else is parsed exactly as json.loads does


@pytest.mark.parametrize("rows", [40, 13_000])  # the large one is decoded by the decoding parse
@pytest.mark.parametrize("mode", MODES)
def test_escaped_slashes_in_a_payload_are_unescaped(mode, rows):
    routes = distinct_routes(rows, 2, 2, 256, seed=1)
    envelope = encode_routes(routes)
    assert "/" in envelope["data"]
    text = json.dumps({"routed_experts": envelope}).replace("/", "\\/").encode()
    with parser(mode) as parse:
        parsed = parse(text)
    data = parsed.payload(parsed.value["routed_experts"]["data"], "data")
    assert isinstance(data, str)
    np.testing.assert_array_equal(decode_routes({**envelope, "data": data}), routes)


@pytest.mark.parametrize("mode", MODES)
def test_unspliced_and_restored_payloads(mode):
    # an escaped key name is not recognised by the scanner: the value arrives as a plain str
    text = (
        b'{"d\\u0061ta": "QUJD", "x": {"data": "QUJD", "routed_experts": null}, "y": "\\"data\\": \\"Zm9v"}'
    )
    with parser(mode) as parse:
        parsed = parse(text)
    assert parsed.payload(parsed.value["data"], "data") == "QUJD"
    assert parsed.restore() == json.loads(text)
    with pytest.raises(MalformedResponseError, match="field: expected a base64 string, got int"):
        parsed.payload(3, "field")


@pytest.mark.parametrize(
    "text, message",
    [
        (b'{"data": "QUJD', "unterminated string"),
        (b'{"data": "QUJD" "x"}', "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"choices": [}', "not valid JSON"),
        (b'{"data": "QU\\qJD"}', "invalid JSON string"),
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_invalid_bodies(mode, text, message):
    with parser(mode) as parse, pytest.raises(MalformedResponseError, match=message):
        parsed = parse(text)
        parsed.payload(parsed.value["data"], "data")


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 1 << 19])
def test_body_scan_is_exact_at_every_step_size(chunk, monkeypatch):
    monkeypatch.setattr("r3lightning.wire.json_body._SCAN_CHUNK", chunk)
    routes = distinct_routes(9, 2, 2, 256, seed=1)
    envelope = encode_routes(routes)
    assert "/" in envelope["data"]
    plain = json.dumps({"a": 'x \\" y', "routed_experts": envelope, "z": "\\"})
    escaped = plain.replace("/", "\\/")
    for text in (plain, escaped):
        parsed = parse_body(text.encode())
        data = parsed.payload(parsed.value["routed_experts"]["data"], "data")
        assert isinstance(data, str if text is escaped else memoryview)
        np.testing.assert_array_equal(decode_routes({**envelope, "data": data}), routes)
        parsed.value["routed_experts"]["data"] = envelope["data"]
        assert parsed.restore() == json.loads(text)
    for text, message in [(b'{"data": "QUJD', "unterminated"), (b'{"data": "QU\\"', "unterminated")]:
        with pytest.raises(MalformedResponseError, match=message):
            parse_body(text)


# ------------------------------------------------------------------ the decoding parse at full size

BIG = 200_000  # decoded bytes of a large payload: 267 KB of base64, above the 64 KiB threshold


def big_routes(seed: int, rows: int = BIG // 16) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = np.stack([rng.permutation(256)[:8] for _ in range(64)])
    return base[rng.integers(0, 64, (rows, 2))].astype(np.uint8)  # [rows, 2, 8]


def test_a_large_payload_is_decoded_during_the_parse_while_a_helper_reads_the_json():
    routes = big_routes(0)
    envelope = encode_routes(routes)
    body = json.dumps({"choices": [{"token_ids": [1, 2], "routed_experts": envelope}]}).encode()
    seen = []

    def fields(parsed):
        seen.append((threading.current_thread().name, parsed.value["choices"][0]["token_ids"]))
        return "fields"

    parsed, outcome = parse_body_with(body, fields, decode=True)
    assert outcome == "fields" and seen[0][1] == [1, 2]
    if json_body.helper_pool() is not None:
        assert seen[0][0].startswith("r3-decode")  # the JSON was read off this thread
    payload = parsed.payload(parsed.value["choices"][0]["routed_experts"]["data"], "data")
    assert isinstance(payload, DecodedPayload)
    assert bytes(payload.raw) == base64.b64decode(envelope["data"])
    np.testing.assert_array_equal(decode_routes({**envelope, "data": payload}), routes)
    exact = parse_body(body)  # without decode: a view of the base64 text, as before
    assert isinstance(exact.payload(exact.value["choices"][0]["routed_experts"]["data"], "d"), memoryview)


def _wrong_guess_bodies() -> dict[str, bytes]:
    """Bodies whose large payload is followed by something the end guess can mistake for it."""
    one, two = (encode_routes(big_routes(seed)) for seed in (1, 2))
    long_base64_tail = "QUJD" * 20_000  # a clean run after the payload, then JSON again
    return {
        "two payloads": {"choices": [{"routed_experts": one}, {"routed_experts": two}]},
        "long tail of numbers": {"routed_experts": one, "logprobs": [-0.5] * 60_000},
        "base64-like tail string": {"routed_experts": one, "note": long_base64_tail, "k": [1]},
        "large text in a payload key": {"data": "not base64 at all " * 5_000, "routed_experts": one},
        "padding inside": {"routed_experts": {**one, "data": one["data"][:-8] + "AA==" + one["data"][-4:]}},
        "escaped payload": {"x": 1, "routed_experts": {**one, "data": one["data"].replace("/", "\\/")}},
    }


@pytest.mark.parametrize("name", list(_wrong_guess_bodies()))
def test_wrong_guesses_and_bad_payloads_match_the_exact_parse(name):
    body = _wrong_guess_bodies()[name]
    text = json.dumps(body).replace("\\\\/", "\\/").encode()
    reference = json.loads(text)
    calls = []
    parsed, _ = parse_body_with(text, calls.append, decode=True)
    assert 1 <= len(calls) <= 2  # a wrong guess reruns ``then`` on the exact parse

    def walk(node, ref):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in json_body.PAYLOAD_KEYS and isinstance(value, str) and value != ref[key]:
                    payload = parsed.payload(value, key)
                    try:
                        decoded = base64.b64decode(ref[key], validate=True)
                    except ValueError:  # not base64: the parse must not have decoded it either
                        assert not isinstance(payload, DecodedPayload)
                        assert payload_text(payload) == ref[key].encode()
                    else:
                        assert (
                            bytes(
                                payload.raw
                                if isinstance(payload, DecodedPayload)
                                else base64.b64decode(payload_text(payload))
                            )
                            == decoded
                        )
                    node[key] = ref[key]
                else:
                    walk(value, ref[key])
        elif isinstance(node, list):
            for item, ref_item in zip(node, ref, strict=True):
                walk(item, ref_item)

    walk(parsed.value, reference)
    assert parsed.restore() == reference


def test_a_span_with_invalid_base64_is_reported_by_its_decoder():
    envelope = encode_routes(big_routes(3))
    bad = {**envelope, "data": envelope["data"][:1000] + "-" + envelope["data"][1001:]}  # same length
    parsed = parse_body(json.dumps({"routed_experts": bad}).encode(), decode=True)
    payload = parsed.payload(parsed.value["routed_experts"]["data"], "routed_experts.data")
    assert isinstance(payload, memoryview)  # the guessed span was right: kept as text
    with pytest.raises(MalformedResponseError, match=r"routed_experts\.data: invalid base64"):
        decode_array({**bad, "data": payload}, field="routed_experts")


def test_then_errors_propagate_and_unused_decodes_are_dropped():
    envelope = encode_routes(big_routes(4))
    body = json.dumps({"choices": [{"routed_experts": envelope}]}).encode()

    def refuse(parsed):
        raise MalformedResponseError("choices[0].token_ids: missing")

    with pytest.raises(MalformedResponseError, match="token_ids: missing"):
        parse_body_with(body, refuse, decode=True)
    parsed = parse_body(body, decode=True)
    parsed.discard(parsed.value["choices"][0]["routed_experts"]["data"])
    assert parsed._decoded == {}  # a discarded slot's bytes are let go at once
    assert parsed.restore()["choices"][0]["routed_experts"]["shape"] == envelope["shape"]


# ------------------------------------------------------------------ decoders given decoded payloads


def test_decoders_take_decoded_payloads_and_check_their_size():
    routes = distinct_routes(30, 3, 2, 40, seed=5).astype(np.uint8)
    envelope = encode_routes(routes)
    raw = bytearray(base64.b64decode(envelope["data"]))
    np.testing.assert_array_equal(decode_routes({**envelope, "data": DecodedPayload(raw)}), routes)
    with pytest.raises(MalformedResponseError, match="holds 179 bytes but the shape and dtype need 180"):
        decode_array({**envelope, "data": DecodedPayload(raw[:-1])}, field="r")
    with pytest.raises(MalformedResponseError, match="exceeds the cap of 100 bytes"):
        decode_array({**envelope, "data": DecodedPayload(raw)}, max_bytes=100, field="r")

    flat = bytearray(base64.b64decode(encode_flat_routes(routes)))
    np.testing.assert_array_equal(decode_flat_routes(DecodedPayload(flat), num_layers=3, top_k=2), routes)
    with pytest.raises(MalformedResponseError, match="not a whole number of int32 rows"):
        decode_flat_routes(DecodedPayload(flat[:-4]), num_layers=3, top_k=2)

    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    npy = bytearray(buffer.getvalue())
    np.testing.assert_array_equal(decode_npy_routes(DecodedPayload(npy), num_layers=3, top_k=2), routes)
    with pytest.raises(MalformedResponseError, match=r"too short for a \.npy header"):
        decode_npy_routes(DecodedPayload(npy[:20]))
    with pytest.raises(MalformedResponseError, match="holds 307 bytes but the shape and dtype need 308"):
        decode_npy_routes(DecodedPayload(npy[:-1]))


@pytest.mark.parametrize("pool", ["single core", "interpreter shutting down"])
def test_the_decoding_parse_runs_on_the_callers_thread_without_a_usable_helper(pool, monkeypatch):
    refusing = ThreadPoolExecutor(1)
    refusing.shutdown()  # submit() now raises RuntimeError, as at interpreter exit
    monkeypatch.setattr(json_body, "helper_pool", lambda: None if pool == "single core" else refusing)
    envelope = encode_routes(big_routes(5))
    body = json.dumps({"choices": [{"token_ids": [1], "routed_experts": envelope}]}).encode()
    names = []
    parsed, _ = parse_body_with(body, lambda p: names.append(threading.current_thread().name), decode=True)
    assert names == [threading.current_thread().name]
    payload = parsed.payload(parsed.value["choices"][0]["routed_experts"]["data"], "data")
    assert isinstance(payload, DecodedPayload)
    assert bytes(payload.raw) == base64.b64decode(envelope["data"])


def _parse_in_child(body: bytes, queue) -> None:
    parsed, name = parse_body_with(body, lambda p: threading.current_thread().name, decode=True)
    queue.put((name, len(parsed.payload(parsed.value["routed_experts"]["data"], "d").raw)))


@run_if(fork=True)
def test_a_forked_child_gets_its_own_helper_threads():
    """A data loader worker forked after the parent used the helper: the parent's thread does not
    exist in the child, so a pool inherited as is would never run the JSON job (a hang)."""
    envelope = encode_routes(big_routes(6))
    body = json.dumps({"routed_experts": envelope}).encode()
    parse_body_with(body, lambda p: None, decode=True)  # the parent's pool is up
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_parse_in_child, args=(body, queue))
    child.start()
    try:
        name, size = queue.get(timeout=60)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert size == len(base64.b64decode(envelope["data"]))
    if json_body.helper_pool() is not None:
        assert name.startswith("r3-decode")
