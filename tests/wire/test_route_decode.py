"""The fused base64 decode and route check (rollout/route_decode.py) against independent references.

Decoded bytes are compared with the standard library's base64, row verdicts with a sort-based
numpy reference, errors with what pybase64 raises on the same text. Payloads are at least 64 KiB
of text (shorter ones skip the kernel) and vary in length so that every tail length, padding and
the rows on both sides of the kernel's last step are covered.
"""

from __future__ import annotations

import base64
import binascii
import io
import json

import numpy as np
import pybase64
import pytest
from route_samples import distinct_routes

from r3lightning import MalformedResponseError
from r3lightning.wire import codec as wire
from r3lightning.wire import response as client_response
from r3lightning.wire import route_check, route_decode
from r3lightning.wire.codec import decode_flat_routes, decode_npy_routes, decode_routes, encode_routes
from r3lightning.wire.request import RouteSchema
from r3lightning.wire.response import parse_response
from r3lightning.wire.route_decode import DecodedPayload, RowCheck, decode_payload, fused_decode_available

needs_kernel = pytest.mark.skipif(not fused_decode_available(), reason="needs x86 with AVX-512 VBMI")

MIN_BYTES = (1 << 16) // 4 * 3  # the smallest payload the kernel takes (64 KiB of text)
STEP_BYTES = 192  # bytes the kernel decodes per step of 256 characters

# (dtype, top_k): every row layout of 8 to 64 bytes the vector check covers, in each id width
LAYOUTS = [
    ("u1", 8),
    ("u1", 16),
    ("u1", 32),
    ("u1", 64),
    ("<i2", 4),
    ("<i2", 8),
    ("<u2", 8),
    ("<i2", 32),
    ("<i4", 2),
    ("<i4", 8),
    ("<i4", 16),
]


def kernel_steps(nbytes: int) -> int:
    """Steps the kernel decodes for a payload of ``nbytes`` (the rest goes to pybase64)."""
    chars = -(-nbytes // 3) * 4
    return (chars - 4) // 256


def reference_verdict(ids: np.ndarray, num_experts: int | None) -> tuple[bool, int]:
    """(rows valid, largest id read unsigned) by sorting each row: in range (non-negative and below
    num_experts) and no two equal ids in a row that is not all zero."""
    rows = ids.reshape(-1, ids.shape[-1]).astype(np.int64)
    in_range = bool((rows >= 0).all()) and (num_experts is None or int(rows.max()) < num_experts)
    ordered = np.sort(rows, axis=1)
    repeats = ((ordered[:, 1:] == ordered[:, :-1]).any(axis=1) & rows.any(axis=1)).any()
    unsigned = ids.view(f"u{ids.dtype.itemsize}")
    return in_range and not repeats, int(unsigned.max())


def routes_payload(dtype: str, top_k: int, rows: int, seed: int = 0) -> np.ndarray:
    """``[rows, top_k]`` distinct ids below 100 in ``dtype`` (fits every width)."""
    return distinct_routes(rows, 1, top_k, 100, seed=seed).reshape(rows, top_k).astype(dtype)


# ----------------------------------------------------------------------------- the decode


@needs_kernel
@pytest.mark.parametrize("extra", [0, 1, 2, 3, 63, 64, 190, 191, 192, 193, 194, 383, 384, 385, 1000, 12_345])
def test_decode_matches_the_standard_library(extra):
    data = np.random.default_rng(extra).integers(0, 256, MIN_BYTES + extra, dtype=np.uint8).tobytes()
    text = base64.b64encode(data)
    payload = decode_payload(memoryview(text))
    assert isinstance(payload.raw, np.ndarray)  # the kernel ran (pybase64 gives a bytearray)
    assert payload.raw.tobytes() == base64.b64decode(text, validate=True)
    assert payload.raw.ctypes.data % 64 == 0 and payload.raw.flags.writeable
    assert payload.checked is None


def test_without_the_kernel_pybase64_decodes_and_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(route_decode, "fused_decode_available", lambda: False)
    routes = routes_payload("u1", 8, MIN_BYTES // 8 + 3)
    text = base64.b64encode(routes.tobytes())
    payload = decode_payload(text, RowCheck.of(routes.dtype, 8, 128))
    assert isinstance(payload.raw, bytearray) and bytes(payload.raw) == routes.tobytes()
    assert payload.checked is None


def test_short_payloads_and_str_go_to_pybase64():
    routes = routes_payload("u1", 8, 100)
    text = base64.b64encode(routes.tobytes())
    for given in (text, text.decode()):
        payload = decode_payload(given, RowCheck.of(routes.dtype, 8, 128))
        assert isinstance(payload.raw, bytearray) and payload.checked is None


BAD_CHARACTERS = [
    b"=",
    b"\n",
    b" ",
    b"-",
    b"_",
    b"*",
    b"\x00",
    b"\x80",
    b"\xc1",
    b"\xff",
]  # \xc1 & 0x7f = "A"


@needs_kernel
@pytest.mark.parametrize("character", BAD_CHARACTERS, ids=repr)
@pytest.mark.parametrize("where", ["start", "middle", "last step", "tail", "last"])
def test_invalid_base64_raises_what_pybase64_raises(character, where):
    text = bytearray(base64.b64encode(bytes(range(256)) * (MIN_BYTES // 256 + 2)))
    steps_end = kernel_steps(len(text) // 4 * 3) * 256
    at = {"start": 0, "middle": len(text) // 2, "last step": steps_end - 1, "tail": steps_end + 1}.get(
        where, len(text) - 3
    )
    text[at : at + 1] = character
    with pytest.raises(binascii.Error):
        base64.b64decode(bytes(text), validate=True)  # the input really is invalid
    with pytest.raises((binascii.Error, ValueError)) as expected:
        pybase64.b64decode(bytes(text), validate=True)
    with pytest.raises(type(expected.value)) as raised:
        decode_payload(memoryview(bytes(text)), RowCheck.of(np.uint8, 8, None))
    assert str(raised.value) == str(expected.value)


@needs_kernel
@pytest.mark.parametrize(
    "text", [b"QUJD" * 20_000 + b"QQ", b"QUJD" * 20_000 + b"QQ=", b"QUJD" * 20_000 + b"Q===="]
)
def test_bad_lengths_and_padding_raise_what_pybase64_raises(text):
    with pytest.raises((binascii.Error, ValueError)) as expected:
        pybase64.b64decode(text, validate=True)
    with pytest.raises(type(expected.value), match=str(expected.value)):
        decode_payload(text)


# ----------------------------------------------------------------------------- the row check


def edited(routes: np.ndarray, edit: str, row: int) -> np.ndarray:
    routes = routes.copy()
    if edit == "repeat":
        routes[row, -1] = routes[row, 0]
    elif edit == "zero row":  # dense-layer filler: valid
        routes[row] = 0
    elif edit == "zero pair":  # two zeros in a row that is not all zero: a repeat
        routes[row, :2] = 0
    elif edit == "out of range":
        routes[row, 1] = 100
    elif edit == "negative":
        routes[row, 1] = -1
    return routes


EDITS = ["none", "repeat", "zero row", "zero pair", "out of range", "negative"]


@needs_kernel
@pytest.mark.parametrize(
    ("dtype", "top_k", "edit"),
    [(d, k, e) for d, k in LAYOUTS for e in EDITS if not (e == "negative" and np.dtype(d).kind == "u")],
)
@pytest.mark.parametrize("rows_from", [0, 128])
@pytest.mark.parametrize("where", ["first", "first step", "middle", "last step", "tail"])
def test_row_check_matches_a_reference(dtype, top_k, edit, rows_from, where):
    row_bytes = top_k * np.dtype(dtype).itemsize
    rows = (MIN_BYTES + 4 * STEP_BYTES) // row_bytes + len(where) % 5  # varied tails
    routes = routes_payload(dtype, top_k, rows, seed=rows_from + len(edit))
    tail_row = (kernel_steps(rows_from + rows * row_bytes) * STEP_BYTES - rows_from) // row_bytes
    row = {
        "first": 0,
        "first step": (STEP_BYTES + STEP_BYTES // 2 - rows_from) // row_bytes,
        "middle": rows // 2,
        "last step": tail_row - 1,
        "tail": rows - 1,
    }[where]
    routes = edited(routes, edit, row)
    header = (
        np.random.default_rng(1).integers(0, 3, rows_from, dtype=np.uint8).tobytes()
    )  # repeats: unchecked
    text = base64.b64encode(header + routes.tobytes())
    num_experts = 100
    payload = decode_payload(memoryview(text), RowCheck.of(routes.dtype, top_k, num_experts), rows_from)
    assert payload.raw.tobytes() == header + routes.tobytes()
    valid, largest = reference_verdict(routes, num_experts)
    assert (payload.checked is not None) == valid
    if valid:
        assert payload.checked == RowCheck.of(routes.dtype, top_k, num_experts)
        assert (payload.rows_from, payload.largest) == (rows_from, largest)


@needs_kernel
@pytest.mark.parametrize("num_experts", [None, 1 << 20])
def test_row_check_without_a_bound_still_refuses_negative_ids(num_experts):
    routes = edited(routes_payload("<i2", 8, MIN_BYTES // 16 + 9), "negative", 5)
    payload = decode_payload(base64.b64encode(routes.tobytes()), RowCheck.of(routes.dtype, 8, num_experts))
    assert payload.checked is None
    assert RowCheck.of(routes.dtype, 8, num_experts).limit == 1 << 15


@needs_kernel
@pytest.mark.parametrize(("rows_from", "extra"), [(3, 0), (8, 3), (0, 5)])
def test_rows_that_do_not_tile_the_payload_are_not_checked(rows_from, extra):
    routes = routes_payload("u1", 8, MIN_BYTES // 8 + 2)
    text = base64.b64encode(bytes(rows_from) + routes.tobytes() + bytes(extra))
    payload = decode_payload(text, RowCheck.of(routes.dtype, 8, 128), rows_from)
    assert payload.checked is None and payload.raw.tobytes() == base64.b64decode(text)


def test_row_check_covers_only_its_own_layout_and_tighter_bounds():
    check = RowCheck.of(np.uint8, 8, 128)
    routes = np.zeros((4, 3, 8), np.uint8)
    assert check.covers(routes, 128) and check.covers(routes, 200) and check.covers(routes, None)
    assert not check.covers(routes, 100)  # the decode allowed ids the caller refuses
    assert not check.covers(routes.view(np.int16)[..., :4], 128)  # another dtype
    assert not check.covers(routes.reshape(4, 6, 4), 128)  # another top_k
    assert RowCheck.of(np.uint8, 6, 128) is None and RowCheck.of(np.int64, 8, 128) is None
    assert RowCheck.of(np.uint8, None, 128) is None


# ----------------------------------------------------------------------------- the wire decoders


def claimed(
    routes: np.ndarray, num_experts: int | None, rows_from: int = 0, prefix: bytes = b""
) -> DecodedPayload:
    """A payload as the fused decode leaves it when ``routes`` passed (built by hand, so these
    tests hold on any host)."""
    raw = bytearray(prefix + routes.tobytes())
    largest = int(routes.view(f"u{routes.dtype.itemsize}").max())
    return DecodedPayload(raw, RowCheck.of(routes.dtype, routes.shape[-1], num_experts), rows_from, largest)


def test_a_covering_claim_skips_the_id_checks_but_not_the_shape(monkeypatch):
    routes = distinct_routes(50, 3, 8, 128).astype(np.uint8)
    envelope = {"shape": list(routes.shape), "dtype": "uint8"}

    def refuse(*args, **kwargs):
        raise AssertionError("the ids were checked again")

    monkeypatch.setattr(wire, "validate_routes", refuse)
    decoded = decode_routes(
        {**envelope, "data": claimed(routes, 128)}, num_experts=128, num_layers=3, top_k=8
    )
    np.testing.assert_array_equal(decoded, routes)
    with pytest.raises(MalformedResponseError, match="expected num_layers=4"):
        decode_routes({**envelope, "data": claimed(routes, 128)}, num_experts=128, num_layers=4)


def test_a_claim_under_a_looser_bound_or_another_layout_is_not_trusted():
    routes = distinct_routes(50, 3, 8, 100).astype(np.uint8)
    routes[7, 1, 2] = 120  # below the claim's bound (128), above the caller's (100)
    envelope = {"shape": list(routes.shape), "dtype": "uint8"}
    with pytest.raises(MalformedResponseError, match="expert id 120 is out of range for num_experts=100"):
        decode_routes({**envelope, "data": claimed(routes, 128)}, num_experts=100)
    # distinct as uint8 top-8 rows, but as int16 top-8 rows (two uint8 rows each) id 513 repeats
    pairs = np.array([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 10, 11, 12, 13, 14]] * 4, np.uint8).reshape(2, 4, 8)
    as_int16 = {"shape": [2, 2, 8], "dtype": "int16"}
    with pytest.raises(MalformedResponseError, match="repeats an expert"):
        decode_routes({**as_int16, "data": claimed(pairs, 128)}, num_experts=1 << 15)


def test_npy_and_flat_decoders_trust_a_claim_only_at_their_rows(monkeypatch):
    routes = distinct_routes(40, 3, 8, 128).astype(np.uint8)
    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    npy = buffer.getvalue()
    offset = len(npy) - routes.nbytes
    bad = routes.copy()
    bad[3, 2, 0] = bad[3, 2, 1]
    buffer = io.BytesIO()
    np.save(buffer, bad, allow_pickle=False)
    wrong_start = claimed(bad, 128, rows_from=0, prefix=buffer.getvalue()[:offset])
    with pytest.raises(MalformedResponseError, match="row 3 layer 2 repeats an expert"):
        decode_npy_routes(wrong_start, num_experts=128)
    monkeypatch.setattr(wire, "validate_routes", lambda *a, **k: pytest.fail("checked again"))
    right = claimed(routes, 128, rows_from=offset, prefix=npy[:offset])
    np.testing.assert_array_equal(decode_npy_routes(right, num_experts=128), routes)
    monkeypatch.setattr(wire, "check_range", lambda *a, **k: pytest.fail("range checked again"))
    monkeypatch.setattr(wire, "check_unique_rows", lambda *a, **k: pytest.fail("rows checked again"))
    flat = routes.astype("<i4")
    compact = decode_flat_routes(claimed(flat, 128), num_layers=3, top_k=8, num_experts=128)
    assert compact.dtype == np.uint8
    np.testing.assert_array_equal(compact, routes)


# ----------------------------------------------------------------------------- the client parse

LAYERS, TOP_K, EXPERTS = 48, 8, 128
RESPONSE = 16


def bodies(routes: np.ndarray) -> dict[str, tuple[str, bytes]]:
    """protocol label -> (client protocol, body), each engine's own field layout."""
    ids = list(range(1, RESPONSE + 1))
    buffer = io.BytesIO()
    np.save(buffer, routes.astype(np.uint8), allow_pickle=False)
    npy = base64.b64encode(buffer.getvalue()).decode()
    flat = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    choice = {"token_ids": ids, "finish_reason": "stop", "logprobs": None}
    layouts = {
        "skyrl": ("skyrl", {"choices": [{**choice, "routed_experts": encode_routes(routes)}]}),
        "vllm": ("vllm", {"choices": [{**choice, "routed_experts": npy}]}),
        "sglang": (
            "sglang",
            {"output_ids": ids, "meta_info": {"finish_reason": "stop", "routed_experts": flat}},
        ),
        "openai vllm": ("openai", {"choices": [{**choice, "routed_experts": npy}]}),
        "openai sglext": ("openai", {"choices": [choice], "sglext": {"routed_experts": flat}}),
    }
    return {name: (protocol, json.dumps(body).encode()) for name, (protocol, body) in layouts.items()}


ROWS = 200  # 75 KiB of uint8 routes: the kernel's size


@pytest.fixture(scope="module")
def good_routes() -> np.ndarray:
    routes = distinct_routes(ROWS, LAYERS, TOP_K, EXPERTS, seed=3)
    routes[:, :2] = 0  # two dense layers
    return routes


@needs_kernel
@pytest.mark.parametrize("name", ["skyrl", "vllm", "sglang", "openai vllm", "openai sglext"])
def test_client_parse_checks_routes_once_in_the_decode(name, good_routes, monkeypatch):
    calls = []
    monkeypatch.setattr(route_check, "compiled_check", lambda *a, **k: calls.append(a[0].shape) or None)
    protocol, body = bodies(good_routes)[name]
    schema = RouteSchema(LAYERS, TOP_K, EXPERTS)
    result = parse_response(body, protocol, schema, want_routes=True, prompt_len=ROWS - RESPONSE + 1)
    np.testing.assert_array_equal(result.routed_experts, good_routes)
    assert calls == []  # the wire decoder trusted the decode's check


@needs_kernel
@pytest.mark.parametrize("name", ["skyrl", "vllm", "sglang", "openai vllm", "openai sglext"])
@pytest.mark.parametrize(
    ("row", "edit"), [(0, "repeat"), (100, "repeat"), (ROWS - 1, "repeat"), (57, "out of range")]
)
def test_client_parse_reports_a_bad_row_anywhere(name, row, edit, good_routes):
    routes = good_routes.copy()
    layer = 30
    if edit == "repeat":
        routes[row, layer, 5] = routes[row, layer, 2]
        message = f"row {row} layer {layer} repeats an expert: {routes[row, layer].tolist()}"
    else:
        routes[row, layer, 5] = EXPERTS + 3
        message = f"expert id {EXPERTS + 3} is out of range for num_experts={EXPERTS}"
    protocol, body = bodies(routes)[name]
    with pytest.raises(MalformedResponseError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_response(body, protocol, RouteSchema(LAYERS, TOP_K, EXPERTS), want_routes=True)


@pytest.mark.parametrize(
    ("protocol", "text", "expected"),
    [
        ("skyrl", b"AAAA", (np.dtype(np.uint8), 0)),
        ("vllm", b"AAAA", (np.dtype(np.uint8), 0)),
        ("sglang", b"AAAA", (np.dtype("<i4"), 0)),
        ("openai", b"AAAA", (np.dtype("<i4"), 0)),
    ],
)
def test_the_client_expects_each_protocols_route_layout(protocol, text, expected):
    check, rows_from = client_response._expected_rows(
        protocol, RouteSchema(LAYERS, TOP_K, EXPERTS), memoryview(text)
    )
    assert (check.dtype, rows_from) == expected and check.top_k == TOP_K and check.limit == EXPERTS
    wide, _ = client_response._expected_rows("skyrl", RouteSchema(LAYERS, TOP_K, 300), memoryview(text))
    assert wide.dtype == np.dtype("<i2")  # the encoder's compact dtype above 256 experts
    buffer = io.BytesIO()
    np.save(buffer, np.zeros((3, LAYERS, TOP_K), "<u2"), allow_pickle=False)
    npy = memoryview(base64.b64encode(buffer.getvalue()))
    check, rows_from = client_response._expected_rows(protocol, RouteSchema(LAYERS, TOP_K, 300), npy)
    assert (check.dtype, rows_from) == (np.dtype("<u2"), len(buffer.getvalue()) - 3 * LAYERS * TOP_K * 2)


@needs_kernel
@pytest.mark.parametrize("bad_at", ["same stretch", "later stretch"])
def test_a_failed_row_check_still_decodes_and_validates_the_rest(bad_at):
    routes = edited(routes_payload("u1", 8, 4 * MIN_BYTES // 8), "repeat", 3)  # fails in the first stretch
    text = bytearray(base64.b64encode(routes.tobytes()))
    payload = decode_payload(bytes(text), RowCheck.of(routes.dtype, 8, 128))
    assert payload.checked is None and payload.raw.tobytes() == routes.tobytes()
    text[400 if bad_at == "same stretch" else len(text) // 2] = ord("*")
    with pytest.raises(binascii.Error, match="Non-base64 digit found"):
        decode_payload(bytes(text), RowCheck.of(routes.dtype, 8, 128))


@needs_kernel
def test_any_contiguous_buffer_is_read_as_bytes():
    data = np.random.default_rng(5).integers(0, 256, MIN_BYTES + 30, dtype=np.uint8).tobytes()
    text = base64.b64encode(data)
    for given in (memoryview(text).cast("H"), bytearray(text), np.frombuffer(text, np.uint8)):
        payload = decode_payload(given)
        assert isinstance(payload.raw, np.ndarray) and payload.raw.tobytes() == data
    strided = memoryview(np.frombuffer(text + text, np.uint8).reshape(2, -1)[:, : len(text) // 2])
    with pytest.raises((BufferError, ValueError, TypeError)):  # pybase64 refuses it, as before
        decode_payload(strided)
