"""The client's response parse (r3lightning.wire.response) for every engine's layout, against
references decoded with the standard library (base64, json, np.load)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from route_samples import distinct_routes, naive_decode

from r3lightning.rollout.trajectory import Trajectory
from r3lightning.wire import json_body
from r3lightning.wire.codec import encode_routes
from r3lightning.wire.errors import MalformedResponseError
from r3lightning.wire.request import RouteSchema
from r3lightning.wire.response import parse_response

LAYERS, TOP_K, EXPERTS = 6, 4, 300
IDS = [5, 6, 7]  # G = 3 response tokens
LAYOUTS = ["skyrl", "vllm", "sglang", "openai vllm", "openai sglext"]


def npy_b64(routes: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def body_of(layout: str, routes: np.ndarray, npy_dtype: str = "<u2") -> tuple[str, bytes]:
    """(client protocol, body) with ``routes`` in the layout's own field and encoding."""
    flat = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    npy = npy_b64(routes.astype(npy_dtype))
    choice = {"token_ids": IDS, "finish_reason": "stop", "logprobs": None}
    bodies = {
        "skyrl": ("skyrl", {"choices": [{**choice, "routed_experts": encode_routes(routes)}]}),
        "vllm": ("vllm", {"choices": [{**choice, "routed_experts": npy}]}),
        "sglang": (
            "sglang",
            {"output_ids": IDS, "meta_info": {"finish_reason": "stop", "routed_experts": flat}},
        ),
        "openai vllm": ("openai", {"choices": [{**choice, "routed_experts": npy}]}),
        "openai sglext": ("openai", {"choices": [choice], "sglext": {"routed_experts": flat}}),
    }
    protocol, body = bodies[layout]
    return protocol, json.dumps(body).encode()


def reference_routes(layout: str, body: bytes) -> np.ndarray:
    """The routes of ``body`` by json.loads, base64 and np.load / np.frombuffer."""
    value = json.loads(body)
    if layout == "skyrl":
        return naive_decode(value["choices"][0]["routed_experts"])
    if layout.endswith("sglext") or layout == "sglang":
        text = (
            value["sglext"]["routed_experts"] if "sglext" in value else value["meta_info"]["routed_experts"]
        )
        return np.frombuffer(base64.b64decode(text), "<i4").reshape(-1, LAYERS, TOP_K)
    return np.load(io.BytesIO(base64.b64decode(value["choices"][0]["routed_experts"])), allow_pickle=False)


def good_routes(rows: int, seed: int = 3) -> np.ndarray:
    routes = distinct_routes(rows, LAYERS, TOP_K, EXPERTS, seed=seed)
    routes[:, :2] = 0  # two dense layers: all-zero rows
    return routes


@pytest.mark.parametrize("cut_min", [0, 1 << 30])  # payload cut from the body, or parsed by orjson
@pytest.mark.parametrize("start", [0, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_parses_to_the_reference_rows(layout, start, cut_min, monkeypatch):
    monkeypatch.setattr(json_body, "_CUT_MIN", cut_min)
    prompt_len = 40
    routes = good_routes(prompt_len - start + len(IDS) - 1)  # rows cover [start, P + G - 1)
    protocol, body = body_of(layout, routes)
    result = parse_response(
        body,
        protocol,
        RouteSchema(LAYERS, TOP_K, EXPERTS),
        want_routes=True,
        prompt_len=prompt_len,
        start=start,
    )
    reference = reference_routes(layout, body)
    np.testing.assert_array_equal(result.routed_experts, reference)
    np.testing.assert_array_equal(result.routed_experts, routes)
    # compact host dtypes: the envelope's own, uint16 .npy as int16, flat int32 compacted
    assert result.routed_experts.dtype == np.int16
    assert result.response_ids == IDS and result.stop_reason == "stop"
    raw = result.raw_response  # the route payload is never kept there
    slot = {"skyrl": raw.get("choices", [{}])[0].get("routed_experts"), "sglang": raw.get("meta_info")}
    slot = {**slot, "openai sglext": raw.get("sglext")}.get(layout, raw.get("choices", [{}])[0])
    assert slot["data" if layout == "skyrl" else "routed_experts"] is None
    with pytest.raises(MalformedResponseError, match=rf"{len(routes)} route rows, expected P - start \+ G - 1 = "
                       rf"41 - {start} \+ 3 - 1 = {len(routes) + 1} \(rows cover positions"):  # fmt: skip
        parse_response(
            body, protocol, RouteSchema(LAYERS, TOP_K), want_routes=True, prompt_len=41, start=start
        )


@pytest.mark.parametrize(
    ("npy_dtype", "high", "expected"),
    [("<u1", 255, np.uint8), ("<u2", 300, np.int16), ("<u2", 40_000, np.int32)],
)
def test_npy_dtypes_become_host_dtypes(npy_dtype, high, expected):
    routes = distinct_routes(9, LAYERS, TOP_K, 250, seed=1)
    routes[4, 3] = [high, 1, 2, 3]
    protocol, body = body_of("vllm", routes, npy_dtype)
    result = parse_response(body, protocol, RouteSchema(LAYERS, TOP_K), want_routes=True)
    assert result.routed_experts.dtype == expected
    np.testing.assert_array_equal(result.routed_experts, routes)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("row", "edit"), [(0, "repeat"), (200, "repeat"), (399, "repeat"), (57, "range")])
def test_a_bad_row_anywhere_is_reported_with_the_url(layout, row, edit):
    routes = good_routes(400)  # 19 KB of uint16 ids: a payload cut from the body
    layer = 4
    if edit == "repeat":
        routes[row, layer, 3] = routes[row, layer, 1]
        message = f"row {row} layer {layer} repeats an expert: {routes[row, layer].tolist()}"
    else:
        routes[row, layer, 3] = EXPERTS + 3
        message = f"expert id {EXPERTS + 3} is out of range for num_experts={EXPERTS}"
    protocol, body = body_of(layout, routes, "<u2")
    schema = RouteSchema(LAYERS, TOP_K, EXPERTS, check_unique=True)
    url = "http://127.0.0.1:9/generate"
    with pytest.raises(MalformedResponseError) as caught:
        parse_response(body, protocol, schema, want_routes=True, url=url)
    assert str(caught.value).endswith(f"{message} (response from {url})")
    if edit == "repeat":  # without check_unique the parse passes them, and the Trajectory refuses them
        result = parse_response(body, protocol, RouteSchema(LAYERS, TOP_K, EXPERTS), want_routes=True)
        with pytest.raises(ValueError, match=rf"Trajectory\.routed_experts: {message}".replace("[", r"\[")):
            Trajectory(list(range(1, 402 - len(IDS))), IDS, routed_experts=result.routed_experts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_absent_routes_name_the_engine_flag_and_unwanted_ones_are_not_decoded(layout):
    protocol, body = body_of(layout, good_routes(3))
    value = json.loads(body)
    for container in (value.get("meta_info"), value.get("sglext"), *value.get("choices", [])):
        if isinstance(container, dict) and "routed_experts" in container:
            container["routed_experts"] = None
    with pytest.raises(MalformedResponseError, match=r"routes were requested but the field is (null|missing); .*"
                       r"--enable-return-routed-experts"):  # fmt: skip
        parse_response(json.dumps(value).encode(), protocol, RouteSchema(LAYERS, TOP_K), want_routes=True)
    garbage = body.replace(b'"routed_experts": "', b'"routed_experts": "!!!!')
    garbage = garbage.replace(b'"data": "', b'"data": "!!!!')
    result = parse_response(garbage, protocol, RouteSchema(LAYERS, TOP_K), want_routes=False)
    assert result.routed_experts is None and result.response_ids == IDS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_payloads_with_escaped_slashes_parse_like_plain_ones(layout):
    routes = good_routes(400)  # long enough to be cut from the body
    protocol, body = body_of(layout, routes)
    assert b"/" in body
    escaped = body.replace(b"/", b"\\/")
    schema = RouteSchema(LAYERS, TOP_K, EXPERTS)
    result = parse_response(escaped, protocol, schema, want_routes=True, prompt_len=400 - len(IDS) + 1)
    np.testing.assert_array_equal(result.routed_experts, routes)
    broken = escaped.replace(b"\\/", b"\\*", 1)  # not a JSON escape: the decode's error is reported
    with pytest.raises(MalformedResponseError, match="base64"):
        parse_response(broken, protocol, schema, want_routes=True)


def test_absurd_shape_through_the_parse_is_malformed():
    envelope = {"data": "", "shape": [2**63, 2, 0], "dtype": "uint8"}
    body = json.dumps({"choices": [{"token_ids": [1], "routed_experts": envelope}]}).encode()
    with pytest.raises(MalformedResponseError, match=r"routed_experts: shape \[9223372036854775808, 2, 0\]"):
        parse_response(body, "skyrl", RouteSchema(), want_routes=True)


def test_other_choices_routes_are_dropped_unread():
    routes = good_routes(5)
    second = {"token_ids": [9], "routed_experts": {"data": "!not base64!", "shape": [1], "dtype": "uint8"}}
    protocol, body = body_of("skyrl", routes)
    value = json.loads(body)
    value["choices"].append(second)
    result = parse_response(
        json.dumps(value).encode(), protocol, RouteSchema(LAYERS, TOP_K), want_routes=True
    )
    np.testing.assert_array_equal(result.routed_experts, routes)
    assert result.raw_response["choices"][1]["routed_experts"] == {
        "data": None,
        "shape": [1],
        "dtype": "uint8",
    }
    assert result.raw_response["choices"][0]["routed_experts"]["data"] is None
