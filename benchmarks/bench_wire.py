"""Wire decode: one generate response carrying a trajectory's routes, parsed by the client.

The body is a ``skyrl`` response whose ``routed_experts`` envelope holds ``[32768, 48, 8]`` uint8
routes of a 128-expert model (12 MiB raw, 16 MiB of base64) next to 1024 response token ids with
logprobs. Arms, timed side by side in one run (interleaved rounds, see ``time_arms``):

- floor: ``pybase64.b64decode`` of the payload bytes alone (already cut out of the body);
- the validated parse (``parse_response`` with ``RouteSchema(48, 8, 128)``, the client's parse:
  orjson reads the body around the payload, pybase64 decodes it into the route array, and the
  route check runs: shape, row count ``P - start + G - 1``, ids in range, dense zero rows);
- the same with the distinct-experts check (``check_unique=True``);
- the route check alone on the decoded array (ids in range; and distinct experts);
- ``orjson.loads`` + pybase64 (the payload materialised as a ``str``) and ``json.loads`` +
  the standard library's base64.

Budget: the validated parse within 3x the floor on any CPU, in CPU time (each arm is one
thread's work, so its CPU time is its cost even on a busy machine). A second table parses every
protocol's own body layout and route encoding (SkyRL's envelope, vLLM's ``.npy`` on both
endpoints, SGLang's flat int32 in ``meta_info`` and in ``sglext``) next to a bare decode of its
payload. Before timing, every arm must give the same routes, also from a reformatted body
(reversed keys, indented). Usage: ``python benchmarks/bench_wire.py [--quick]``.
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import platform
import statistics
import time
from collections.abc import Callable

import _common
import numpy as np
import orjson
import pybase64
import torch

from r3lightning.align.dummy import dummy_routes
from r3lightning.wire.codec import RouteSchema, encode_flat_routes, encode_routes
from r3lightning.wire.response import parse_response
from r3lightning.wire.route_check import check_routes

NUM_LAYERS, TOP_K, NUM_EXPERTS = 48, 8, 128
ROWS, RESPONSE_TOKENS = 32768, 1024
PROMPT = ROWS + 1 - RESPONSE_TOKENS  # rows = P + G - 1
BUDGET = 3.0  # validated parse / floor

SCHEMA = RouteSchema(NUM_LAYERS, TOP_K, NUM_EXPERTS)
DISTINCT = RouteSchema(NUM_LAYERS, TOP_K, NUM_EXPERTS, check_unique=True)


def make_routes(rows: int, seed: int = 0) -> np.ndarray:
    """``[rows, L, K]`` uint8 routes, distinct experts per row (a rotated dummy pattern shifted by
    a random offset per (row, layer)), the first two layers dense (all-zero rows)."""
    rng = np.random.default_rng(seed)
    base = dummy_routes(rows, NUM_LAYERS, TOP_K, NUM_EXPERTS).numpy().astype(np.int64)
    shift = rng.integers(0, NUM_EXPERTS, size=(rows, NUM_LAYERS, 1))
    routes = ((base + shift) % NUM_EXPERTS).astype(np.uint8)
    routes[:, :2] = 0
    return routes


def npy_base64(routes: np.ndarray) -> str:
    """vLLM's encoding: base64 of ``np.save`` (uint8 for <= 256 experts)."""
    buffer = io.BytesIO()
    np.save(buffer, routes, allow_pickle=False)
    return pybase64.b64encode_as_string(buffer.getvalue())


def protocol_bodies(routes: np.ndarray) -> dict[str, tuple[str, bytes, bytes]]:
    """label -> (client protocol, body, route payload bytes), in each engine's own layout."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 150_000, RESPONSE_TOKENS).tolist()
    logprobs = [float(x) for x in -rng.random(RESPONSE_TOKENS)]
    npy, flat, envelope = npy_base64(routes), encode_flat_routes(routes), encode_routes(routes)
    content = {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logprobs, strict=True)]}
    openai = {"token_logprobs": logprobs, "tokens": [f"t{t}" for t in ids], "text_offset": []}
    choice = {"index": 0, "finish_reason": "length", "token_ids": ids}
    sglang_meta = {
        "finish_reason": {"type": "length"},
        "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, logprobs, strict=True)],
    }
    bodies = {
        "skyrl envelope (uint8)": (
            "skyrl",
            {"choices": [{**choice, "logprobs": content, "routed_experts": envelope}]},
            envelope["data"],
        ),
        "vllm /inference/v1/generate .npy (uint8)": (
            "vllm",
            {"request_id": "r", "choices": [{**choice, "logprobs": content, "routed_experts": npy}]},
            npy,
        ),
        "sglang /generate flat (int32)": (
            "sglang",
            {"text": "", "output_ids": ids, "meta_info": {**sglang_meta, "routed_experts": flat}},
            flat,
        ),
        "openai vllm choices[0] .npy (uint8)": (
            "openai",
            {"object": "text_completion", "choices": [{**choice, "logprobs": openai, "routed_experts": npy}]},
            npy,
        ),
        "openai sglang sglext flat (int32)": (
            "openai",
            {"choices": [{**choice, "logprobs": openai}], "sglext": {"routed_experts": flat}},
            flat,
        ),
    }
    return {name: (p, orjson.dumps(body), payload.encode()) for name, (p, body, payload) in bodies.items()}


def time_arms(arms: dict[str, Callable[[], object]], rounds: int, block: int = 3) -> dict[str, list[float]]:
    """``[cpu best, wall best, wall median]`` seconds of each arm. Each round runs every arm
    ``block`` times back to back and keeps all but the first call (which pays for the heap the
    previous arm left: a 12 MiB result faults its pages in again), so each arm is timed in its own
    steady state while drift hits them alike. Every arm is one thread's work, so its CPU time
    (``time.thread_time``) is its cost whatever else runs on the machine: the verdict's figure.
    Wall times are printed beside it (on a busy machine they include other processes' turns)."""
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    wall: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            for call in range(block):
                gc.collect()
                start, start_cpu = time.perf_counter(), time.thread_time()
                result = arm()
                elapsed_cpu, elapsed = time.thread_time() - start_cpu, time.perf_counter() - start
                del result
                if call:
                    cpu[name].append(elapsed_cpu)
                    wall[name].append(elapsed)
    return {name: [min(cpu[name]), min(wall[name]), statistics.median(wall[name])] for name in arms}


def reordered(node: object) -> object:
    """``node`` with the keys of every object in reverse order."""
    if isinstance(node, dict):
        return {key: reordered(node[key]) for key in reversed(node)}
    return [reordered(item) for item in node] if isinstance(node, list) else node


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}; numpy {np.__version__}, "
        f"orjson {orjson.__version__}, pybase64 {pybase64.__version__}; {_common.machine_line()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run (same shape, fewer repeats)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # torch plays no part; keep its threads out of the way
    rounds = 6 if args.quick else 20

    routes = make_routes(ROWS)
    bodies = protocol_bodies(routes)
    _, body, payload = bodies["skyrl envelope (uint8)"]
    decoded = np.frombuffer(pybase64.b64decode(payload), np.uint8).reshape(routes.shape)

    # Every arm must give the same routes, also from a reformatted body.
    pretty = json.dumps(reordered(json.loads(body)), indent=2).encode()
    for candidate in (body, pretty):
        result = parse_response(candidate, "skyrl", DISTINCT, want_routes=True, prompt_len=PROMPT)
        assert np.array_equal(result.routed_experts, routes) and result.routed_experts.dtype == np.uint8
    for protocol, text, _ in bodies.values():
        parsed = parse_response(text, protocol, SCHEMA, want_routes=True, prompt_len=PROMPT).routed_experts
        assert np.array_equal(parsed, routes), protocol

    def stdlib() -> np.ndarray:
        envelope = json.loads(body)["choices"][0]["routed_experts"]
        return np.frombuffer(base64.b64decode(envelope["data"]), np.uint8).reshape(envelope["shape"])

    def with_str() -> np.ndarray:
        envelope = orjson.loads(body)["choices"][0]["routed_experts"]
        return np.frombuffer(pybase64.b64decode(envelope["data"]), np.uint8).reshape(envelope["shape"])

    assert np.array_equal(stdlib(), routes) and np.array_equal(with_str(), routes)
    floor = "pybase64.b64decode of the payload (floor)"
    validated = "validated parse (client parse_response)"
    arms = {
        floor: lambda: pybase64.b64decode(payload, validate=True),
        validated: lambda: parse_response(body, "skyrl", SCHEMA, want_routes=True, prompt_len=PROMPT),
        "validated parse + distinct experts (check_unique)": lambda: parse_response(
            body, "skyrl", DISTINCT, want_routes=True, prompt_len=PROMPT
        ),
        "route check alone: ids in range": lambda: check_routes(
            decoded, num_experts=NUM_EXPERTS, distinct=False
        ),
        "route check alone: + distinct experts": lambda: check_routes(decoded, num_experts=NUM_EXPERTS),
        "orjson.loads + pybase64 (str materialised)": with_str,
        "json.loads + stdlib base64": stdlib,
    }
    results = time_arms(arms, rounds)
    print(
        f"# wire decode: {ROWS} x {NUM_LAYERS} x {TOP_K} uint8 routes, {routes.nbytes / _common.MiB:.1f} MiB "
        f"raw, body {len(body) / _common.MiB:.1f} MiB"
    )
    print(f"# {machine()}; {rounds} interleaved rounds of 2 calls per arm; CPU time is the thread's")
    base = results[floor][0]
    _common.print_table(
        "Wire decode of one response",
        ["arm", "CPU best ms", "CPU vs floor", "wall best ms", "wall median ms"],
        [
            [name, _common.ms(c), _common.ratio(c, base), _common.ms(b), _common.ms(m)]
            for name, (c, b, m) in results.items()
        ],
    )
    took = results[validated][0] / base
    verdict = "met" if took <= BUDGET else f"missed by {took / BUDGET:.2f}x"
    print(f"\ntarget: validated parse <= {BUDGET:.0f}x the floor (CPU time): {took:.2f}x -> {verdict}")

    arms = {}
    for name, (protocol, text, data) in bodies.items():
        arms[f"{name} | floor"] = lambda data=data: pybase64.b64decode(data, validate=True)
        arms[f"{name} | parse"] = lambda text=text, protocol=protocol: parse_response(
            text, protocol, SCHEMA, want_routes=True, prompt_len=PROMPT
        )
    results = time_arms(arms, rounds)
    rows = []
    for name, (_, text, _) in bodies.items():
        low, parse = results[f"{name} | floor"][0], results[f"{name} | parse"][0]  # CPU time
        ok = "met" if parse <= BUDGET * low else "missed"
        rows.append(
            [
                name,
                f"{len(text) / _common.MiB:.1f}",
                _common.ms(low),
                _common.ms(parse),
                _common.ratio(parse, low),
                ok,
            ]
        )
    _common.print_table(
        "Validated parse per protocol (each engine's layout and dtype)",
        [
            "layout",
            "body MiB",
            "floor CPU ms",
            "validated CPU ms",
            "validated / floor",
            f"<= {BUDGET:.0f}x",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
