"""The generation engine of the embedded server, and its in-process weight updates, against real models.

References are deliberately simple and independent of the engine: a KV-cached loop that feeds
one token at a time with the model's default positions and no attention mask, a single full
forward, and plain softmax arithmetic for the sampling filters.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from transformers import DynamicCache

from r3lightning.app.models.tiny import TINY_FAMILIES, build_tiny_moe, tiny_family_config, tiny_moe_config
from r3lightning.app.serve.config import EngineConfig
from r3lightning.app.serve.engine import GenerationEngine, GenerationRequest
from r3lightning.app.serve.sampling import SamplingParams, sample_token
from r3lightning.app.serve.server import RolloutServer
from r3lightning.replay.context import as_backend, record_routes

MOE_LAYERS = [1, 2, 3]  # the tiny model's layer 0 is dense


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (length,), generator=g).tolist()


def reforward(model, prompt: list[int], generated: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward ``prompt`` then ``generated[:-1]`` one token at a time with a KV cache.

    Returns the routes recorded per forwarded token ``[P + G - 1, L, K]`` and the float32
    logits after each forward ``[G, V]`` (those that predicted ``generated``).
    """
    cache = DynamicCache(config=model.config)
    rows, logits = [], []
    with torch.inference_mode():
        for step in [prompt] + [[t] for t in generated[:-1]]:
            with record_routes(model) as rec:
                out = model(input_ids=torch.tensor([step]), cache=cache, use_cache=True)
            rows.append(rec.routes[0])
            logits.append(out.logits[0, -1].float())
    return torch.cat(rows), torch.stack(logits)


def full_forward_routes(model, tokens: list[int]) -> torch.Tensor:
    """Routes of one forward over the whole sequence ``[len(tokens), L, K]``."""
    with torch.inference_mode(), record_routes(model) as rec:
        model(input_ids=torch.tensor([tokens]))
    return rec.routes[0]


@pytest.fixture(scope="module")
def bf16_engine():
    engine = GenerationEngine(build_tiny_moe(seed=0))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server():
    with RolloutServer(engine=EngineConfig(seed=0)) as srv:
        yield srv


# --------------------------------------------------------------------------- engine


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_routes_and_logprobs_equal_a_same_procedure_reforward(bf16_engine, seed):
    """Same dtype, same procedure (prefill + one token per step): routes and logprobs are exact."""
    prompt = _prompt(seed, 4 + 5 * seed)
    params = SamplingParams(max_new_tokens=24, temperature=0.8, seed=seed, ignore_eos=True)
    out = bf16_engine.generate([GenerationRequest(prompt, params, return_routed_experts=True)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    routes, logits = reforward(bf16_engine.model, prompt, out.token_ids)
    assert out.routed_experts.shape == (len(prompt) + 24 - 1, 4, 2)
    assert torch.equal(torch.from_numpy(out.routed_experts), routes)
    expected = (logits / 0.8).log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.equal(torch.tensor(out.logprobs), expected)
    assert (out.routed_experts[:, 0] == 0).all()  # dense layer rows


def test_routes_align_token_by_token_with_a_full_forward(bf16_engine):
    """Row t is token t's routing: a full forward of the same tokens agrees row for row.

    In fp32 the incremental decode and the full forward route identically. In bf16 their numerics
    differ, so a few near-tied experts can flip; rows shifted by one token agree only by chance.
    """
    fp32 = GenerationEngine(build_tiny_moe(seed=0), EngineConfig(dtype=torch.float32))
    same = shifted = total = 0
    for seed in range(4):
        prompt = _prompt(10 + seed, 6)
        params = SamplingParams(max_new_tokens=30, seed=seed, ignore_eos=True)
        request = GenerationRequest(prompt, params, return_routed_experts=True)
        out32 = fp32.generate([request])[0]
        full32 = full_forward_routes(fp32.model, prompt + out32.token_ids[:-1]).numpy()
        assert (out32.routed_experts == full32).all()

        out = bf16_engine.generate([request])[0]
        full = full_forward_routes(bf16_engine.model, prompt + out.token_ids[:-1]).numpy()
        got = out.routed_experts[:, MOE_LAYERS]
        same += (got == full[:, MOE_LAYERS]).all(-1).sum()
        shifted += (got[1:] == full[:-1, MOE_LAYERS]).all(-1).sum()
        total += got.shape[0] * len(MOE_LAYERS)
    assert same / total > 0.95
    assert shifted / total < 0.5


def test_prompt_start_returns_the_suffix_rows(bf16_engine):
    prompt = _prompt(3, 9)
    params = SamplingParams(max_new_tokens=6, seed=7, ignore_eos=True)
    full, part = bf16_engine.generate(
        [
            GenerationRequest(prompt, params, return_routed_experts=True),
            GenerationRequest(prompt, params, return_routed_experts=True, routed_experts_prompt_start=5),
        ]
    )
    assert part.routed_experts.shape[0] == 9 - 5 + 6 - 1
    assert (part.routed_experts == full.routed_experts[5:]).all()
    none = bf16_engine.generate([GenerationRequest(prompt, params)])[0]
    assert none.routed_experts is None and none.token_ids == full.token_ids


def test_left_padded_batch_equals_unbatched():
    """Left padding with position ids: each row generates exactly what it would alone (fp32)."""
    engine = GenerationEngine(build_tiny_moe(seed=0), EngineConfig(dtype=torch.float32))
    requests = [
        GenerationRequest(
            _prompt(20 + i, n), SamplingParams(max_new_tokens=8 + 4 * i, seed=i, ignore_eos=True), True
        )
        for i, n in enumerate((3, 11, 7))
    ]
    batched = engine.generate(requests)
    for request, got in zip(requests, batched, strict=True):
        alone = engine.generate([request])[0]
        assert got.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
        assert (got.routed_experts == alone.routed_experts).all()
    assert [len(o.token_ids) for o in batched] == [8, 12, 16]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_router_family_generates_aligned_routes(family):
    """Batched generation on each supported MoE family; rows match a full forward (fp32)."""
    engine = GenerationEngine(
        build_tiny_moe(tiny_family_config(family), seed=0), EngineConfig(dtype=torch.float32)
    )
    requests = [
        GenerationRequest(_prompt(40 + n, n), SamplingParams(6, seed=n, ignore_eos=True), True)
        for n in (3, 12)
    ]
    for request, out in zip(requests, engine.generate(requests), strict=True):
        tokens = list(request.prompt_ids) + out.token_ids[:-1]
        assert out.routed_experts.shape == (len(tokens), engine.num_layers, engine.top_k)
        assert (out.routed_experts == full_forward_routes(engine.model, tokens).numpy()).all()


def test_stop_tokens_length_and_context_cap(bf16_engine):
    prompt = _prompt(4, 5)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    free = bf16_engine.generate([GenerationRequest(prompt, greedy)])[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    stopped = bf16_engine.generate(
        [
            GenerationRequest(
                prompt,
                SamplingParams(
                    max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,)
                ),
                return_routed_experts=True,
            )
        ]
    )[0]
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token is part of the output
    assert (stopped.finish_reason, stopped.stop_token_id) == ("stop", stop_at)
    assert stopped.routed_experts.shape[0] == len(prompt) + first + 1 - 1
    assert (free.finish_reason, free.stop_token_id) == ("length", None)

    long_prompt = _prompt(5, bf16_engine.max_context - 3)
    capped = bf16_engine.generate([GenerationRequest(long_prompt, greedy)])[0]
    assert len(capped.token_ids) == 3 and capped.finish_reason == "length"


def test_eos_stops_unless_ignored():
    prompt = _prompt(6, 4)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    first = (
        GenerationEngine(build_tiny_moe(seed=0)).generate([GenerationRequest(prompt, greedy)])[0].token_ids[0]
    )
    # same weights, but the config names the greedy first token as EOS
    engine = GenerationEngine(build_tiny_moe(tiny_moe_config(eos_token_id=first), seed=0))
    assert engine.eos_token_ids == {first}
    out = engine.generate([GenerationRequest(prompt, greedy, return_routed_experts=True)])[0]
    assert (out.token_ids, out.finish_reason, out.stop_token_id) == ([first], "stop", first)
    assert out.routed_experts.shape[0] == len(prompt)  # P - 0 + G - 1 with G = 1
    ignored = engine.generate([GenerationRequest(prompt, SamplingParams(5, 0.0, ignore_eos=True))])[0]
    assert len(ignored.token_ids) == 5 and ignored.finish_reason == "length"


def test_sampling_filters_against_plain_softmax():
    logits = torch.tensor([2.0, 1.5, 0.2, -1.0, 0.9, -3.0])
    # greedy, and its logprob under the raw logits
    token, logprob = sample_token(logits, SamplingParams(temperature=0.0), torch.Generator())
    assert token == 0 and logprob == pytest.approx(float(logits.log_softmax(-1)[0]))
    seen_k, seen_p = set(), set()
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        token, logprob = sample_token(logits, SamplingParams(temperature=0.7, top_k=2), g)
        seen_k.add(token)
        # logprob is of the temperature-scaled distribution before truncation
        assert logprob == pytest.approx(float((logits / 0.7).log_softmax(-1)[token]))
        token, _ = sample_token(logits, SamplingParams(temperature=1.0, top_p=0.8), g)
        seen_p.add(token)
    assert seen_k == {0, 1}
    probs = logits.softmax(-1)  # sorted: 0 (.46), 1 (.28), 4 (.15), 2 (.08) ...
    order = probs.argsort(descending=True).tolist()
    before = probs[order].cumsum(0) - probs[order]
    nucleus = {order[i] for i in range(len(order)) if before[i] < 0.8}
    assert seen_p == nucleus == {0, 1, 4}


def test_seeded_sampling_is_reproducible(bf16_engine):
    prompt = _prompt(8, 6)

    def run(seed):
        params = SamplingParams(max_new_tokens=16, seed=seed, ignore_eos=True)
        return bf16_engine.generate([GenerationRequest(prompt, params)])[0].token_ids

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_serving_copy_leaves_the_source_model_and_its_replay_backend_alone():
    trainer = build_tiny_moe(seed=0)  # fp32, with a router backend that is recording
    backend = as_backend(trainer)
    backend.start_recording()
    engine = GenerationEngine(trainer)
    out = engine.generate([GenerationRequest([4, 5, 6], SamplingParams(4), return_routed_experts=True)])[0]
    assert out.routed_experts.shape == (6, 4, 2)
    with pytest.raises(RuntimeError, match="no forward pass"):
        backend.stop_recording()  # the serving forwards never reached the trainer's hooks
    assert next(trainer.parameters()).dtype == torch.float32
    assert all(
        torch.equal(a.to(torch.bfloat16), b)
        for a, b in zip(trainer.state_dict().values(), engine.model.state_dict().values(), strict=True)
    )


def test_sampling_params_and_request_validation(bf16_engine):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"^top_p must be a number > 0 and <= 1, got 0.0$"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"^temperature must be a number >= 0, got nan$"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="seed must be an integer"):
        SamplingParams(seed=True)
    with pytest.raises(
        ValueError, match=r"prompt_ids holds token id 96 at index 1; expected ids in \[0, 96\)"
    ):
        bf16_engine.check_request(GenerationRequest([1, 96]))
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        bf16_engine.check_request(GenerationRequest([]))
    with pytest.raises(ValueError, match="routed_experts_prompt_start must be <= the prompt length 2"):
        bf16_engine.check_request(GenerationRequest([1, 2], routed_experts_prompt_start=3))


def test_close_leaves_no_submitted_request_pending_and_no_worker_alive():
    """Submits racing close() either run to completion or are refused at submit."""
    engine = GenerationEngine(build_tiny_moe(seed=0), EngineConfig(dtype=torch.float32))
    request = GenerationRequest([3, 4, 5], SamplingParams(max_new_tokens=1, temperature=0.0))
    futures, refused = [], []
    go = threading.Event()

    def submitter():
        go.wait()
        while True:
            try:
                futures.append(engine.submit(request))
            except RuntimeError as exc:
                refused.append(str(exc))
                return

    threads = [threading.Thread(target=submitter) for _ in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many thread switches, so submits interleave with close()
    try:
        for thread in threads:
            thread.start()
        go.set()
        while not futures:
            pass
        engine.close()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert refused == ["the generation engine is closed"] * 3
    assert all(f.done() for f in futures)
    assert all(f.result().token_ids and f.exception() is None for f in futures)
    assert not engine._worker.is_alive()


# --------------------------------------------------------------------------- weights


def test_update_weights_in_process_matches_a_server_of_the_new_model():
    new_model = build_tiny_moe(seed=1)  # fp32 "trainer" weights
    reference = GenerationEngine(new_model)
    request = GenerationRequest(_prompt(9, 7), SamplingParams(max_new_tokens=10, seed=3), True)
    with RolloutServer(build_tiny_moe(seed=0)) as srv:
        before = srv.engine.generate([request])[0]
        n = srv.update_weights(new_model.state_dict())
        assert n == len(new_model.state_dict()) and srv.weight_version == 1
        after = srv.engine.generate([request])[0]
        assert srv.engine.model.dtype == torch.bfloat16
    expected = reference.generate([request])[0]
    assert after.token_ids == expected.token_ids and after.token_ids != before.token_ids
    assert (after.routed_experts == expected.routed_experts).all()
    assert after.weight_version == 1 and before.weight_version == 0
    assert next(new_model.parameters()).dtype == torch.float32  # the caller's model is untouched


EMBED = "model.embed_tokens.weight"
BAD_STATE_DICTS = [
    (
        "unknown name",
        lambda g: {**g, "bogus.weight": torch.zeros(1)},
        r"not parameters or persistent buffers",
    ),
    (
        "non-persistent buffer",
        lambda g: {**g, "model.rotary_emb.inv_freq": torch.zeros(4)},
        r"not parameters or persistent buffers of the model, e.g. \['model.rotary_emb.inv_freq'\]",
    ),
    (
        "shape",
        lambda g: {**g, EMBED: torch.zeros(3, 64)},
        rf"state_dict\['{EMBED}'\] has shape \(3, 64\), the model expects \(96, 64\)",
    ),
    ("int64", lambda g: {**g, EMBED: g[EMBED].long()}, r"has dtype torch.int64; the model's floating tensor"),
    ("bool", lambda g: {**g, EMBED: g[EMBED] > 0}, r"has dtype torch.bool"),
    ("uint8", lambda g: {**g, EMBED: g[EMBED].to(torch.uint8)}, r"has dtype torch.uint8"),
    ("fp8", lambda g: {**g, EMBED: g[EMBED].to(torch.float8_e4m3fn)}, r"has dtype torch.float8_e4m3fn"),
    (
        "nan",
        lambda g: {**g, EMBED: g[EMBED].clone().index_fill_(0, torch.tensor([3]), float("nan"))},
        rf"^state_dict\['{EMBED}'\] holds 64 values that are not finite in the serving dtype torch.bfloat16",
    ),
    (
        "inf",
        lambda g: {**g, "lm_head.weight": g["lm_head.weight"] / 0.0},
        r"'lm_head.weight'\] holds .* values that are not finite",
    ),
    (  # finite in float32, inf once cast into the engine's bfloat16
        "float32 overflow",
        lambda g: {**g, EMBED: g[EMBED].clone().index_fill_(0, torch.tensor([3]), 3.4e38)},
        rf"^state_dict\['{EMBED}'\] holds 64 values that are not finite in the serving dtype torch.bfloat16",
    ),
    (
        "float64 overflow",
        lambda g: {**g, EMBED: g[EMBED].double().index_fill_(0, torch.tensor([3, 5]), 1e300)},
        rf"^state_dict\['{EMBED}'\] holds 128 values that are not finite",
    ),
    (
        "strict missing",
        lambda g: {k: v for k, v in g.items() if k != EMBED},
        "state_dict lacks 1 model names",
    ),
]


@pytest.mark.parametrize(("case", "make", "message"), BAD_STATE_DICTS, ids=[c for c, _, _ in BAD_STATE_DICTS])
def test_update_weights_rejects_bad_state_dicts_without_changing_anything(bf16_engine, case, make, message):
    snapshot = {k: v.clone() for k, v in bf16_engine.model.state_dict().items()}
    inv_freq = bf16_engine.model.model.rotary_emb.inv_freq.clone()
    good = build_tiny_moe(seed=5).state_dict()
    with pytest.raises(ValueError, match=message):
        bf16_engine.update_weights(make(good), strict=case == "strict missing")
    after = bf16_engine.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in snapshot.items())
    assert torch.equal(bf16_engine.model.model.rotary_emb.inv_freq, inv_freq)
    assert bf16_engine.weight_version == 0
