"""Wire decode: a generate response carrying one trajectory's routes, decoded several ways.

The body is a ``skyrl`` response whose ``routed_experts`` envelope holds ``[rows, 48, 8]`` int16
routes (32k rows: 24 MiB raw, 32 MiB of base64) next to 1024 response token ids with logprobs.
Arms, timed side by side in one run (each arm's repeats back to back, see ``time_arms``):

- floor: ``pybase64.b64decode`` of the payload bytes alone (already cut out of the body);
- the client's codec (``r3lightning.wire.codec``): ``parse_body(decode=True)`` + ``decode_array``
  (the body decode: routes bytes only), + ``decode_routes`` (id-range and distinct-expert
  validation, what the client does by default), and the whole response parse the client runs
  (``client_response.parse_response``: token ids, logprobs, raw response), with and without the
  distinct-expert check;
- ``validate_routes`` alone on the decoded array (range only; range + distinct experts), to
  attribute the validation cost;
- ``orjson.loads`` + ``pybase64`` on the materialised string, and ``json.loads`` + stdlib base64;
- a nested JSON list payload (what naive servers send) decoded by ``json.loads`` + ``np.asarray``.

A second table times the client's whole response parse for every protocol on each engine's own
body layout and route encoding (``[rows, 48, 8]`` routes of a 128-expert model, ``P + G - 1``
rows): SkyRL's envelope (uint8, the encoder's compact dtype), vLLM's base64 ``.npy`` (uint8) on
``/inference/v1/generate`` and per choice on ``/v1/completions``, SGLang's flat int32 in
``meta_info`` and in ``sglext``. Each protocol's floor is ``pybase64.b64decode`` of its own
payload; "validated" is the client's default (row count, id range and distinct experts per row,
dense all-zero rows exempt), "range-checked" the same without the distinct-experts check. The
three arms of a protocol are timed in turn within each round (interleaved).

The floor is one thread. The client's parse uses the process's helper thread where there is a
second core (``r3lightning.wire.helper_threads``): it reads the JSON fields while the calling
thread decodes the payload; the calling thread then checks the routes.

Before timing, the codec decodes a reformatted body (reversed key order, indented) and every
protocol's body must give the same routes. Usage: ``python benchmarks/bench_wire.py [--quick]``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json

import _common
import numpy as np
import orjson
import pybase64
import torch

from r3lightning.align.dummy import dummy_routes
from r3lightning.wire.codec import decode_array, decode_routes, encode_routes, parse_body, validate_routes
from r3lightning.wire.request import RouteSchema
from r3lightning.wire.response import parse_response

NUM_LAYERS, TOP_K, NUM_EXPERTS = 48, 8, 128
RESPONSE_TOKENS = 1024
TARGET_VS_FLOOR = 2.0  # the codec must reach >= 0.5x of the floor's speed


def make_routes(rows: int, seed: int = 0) -> np.ndarray:
    """``[rows, L, K]`` int16 routes with distinct experts per row (a rotated dummy pattern
    shifted by a random per-(row, layer) offset, which keeps the experts distinct)."""
    rng = np.random.default_rng(seed)
    base = dummy_routes(rows, NUM_LAYERS, TOP_K, NUM_EXPERTS).numpy().astype(np.int16)
    shift = rng.integers(0, NUM_EXPERTS, size=(rows, NUM_LAYERS, 1), dtype=np.int16)
    return (base + shift) % NUM_EXPERTS


def make_choice(routes_field: object) -> dict:
    rng = np.random.default_rng(1)
    return {
        "token_ids": rng.integers(0, 150_000, RESPONSE_TOKENS).tolist(),
        "finish_reason": "stop",
        "logprobs": {"content": [{"logprob": float(x)} for x in -rng.random(RESPONSE_TOKENS)]},
        "routed_experts": routes_field,
    }


def codec_routes(body: bytes) -> np.ndarray:
    parsed = parse_body(body, decode=True)
    envelope = parsed.value["choices"][0]["routed_experts"]
    data = parsed.payload(envelope["data"], "routed_experts.data")
    return decode_array({**envelope, "data": data}, field="routed_experts")


def codec_routes_validated(body: bytes) -> np.ndarray:
    parsed = parse_body(body, decode=True)
    envelope = parsed.value["choices"][0]["routed_experts"]
    data = parsed.payload(envelope["data"], "routed_experts.data")
    return decode_routes(
        {**envelope, "data": data}, num_experts=NUM_EXPERTS, num_layers=NUM_LAYERS, top_k=TOP_K
    )


def stdlib_routes(body: bytes) -> np.ndarray:
    envelope = json.loads(body)["choices"][0]["routed_experts"]
    return np.frombuffer(base64.b64decode(envelope["data"]), dtype="<i2").reshape(envelope["shape"])


def orjson_routes(body: bytes) -> np.ndarray:
    envelope = orjson.loads(body)["choices"][0]["routed_experts"]
    return np.frombuffer(pybase64.b64decode(envelope["data"]), dtype="<i2").reshape(envelope["shape"])


def nested_routes(body: bytes) -> np.ndarray:
    return np.asarray(json.loads(body)["choices"][0]["routed_experts"], dtype=np.int16)


def npy_base64(routes: np.ndarray) -> str:
    """vLLM's encoding: base64 of ``np.save`` (uint8 for <= 256 experts)."""
    buffer = io.BytesIO()
    np.save(buffer, routes.astype(np.uint8), allow_pickle=False)
    return pybase64.b64encode_as_string(buffer.getvalue())


def protocol_bodies(routes: np.ndarray) -> dict[str, tuple[str, bytes, bytes]]:
    """protocol label -> (client protocol, response body, route payload bytes), each engine's layout."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 150_000, RESPONSE_TOKENS).tolist()
    logprobs = [float(x) for x in -rng.random(RESPONSE_TOKENS)]
    npy = npy_base64(routes)
    flat = pybase64.b64encode_as_string(np.ascontiguousarray(routes, dtype="<i4").tobytes())
    envelope = encode_routes(routes)  # uint8: the encoder's compact dtype for 128 experts
    content = {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logprobs, strict=True)]}
    openai_logprobs = {"token_logprobs": logprobs, "tokens": [f"t{t}" for t in ids], "text_offset": []}
    bodies = {
        "skyrl envelope (uint8)": (
            "skyrl",
            {
                "choices": [
                    {
                        "token_ids": ids,
                        "finish_reason": "length",
                        "logprobs": content,
                        "routed_experts": envelope,
                    }
                ]
            },
            envelope["data"],
        ),
        "vllm /inference/v1/generate .npy (uint8)": (
            "vllm",
            {
                "request_id": "r",
                "output_mode": "tokens",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "length",
                        "token_ids": ids,
                        "logprobs": content,
                        "routed_experts": npy,
                    }
                ],
            },
            npy,
        ),
        "sglang /generate flat (int32)": (
            "sglang",
            {
                "text": "",
                "output_ids": ids,
                "meta_info": {
                    "finish_reason": {"type": "length"},
                    "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, logprobs, strict=True)],
                    "routed_experts": flat,
                },
            },
            flat,
        ),
        "openai vllm choices[0] .npy (uint8)": (
            "openai",
            {
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "logprobs": openai_logprobs,
                        "finish_reason": "length",
                        "token_ids": ids,
                        "routed_experts": npy,
                    }
                ],
            },
            npy,
        ),
        "openai sglang sglext flat (int32)": (
            "openai",
            {
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "logprobs": openai_logprobs,
                        "finish_reason": "length",
                        "token_ids": ids,
                    }
                ],
                "sglext": {"routed_experts": flat},
            },
            flat,
        ),
    }
    return {
        name: (protocol, orjson.dumps(body), payload.encode())
        for name, (protocol, body, payload) in bodies.items()
    }


def protocol_table(routes: np.ndarray, repeats: int) -> None:
    """Per protocol: the floor, the validated parse and the range-checked parse, side by side."""
    prompt_len = routes.shape[0] + 1 - RESPONSE_TOKENS  # rows = P + G - 1
    checked = RouteSchema(NUM_LAYERS, TOP_K, NUM_EXPERTS)
    range_only = RouteSchema(NUM_LAYERS, TOP_K, NUM_EXPERTS, check_unique=False)
    bodies = protocol_bodies(routes)
    arms: dict[str, object] = {}
    for name, (protocol, body, payload) in bodies.items():

        def parse(body=body, protocol=protocol, schema=checked):
            return parse_response(body, protocol, schema, want_routes=True, prompt_len=prompt_len)

        result = parse()
        assert np.array_equal(result.routed_experts, routes) and len(result.response_ids) == RESPONSE_TOKENS
        arms[f"{name} | floor"] = lambda payload=payload: pybase64.b64decode(payload, validate=True)
        arms[f"{name} | validated"] = parse
        arms[f"{name} | range-checked"] = lambda parse=parse: parse(schema=range_only)
    # interleaved: each round times the floor and both parses back to back, so each ratio compares
    # arms under the same machine state (run back to back, the arms' medians drifted apart by
    # up to 30% between runs, enough to flip a parse's order against its cheaper range-only arm)
    results = _common.time_arms(arms, repeats=repeats, warmup=2, interleave=True)
    rows, verdicts = [], []
    for name, (_, body, _) in bodies.items():
        floor = results[f"{name} | floor"]
        validated, ranged = results[f"{name} | validated"], results[f"{name} | range-checked"]
        rows.append(
            [
                name,
                f"{len(body) / _common.MiB:.1f}",
                _common.ms(floor),
                _common.ms(validated),
                _common.ratio(validated, floor),
                _common.ms(ranged),
                _common.ratio(ranged, floor),
            ]
        )
        for label, took in (("validated", validated), ("range-checked", ranged)):
            met = (
                "met"
                if took <= TARGET_VS_FLOOR * floor
                else f"missed by {took / (TARGET_VS_FLOOR * floor):.2f}x"
            )
            verdicts.append(f"- {name}, {label}: {_common.ratio(took, floor)} of the floor -> {met}")
    _common.print_table(
        "Client response parse per protocol (each engine's layout and dtype)",
        [
            "protocol",
            "body MiB",
            "floor ms",
            "validated ms",
            "validated / floor",
            "range-checked ms",
            "range / floor",
        ],
        rows,
    )
    print(f"\ntarget per protocol: parse within {TARGET_VS_FLOOR:.0f}x of its floor:")
    print("\n".join(verdicts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized shapes (2k rows, few repeats)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # torch plays no part; keep its threads out of the way
    rows = 2048 if args.quick else 32768
    repeats, slow_repeats = (3, 1) if args.quick else (15, 3)

    routes = make_routes(rows)
    envelope = encode_routes(routes, dtype="int16")
    body = orjson.dumps({"choices": [make_choice(envelope)]})
    payload = envelope["data"].encode()

    # Robustness: reversed key order and indentation must decode to the same routes.
    reordered = {"choices": [dict(reversed(make_choice(dict(reversed(envelope.items()))).items()))]}
    pretty = json.dumps(reordered, indent=2).encode()
    schema = RouteSchema(NUM_LAYERS, TOP_K, NUM_EXPERTS)
    unchecked = RouteSchema(NUM_LAYERS, TOP_K, NUM_EXPERTS, check_unique=False)
    for candidate in (body, pretty):
        assert np.array_equal(codec_routes_validated(candidate), routes)
        assert np.array_equal(
            parse_response(candidate, "skyrl", schema, want_routes=True).routed_experts, routes
        )
    nested_body = orjson.dumps({"choices": [make_choice(routes.tolist())]})
    assert np.array_equal(nested_routes(nested_body), routes)
    assert np.array_equal(stdlib_routes(body), routes) and np.array_equal(orjson_routes(body), routes)

    floor = "pybase64.b64decode of the payload (floor)"
    body_decode = "codec body decode: parse_body + decode_array"
    validated = "codec body decode + full validation (decode_routes)"
    client_default = "client parse_response (RemoteGenerateClient default)"
    fast = _common.time_arms(
        {
            floor: lambda: pybase64.b64decode(payload, validate=True),
            body_decode: lambda: codec_routes(body),
            validated: lambda: codec_routes_validated(body),
            client_default: lambda: parse_response(body, "skyrl", schema, want_routes=True),
            "client parse_response, distinct check off": lambda: parse_response(
                body, "skyrl", unchecked, want_routes=True
            ),
            "validate_routes alone: id range": lambda: validate_routes(
                routes, num_experts=NUM_EXPERTS, check_unique=False
            ),
            "validate_routes alone: id range + distinct experts": lambda: validate_routes(
                routes, num_experts=NUM_EXPERTS
            ),
            "orjson.loads + pybase64 (str materialised)": lambda: orjson_routes(body),
            "json.loads + stdlib base64": lambda: stdlib_routes(body),
        },
        repeats=repeats,
        warmup=2,
        # Back to back: a 24 MiB result's page faults depend on what the previous call left in
        # the heap, so interleaving would charge the arms for each other's allocations.
        interleave=False,
    )
    slow = _common.time_arms(
        {"nested JSON list + np.asarray": lambda: nested_routes(nested_body)}, slow_repeats
    )
    results = {**fast, **slow}

    raw_mib = routes.nbytes / _common.MiB
    print(
        f"# wire decode: {rows} x {NUM_LAYERS} x {TOP_K} int16 routes, {raw_mib:.1f} MiB raw, body "
        f"{len(body) / _common.MiB:.1f} MiB (nested-list body {len(nested_body) / _common.MiB:.1f} MiB)"
    )
    print(f"# {_common.machine_line()}; median of {repeats} ({slow_repeats} for the nested list)")
    base = results[floor]
    _common.print_table(
        "Wire decode of one response",
        ["arm", "median ms", "time vs floor", "speed vs floor", "speed-up vs json+stdlib"],
        [
            [
                name,
                _common.ms(t),
                _common.ratio(t, base),
                _common.ratio(base, t),
                _common.ratio(results["json.loads + stdlib base64"], t),
            ]
            for name, t in results.items()
        ],
    )
    print(
        f"\ntarget: >= {1 / TARGET_VS_FLOOR:.1f}x of the floor's speed (<= {_common.ms(TARGET_VS_FLOOR * base)} ms):"
    )
    for name in (body_decode, validated, client_default):
        took = results[name]
        verdict = (
            "met" if took <= TARGET_VS_FLOOR * base else f"missed by {took / (TARGET_VS_FLOOR * base):.2f}x"
        )
        print(
            f"- {name}: {_common.ms(took)} ms, {_common.ratio(base, took)} of the floor's speed -> {verdict}"
        )
    print()
    protocol_table(routes, 3 * repeats)  # ~3 ms arms whose medians wander with scheduling: more repeats


if __name__ == "__main__":
    main()
