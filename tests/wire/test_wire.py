"""Route wire codec: envelopes, SGLang flat routes and vLLM .npy routes vs naive references."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from route_samples import distinct_routes, naive_decode

from r3lightning import MalformedResponseError
from r3lightning.wire.codec import (
    compact_dtype,
    decode_array,
    decode_flat_routes,
    decode_npy_routes,
    decode_routes,
    encode_flat_routes,
    encode_routes,
)

NAMES = {np.uint8: "uint8", np.int16: "int16", np.int32: "int32"}


# ------------------------------------------------------------------ envelope


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 12),
    layers=st.integers(1, 4),
    top_k=st.integers(1, 4),
    num_experts=st.sampled_from([4, 200, 256, 257, 40_000]),
    source=st.sampled_from([np.int64, np.int32, np.uint16]),
    seed=st.integers(0, 2**16),
)
def test_envelope_round_trip_in_compact_dtype(rows, layers, top_k, num_experts, source, seed):
    if source is np.uint16 and num_experts > 65535:
        num_experts = 65535
    routes = distinct_routes(rows, layers, top_k, num_experts, seed).astype(source)
    envelope = encode_routes(routes)
    largest = int(routes.max(initial=0))
    expected = "uint8" if largest <= 255 else "int16" if largest <= 32767 else "int32"
    assert envelope["dtype"] == expected and envelope["shape"] == [rows, layers, top_k]
    json.dumps(envelope)  # JSON-ready as is
    decoded = decode_routes(envelope, num_experts=num_experts, num_layers=layers, top_k=top_k)
    assert decoded.dtype == np.dtype(expected) and decoded.flags.writeable and decoded.flags.c_contiguous
    np.testing.assert_array_equal(decoded, routes)
    np.testing.assert_array_equal(naive_decode(envelope), routes)
    # the same bytes as a memoryview (what the body parser hands over) decode identically
    view = {**envelope, "data": memoryview(envelope["data"].encode())}
    np.testing.assert_array_equal(decode_routes(view), routes)


def test_compact_dtype_boundaries_and_forced_dtype():
    assert [compact_dtype(m) for m in (0, 255, 256, 32767, 32768, 2**31 - 1)] == [
        np.uint8, np.uint8, np.int16, np.int16, np.int32, np.int32
    ]  # fmt: skip
    with pytest.raises(ValueError, match="does not fit in int32"):
        compact_dtype(2**31)
    routes = np.array([[[1, 2]]])
    assert encode_routes(routes, dtype="int32")["dtype"] == "int32"
    np.testing.assert_array_equal(decode_routes(encode_routes(routes, dtype="int32")), routes)
    with pytest.raises(ValueError, match="id 300 does not fit in dtype 'uint8'"):
        encode_routes(np.array([[[300, 1]]]), dtype="uint8")
    with pytest.raises(ValueError, match="unknown dtype 'int64'"):
        encode_routes(routes, dtype="int64")
    with pytest.raises(ValueError, match="non-negative"):
        encode_routes(np.array([[[-1, 2]]]))
    with pytest.raises(ValueError, match="integer array"):
        encode_routes(np.ones((1, 1, 2), dtype=np.float32))


def test_encode_accepts_torch_and_big_endian_input():
    import torch  # a dependency of the package; the codec itself needs only numpy

    routes = distinct_routes(5, 2, 3, 300)
    np.testing.assert_array_equal(decode_routes(encode_routes(torch.from_numpy(routes))), routes)
    big_endian = routes.astype(">i4")
    assert encode_routes(big_endian) == encode_routes(routes)


def test_generic_arrays_keep_their_shape():
    for shape in [(), (0,), (3,), (2, 0, 5), (2, 3, 4, 5)]:
        array = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape) % 7
        np.testing.assert_array_equal(decode_array(encode_routes(array)), array)


ENVELOPE = encode_routes(np.array([[[1, 2], [3, 4]]], dtype=np.uint8))  # 4 bytes


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dtype": "float32"}, r"routed_experts\.dtype: unknown dtype 'float32', expected one of"),
        ({"dtype": None}, r"\.dtype: unknown dtype None"),
        ({"shape": (1, 2, 2)}, r"\.shape: expected a list of non-negative ints"),
        ({"shape": [1, 2.0, 2]}, r"\.shape: expected a list"),
        ({"shape": [1, True, 2]}, r"\.shape: expected a list"),
        ({"shape": [-1, 2, 2]}, r"\.shape: expected a list"),
        ({"shape": [2, 2, 2]}, r"\.data: base64 payload holds 4 bytes but the shape and dtype need 8"),
        ({"dtype": "int16"}, r"holds 4 bytes but the shape and dtype need 8"),
        ({"data": ENVELOPE["data"][:-2]}, r"\.data: base64 length 6 is not a multiple of 4"),
        ({"data": "AQ*DBA=="}, r"\.data: invalid base64"),
        ({"data": "AQ DBA=="}, r"\.data: invalid base64"),
        ({"data": ["AQIDBA=="]}, r"\.data: expected a base64 string, got list"),
        ({"data": "AQID✓A=="}, r"\.data: invalid base64"),
        ({"data": "AQIDBA=✓"}, r"\.data: (invalid base64|base64 payload holds)"),
        ({"shape": [10**12, 64, 8], "dtype": "int32"}, r"payload of 2048000000000000 bytes exceeds the cap"),
        (
            {"shape": [1, 4], "data": ENVELOPE["data"]},
            r"expected shape \[rows, num_layers, top_k\], got \[1, 4\]",
        ),
    ],
)
def test_bad_envelopes_name_the_field(change, message):
    with pytest.raises(MalformedResponseError, match=message):
        decode_routes({**ENVELOPE, **change})


def test_missing_keys_and_non_objects():
    with pytest.raises(MalformedResponseError, match=r"missing \['shape'\]"):
        decode_routes({"data": "", "dtype": "uint8"})
    with pytest.raises(MalformedResponseError, match="expected an ndarray envelope object, got str"):
        decode_routes("AQIDBA==")


def test_size_cap_is_checked_before_allocating():
    envelope = encode_routes(np.zeros((16, 2, 1), dtype=np.uint8))  # 32 bytes
    decode_routes(envelope, max_bytes=32)
    with pytest.raises(MalformedResponseError, match="exceeds the cap of 31 bytes"):
        decode_routes(envelope, max_bytes=31)


def raw_envelope(routes: np.ndarray, dtype: str) -> dict:
    """An envelope of ``routes`` as given, negative or repeated ids included (the encoder refuses
    negative ones)."""
    data = base64.b64encode(routes.astype(np.dtype(dtype).newbyteorder("<")).tobytes()).decode()
    return {"data": data, "shape": list(routes.shape), "dtype": dtype}


def test_decoders_run_the_route_check():
    routes = np.array([[[0, 1], [2, 3]], [[0, 0], [3, 1]]], dtype=np.int16)  # row 1 layer 0: dense filler

    def decode(array, **kwargs):
        return decode_routes(raw_envelope(array, "int16"), **kwargs)

    np.testing.assert_array_equal(decode(routes, num_experts=4, num_layers=2, top_k=2), routes)
    with pytest.raises(MalformedResponseError, match="expert id 3 is out of range for num_experts=3"):
        decode(routes, num_experts=3)
    with pytest.raises(MalformedResponseError, match="num_layers=3"):
        decode(routes, num_layers=3)
    with pytest.raises(MalformedResponseError, match="top_k=1"):
        decode(routes, top_k=1)
    repeated = routes.copy()
    repeated[1, 1] = [2, 2]
    with pytest.raises(
        MalformedResponseError, match=r"^routed_experts: row 1 layer 1 repeats an expert: \[2, 2\]$"
    ):
        decode(repeated)
    np.testing.assert_array_equal(decode(repeated, check_unique=False), repeated)
    negative = routes.copy()
    negative[0, 0, 1] = -2
    with pytest.raises(MalformedResponseError, match="expert id -2 is negative"):
        decode(negative)


@pytest.mark.parametrize(
    "shape", [[2**63, 2, 0], [0, 2**40, 8], [2**31, 0]], ids=["2**63 rows", "2**40 layers", "2-d"]
)
def test_absurd_shapes_of_zero_size_are_malformed(shape):
    with pytest.raises(MalformedResponseError, match=r"\.shape|shape .* has a dimension above max_bytes="):
        decode_routes({"data": "", "shape": shape, "dtype": "uint8"})
    with pytest.raises(MalformedResponseError, match="has a dimension above max_bytes=1024"):
        decode_array({"data": "", "shape": shape, "dtype": "int32"}, max_bytes=1024)


# ------------------------------------------------------------------ SGLang flat routes


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 10), layers=st.integers(1, 3), top_k=st.integers(1, 3), seed=st.integers(0, 999))
def test_flat_routes_round_trip(rows, layers, top_k, seed):
    routes = distinct_routes(rows, layers, top_k, 300, seed)
    data = encode_flat_routes(routes)
    assert base64.b64decode(data) == routes.astype("<i4").tobytes()  # SGLang's layout
    decoded = decode_flat_routes(data, num_layers=layers, top_k=top_k, num_experts=300)
    assert decoded.shape == (rows, layers, top_k)
    assert decoded.dtype == compact_dtype(int(routes.max(initial=0)))
    np.testing.assert_array_equal(decoded, routes)
    raw = decode_flat_routes(data.encode(), num_layers=layers, top_k=top_k, compact=False)
    assert raw.dtype == np.int32
    np.testing.assert_array_equal(raw, routes)


def test_flat_route_errors():
    data = encode_flat_routes(np.arange(12).reshape(2, 3, 2))
    with pytest.raises(
        MalformedResponseError, match=r"meta_info\.routed_experts: 48 bytes is not a whole number"
    ):
        decode_flat_routes(data, num_layers=5, top_k=2)
    with pytest.raises(MalformedResponseError, match="exceeds the cap of 40 bytes"):
        decode_flat_routes(data, num_layers=3, top_k=2, max_bytes=40)
    with pytest.raises(MalformedResponseError, match="out of range for num_experts=11"):
        decode_flat_routes(data, num_layers=3, top_k=2, num_experts=11)
    with pytest.raises(MalformedResponseError, match="expected a base64 string, got NoneType"):
        decode_flat_routes(None, num_layers=3, top_k=2)
    with pytest.raises(ValueError, match="num_layers must be a positive integer or None, got 0"):
        decode_flat_routes(data, num_layers=0, top_k=2)
    with pytest.raises(ValueError, match="top_k must be a positive integer or None, got True"):
        decode_flat_routes(data, num_layers=3, top_k=True)


def test_uint16_envelopes_decode_to_int16_or_int32():
    routes = distinct_routes(6, 2, 2, 300, seed=3)
    envelope = encode_routes(routes, dtype="uint16")
    assert envelope["dtype"] == "uint16"
    decoded = decode_routes(envelope, num_experts=300)
    assert decoded.dtype == np.int16  # a view: torch has few uint16 operations
    np.testing.assert_array_equal(decoded, routes)
    wide = np.array([[[40000, 7]]], dtype=np.int64)
    decoded = decode_routes(encode_routes(wide, dtype="uint16"))
    assert decoded.dtype == np.int32 and decoded.tolist() == [[[40000, 7]]]
    assert compact_dtype(40000) == np.int32  # never compacted to uint16 on the host


# ------------------------------------------------------------------ vLLM .npy routes


def npy_b64(array: np.ndarray, version: tuple[int, int] | None = None) -> str:
    buffer = io.BytesIO()
    if version is None:
        np.save(buffer, array, allow_pickle=False)
    else:
        np.lib.format.write_array(buffer, array, version=version, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 9),
    layers=st.integers(1, 3),
    top_k=st.integers(1, 4),
    num_experts=st.sampled_from([8, 256, 300, 40_000, 65_535]),
    version=st.sampled_from([None, (1, 0), (2, 0), (3, 0)]),
    seed=st.integers(0, 999),
)
def test_npy_routes_round_trip_against_np_load(rows, layers, top_k, num_experts, version, seed):
    routes = distinct_routes(rows, layers, top_k, num_experts, seed)
    dtype = "<u1" if num_experts <= 256 else "<u2"  # vLLM's RoutedExpertsCapturer.output_dtype
    data = npy_b64(routes.astype(dtype), version)
    reference = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    decoded = decode_npy_routes(data, num_experts=num_experts, num_layers=layers, top_k=top_k)
    np.testing.assert_array_equal(decoded, reference)
    if dtype == "<u1":
        assert decoded.dtype == np.uint8
    else:  # int16 while every id fits, else int32: torch has few uint16 operations
        assert decoded.dtype == (np.int32 if routes.size and routes.max() >= 32768 else np.int16)
    view = decode_npy_routes(memoryview(data.encode()), num_experts=num_experts)  # what the body parser gives
    np.testing.assert_array_equal(view, reference)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("{'descr': '|u1', 'fortran_order': False, 'shape': (2**70, 0, 8), }", "unreadable .npy header"),
        (
            "{'descr': '|u1', 'fortran_order': False, 'shape': (1180591620717411303424, 0, 8), }",
            "has a dimension above",
        ),
        ("{'descr': '|u1', 'fortran_order': False, 'shape': (4, 2**3, 1), }", "unreadable"),
        (
            "{'descr': '|u1', 'fortran_order': False, 'shape': (-1, 2, 8), }",
            "shape must be a tuple of non-negative",
        ),
        (
            "{'descr': '|u1', 'fortran_order': False, 'shape': (4, 2, 8), 'x': 1}",
            "unreadable .npy header .*correct keys",
        ),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 2, 8), }", "is not a route dtype"),
    ],
)
def test_npy_headers_are_checked_before_the_payload_is_decoded(header, message):
    text = header.encode() + b" " * (-(len(header) + 11) % 64) + b"\n"
    raw = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text
    with pytest.raises(MalformedResponseError, match=f"^choices\\[0\\]\\.routed_experts: .*{message}"):
        decode_npy_routes(base64.b64encode(raw).decode())
