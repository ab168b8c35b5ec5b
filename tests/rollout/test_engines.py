"""RemoteGenerateClient against vLLM's and SGLang's exact response layouts on a loopback server."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_server import EngineServer
from fault_server import FaultServer, Raw, expected_generation

from r3lightning import MalformedResponseError, RemoteGenerateClient, engine_sampling_params
from r3lightning.rollout.config import RetryPolicy
from r3lightning.wire.codec import decode_npy_routes
from r3lightning.wire.request import RouteSchema
from r3lightning.wire.response import parse_response
from r3lightning.wire.route_check import check_routes

PROMPT = [5, 6, 7, 8]
SCHEMA = {"num_layers": 3, "top_k": 2}


def client_for(server: EngineServer, protocol: str, **kwargs) -> RemoteGenerateClient:
    schema = RouteSchema(**SCHEMA, num_experts=server.num_experts)
    retry = RetryPolicy(max_attempts=1, timeout_s=5.0)
    return RemoteGenerateClient(server.url, protocol=protocol, schema=schema, retry=retry, **kwargs)


def reference(server: EngineServer, n: int, start: int = 0) -> tuple[list[int], list[float], np.ndarray]:
    """What the engine generated, dense layer 0 zeroed, from the plain reference generator."""
    ids, logprobs, routes = expected_generation(
        PROMPT, n, start, num_layers=3, top_k=2, num_experts=server.num_experts
    )
    routes[:, 0] = 0
    return ids, logprobs, routes


# (engine server, client protocol, path the request must go to)
CASES = [
    ("vllm", "vllm", "/inference/v1/generate"),
    ("vllm", "openai", "/v1/completions"),
    ("sglang", "sglang", "/generate"),
    ("sglang", "openai", "/v1/completions"),
]
IDS = ["vllm-generate", "vllm-completions", "sglang-generate", "sglang-completions"]


@pytest.mark.parametrize("engine, protocol, path", CASES, ids=IDS)
@pytest.mark.parametrize("num_experts", [128, 300])  # vLLM: uint8 up to 256 experts, else uint16
@pytest.mark.parametrize("start", [0, 2])
async def test_round_trip_of_each_engine_layout(engine, protocol, path, num_experts, start):
    async with (
        EngineServer(engine, num_experts=num_experts) as server,
        client_for(server, protocol) as client,
    ):
        params = engine_sampling_params(protocol, max_new_tokens=5, ignore_eos=True, seed=3)
        result = await client.generate(
            PROMPT, params, return_routed_experts=True, routed_experts_prompt_start=start
        )
    ids, logprobs, routes = reference(server, 5, start)
    assert result.response_ids == ids and result.response_logprobs == logprobs
    assert result.stop_reason == "length"
    np.testing.assert_array_equal(result.routed_experts, routes)
    assert result.routed_experts.shape == (len(PROMPT) - start + 5 - 1, 3, 2)
    assert not result.routed_experts[:, 0].any()  # the dense layer's all-zero rows are accepted
    # compact and torch-friendly: vLLM's uint8 kept, its uint16 viewed as int16; SGLang's int32
    # compacted by the largest id present
    wide = num_experts > 256 and engine == "vllm"
    assert result.routed_experts.dtype == (np.int16 if wide else np.uint8)
    torch.from_numpy(result.routed_experts).long()  # uint16 would lack most torch operations

    ((got_path, body),) = server.requests
    assert got_path == path
    if protocol == "vllm":
        assert body == {
            "token_ids": PROMPT,
            "sampling_params": {
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": -1,
                "max_tokens": 5,
                "seed": 3,
                "ignore_eos": True,
                "routed_experts_prompt_start": start,
                "logprobs": 0,
            },
        }
        assert result.raw_response["choices"][0]["routed_experts"] is None  # never a str
    elif protocol == "sglang":
        assert (
            body["sampling_params"]["max_new_tokens"] == 5 and body["sampling_params"]["sampling_seed"] == 3
        )
        assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == start
    else:
        assert body["prompt"] == PROMPT and body["max_tokens"] == 5 and body["seed"] == 3
        assert body["return_token_ids"] is True and body["logprobs"] == 0 and body["stream"] is False
        # both engines' route fields: the same client works against either
        assert body["routed_experts_prompt_start"] == start
        assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == start
        where = "sglext" if engine == "sglang" else "choices"
        if where == "sglext":
            assert result.raw_response["sglext"]["routed_experts"] is None
        else:
            assert result.raw_response["choices"][0]["routed_experts"] is None


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_openai_engine_option_sends_only_that_engines_fields(engine):
    async with EngineServer(engine) as server, client_for(server, "openai", engine=engine) as client:
        result = await client.generate(
            PROMPT, {"max_tokens": 3, "ignore_eos": True}, return_routed_experts=True
        )
    np.testing.assert_array_equal(result.routed_experts, reference(server, 3)[2])
    body = server.requests[0][1]
    vllm_keys = {"routed_experts_prompt_start"}
    sglang_keys = {"return_routed_experts", "routed_experts_start_len"}
    assert (vllm_keys if engine == "vllm" else sglang_keys) <= set(body)
    assert not ((sglang_keys if engine == "vllm" else vllm_keys) & set(body))


@pytest.mark.parametrize("engine, protocol, path", CASES, ids=IDS)
async def test_stop_token_ids_reach_the_engine(engine, protocol, path):
    ids, _, _ = expected_generation(PROMPT, 8, 0, num_layers=3, top_k=2, num_experts=300)
    stop = ids[2]
    async with EngineServer(engine) as server, client_for(server, protocol) as client:
        params = engine_sampling_params(protocol, max_new_tokens=8, stop_token_ids=[stop])
        result = await client.generate(PROMPT, params, return_routed_experts=True)
        # EOS (the server's id 999 here) is honoured unless ignore_eos
        eos = EngineServer(engine, eos_id=ids[1])
        async with eos, client_for(eos, protocol) as eos_client:
            stopped = await eos_client.generate(PROMPT, engine_sampling_params(protocol, max_new_tokens=8))
            ignored = await eos_client.generate(
                PROMPT, engine_sampling_params(protocol, max_new_tokens=8, ignore_eos=True)
            )
    assert result.response_ids == ids[:3] and result.stop_reason == "stop"
    assert result.routed_experts.shape[0] == len(PROMPT) + 3 - 1
    assert stopped.response_ids == ids[:2] and ignored.response_ids == ids
    body = server.requests[0][1]
    params = body if protocol == "openai" else body["sampling_params"]
    assert params["stop_token_ids"] == [stop] and params["ignore_eos"] is False


def test_engine_sampling_params_names():
    assert engine_sampling_params("sglang", max_new_tokens=4, seed=1, stop_token_ids=[2, 7]) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 4,
        "sampling_seed": 1,
        "stop_token_ids": [2, 7],
        "ignore_eos": False,
    }
    for protocol in ("skyrl", "vllm", "openai"):
        params = engine_sampling_params(protocol, max_new_tokens=4, seed=1, stop_token_ids=np.array([2]))
        assert params["max_tokens"] == 4 and params["seed"] == 1 and params["stop_token_ids"] == [2]
        assert "max_new_tokens" not in params
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        engine_sampling_params("vllm", max_new_tokens=0)
    with pytest.raises(ValueError, match="stop_token_ids must be non-negative"):
        engine_sampling_params("vllm", max_new_tokens=1, stop_token_ids=[-1])
    with pytest.raises(ValueError, match="protocol must be one of"):
        engine_sampling_params("tgi", max_new_tokens=1)


# ------------------------------------------------------------------ absent and wrong-count routes


@pytest.mark.parametrize("engine, protocol, path", CASES, ids=IDS)
async def test_routes_asked_for_but_absent_name_the_engine_flag(engine, protocol, path):
    async with EngineServer(engine, routes_enabled=False) as server, client_for(server, protocol) as client:
        state = "null" if engine == "vllm" else "missing"  # vLLM sends null, SGLang leaves it out
        with pytest.raises(
            MalformedResponseError,
            match=rf"routes were requested but the field is {state}; .*--enable-return-routed-experts",
        ):
            await client.generate(
                PROMPT, engine_sampling_params(protocol, max_new_tokens=2), return_routed_experts=True
            )
        assert len(server.requests) == 1  # never retried
        # not asked for: nothing to complain about
        result = await client.generate(PROMPT, engine_sampling_params(protocol, max_new_tokens=2))
        assert result.routed_experts is None and len(result.response_ids) == 2


@pytest.mark.parametrize("engine, protocol, path", CASES, ids=IDS)
@pytest.mark.parametrize("extra_rows", [1, -1])
async def test_wrong_row_count_is_refused_in_every_protocol(engine, protocol, path, extra_rows):
    async with EngineServer(engine, extra_rows=extra_rows) as server, client_for(server, protocol) as client:
        expected = len(PROMPT) - 1 + 3 - 1
        with pytest.raises(
            MalformedResponseError,
            match=rf"{expected + extra_rows} route rows, expected P - start \+ G - 1 = 4 - 1 \+ 3 - 1 = {expected}",
        ):
            await client.generate(
                PROMPT,
                engine_sampling_params(protocol, max_new_tokens=3, ignore_eos=True),
                return_routed_experts=True,
                routed_experts_prompt_start=1,
            )


@pytest.mark.parametrize("state", ["null", "missing"])
async def test_skyrl_absent_routes_are_refused(state):
    choice = {"token_ids": [1, 2], "finish_reason": "length", "logprobs": None}
    if state == "null":
        choice["routed_experts"] = None
    async with FaultServer() as server:
        server.script.append(Raw(json.dumps({"choices": [choice]}).encode()))
        retry = RetryPolicy(max_attempts=1)
        async with RemoteGenerateClient(server.url, schema=RouteSchema(**SCHEMA), retry=retry) as client:
            with pytest.raises(
                MalformedResponseError, match=f"choices\\[0\\].routed_experts: .* is {state}.*--enable"
            ):
                await client.generate(PROMPT, {"max_tokens": 2}, return_routed_experts=True)


# ------------------------------------------------------------------ the .npy and sglext codecs


def npy_b64(array: np.ndarray, version: tuple[int, int] | None = None) -> str:
    buffer = io.BytesIO()
    if version is None:
        np.save(buffer, array, allow_pickle=False)
    else:
        np.lib.format.write_array(buffer, array, version=version, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("version", [None, (1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("dtype", ["u1", "<u2", "<i2", "<i4"])
def test_npy_routes_decode_like_np_load(version, dtype):
    rng = np.random.default_rng(0)
    routes = np.stack([rng.permutation(200)[:4] for _ in range(6 * 5)]).reshape(6, 5, 4).astype(dtype)
    data = npy_b64(routes, version)
    reference = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    decoded = decode_npy_routes(data, num_layers=5, top_k=4, num_experts=200)
    np.testing.assert_array_equal(decoded, reference)
    assert decoded.flags.writeable and decoded.flags.c_contiguous
    assert decoded.dtype == (np.int16 if dtype == "<u2" else np.dtype(dtype))


def test_uint16_ids_above_int16_become_int32():
    routes = np.array([[[40000, 1]], [[2, 65535]]], dtype="<u2")
    decoded = decode_npy_routes(npy_b64(routes), num_experts=65536)
    assert decoded.dtype == np.int32
    np.testing.assert_array_equal(decoded, routes.astype(np.int64))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: base64.b64encode(b"not a npy file at all").decode(), "not a .npy file"),
        (lambda: npy_b64(np.zeros((2, 3, 2), "<i8")), r"\.npy dtype '<i8' is not a route dtype"),
        (lambda: npy_b64(np.zeros((2, 3, 2), ">u2")), r"\.npy dtype '>u2' is not a route dtype"),
        (lambda: npy_b64(np.asfortranarray(np.arange(12, dtype="u1").reshape(2, 3, 2))), "C-ordered"),
        (
            lambda: npy_b64(np.arange(12, dtype="u1").reshape(2, 3, 2))[:-4],
            "holds 138 bytes but the shape and dtype need 140",
        ),
        (
            lambda: npy_b64(np.arange(12, dtype="u1").reshape(3, 4)),
            r"expected shape \[rows, num_layers, top_k\]",
        ),
        (lambda: npy_b64(np.array([[[1, 1]]], "u1")), r"row 0 layer 0 repeats an expert: \[1, 1\]"),
        (lambda: npy_b64(np.array([[[1, 9]]], "u1")), "expert id 9 is out of range for num_experts=8"),
    ],
    ids=["magic", "int64", "big-endian", "fortran", "truncated", "2-d", "repeat", "range"],
)
def test_bad_npy_routes_name_the_problem(make, message):
    with pytest.raises(MalformedResponseError, match=r"choices\[0\]\.routed_experts: .*" + message):
        decode_npy_routes(make(), num_experts=8)


def test_npy_header_is_never_evaluated_as_code():
    header = b"{'descr': '|u1', 'fortran_order': False, 'shape': __import__('os').getpid(), }"
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    raw = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header
    with pytest.raises(MalformedResponseError, match=r"unreadable \.npy header"):
        decode_npy_routes(base64.b64encode(raw))


def test_npy_size_cap_is_checked_before_decoding():
    data = npy_b64(np.zeros((1000, 4, 2), "u1"))
    with pytest.raises(MalformedResponseError, match="exceeds the cap of 100 bytes"):
        decode_npy_routes(data, max_bytes=100)


def test_openai_body_with_both_route_forms_keeps_vllms():
    routes = np.array([[[1, 2]], [[3, 4]]], dtype="u1")
    body = {
        "choices": [{"token_ids": [7, 8], "finish_reason": "length", "routed_experts": npy_b64(routes)}],
        "sglext": {"routed_experts": base64.b64encode(np.zeros(4, "<i4").tobytes()).decode()},
    }
    result = parse_response(
        json.dumps(body).encode(), "openai", RouteSchema(1, 2), want_routes=True, prompt_len=1
    )
    np.testing.assert_array_equal(result.routed_experts, routes)
    assert result.raw_response["sglext"]["routed_experts"] is None


def test_openai_body_without_token_ids_says_why():
    body = {"choices": [{"text": "hi", "finish_reason": "length"}]}
    with pytest.raises(MalformedResponseError, match=r"choices\[0\]\.token_ids: missing; .*return_token_ids"):
        parse_response(json.dumps(body).encode(), "openai", RouteSchema(), want_routes=False)


# ------------------------------------------------------------------ dense layers downstream


def test_dense_zero_rows_pass_the_wire_check_but_not_on_an_moe_layer_at_install():
    """The wire check exempts all-zero rows (it cannot tell dense layers); the replay backends
    know their MoE layers, never look at dense ones, and still refuse a zero row on an MoE layer."""
    from r3lightning.app.models.tiny import build_tiny_moe, tiny_moe_config
    from r3lightning.replay.backend import validate_routes_for_install
    from r3lightning.replay.hf.replay import HFRouterReplay

    config = tiny_moe_config()
    model = build_tiny_moe(config, seed=0)
    backend = HFRouterReplay.for_model(model)
    assert 0 not in backend.moe_layers  # the tiny model's first layer is dense
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 5, backend.num_layers, backend.num_experts, generator=g)
    routes = scores.argsort(dim=-1)[..., : backend.top_k].to(torch.uint8)  # [B, S, L, K]
    routes[..., 0, :] = 0
    check_routes(routes.reshape(10, backend.num_layers, backend.top_k).numpy())
    validate_routes_for_install(backend, routes, None)
    backend.install(routes)  # validate=True by default
    with torch.no_grad():
        model(torch.randint(3, 50, (2, 5)))
    backend.clear()
    moe = backend.moe_layers[0]
    routes[0, 0, moe] = 0
    with pytest.raises(ValueError, match="repeat an expert within a token's top_k on a replayed MoE layer"):
        backend.install(routes)


async def test_the_docs_client_snippet_runs_against_a_vllm_layout():
    page = (Path(__file__).resolve().parents[2] / "docs" / "protocols.md").read_text()
    section = page.split("\n## The client\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    async with EngineServer("vllm", num_layers=48, top_k=8, num_experts=128) as server:
        scope: dict = {}
        exec(code.replace("http://vllm-host:8000", server.url), scope)
        ids, logprobs, routes = await scope["rollout"]([5, 6, 7], [54])
    expected = expected_generation([5, 6, 7], 1024, 0, num_layers=48, top_k=8, num_experts=128)[0]
    assert ids == expected[: expected.index(54) + 1]  # stopped by the tokenizer's stop id
    assert routes.shape == (3 + len(ids) - 1, 48, 8) and len(logprobs) == len(ids)
    params = server.requests[0][1]["sampling_params"]
    assert params["stop_token_ids"] == [54] and params["max_tokens"] == 1024


@pytest.mark.parametrize("engine, protocol, path", CASES, ids=IDS)
async def test_the_jobs_sampling_config_sends_its_stop_ids_in_each_protocol(engine, protocol, path):
    from r3lightning.rollout.prompts import SamplingConfig

    ids = expected_generation(PROMPT, 6, 0, num_layers=3, top_k=2, num_experts=300)[0]
    sampling = SamplingConfig(max_new_tokens=6, ignore_eos=True, stop_token_ids=[ids[3]])
    async with EngineServer(engine) as server, client_for(server, protocol) as client:
        result = await client.generate(PROMPT, sampling.wire_params(protocol, seed=11))
    assert result.response_ids == ids[:4] and result.stop_reason == "stop"
    body = server.requests[0][1]
    params = body if protocol == "openai" else body["sampling_params"]
    seed_key = "sampling_seed" if protocol == "sglang" else "seed"
    assert params["stop_token_ids"] == [ids[3]] and params[seed_key] == 11
