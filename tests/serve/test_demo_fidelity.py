"""Demo fidelity: a batch-invariant engine, per-request failures, the simulated disagreement knob,
float64 k3 and the paired native-vs-replayed mismatch, each against an independent reference."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from decimal import Decimal, getcontext

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from r3lightning.app.job.grpo import GRPOConfig, k3_terms, mismatch_metrics
from r3lightning.app.job.module import GRPOModule
from r3lightning.app.models.tiny import build_tiny_moe, tiny_family_config
from r3lightning.app.serve.config import EngineConfig
from r3lightning.app.serve.engine import GenerationEngine, GenerationRequest
from r3lightning.app.serve.invariance import RowTiledLinear
from r3lightning.app.serve.sampling import SamplingParams
from r3lightning.data.collate import collate_trajectories
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.rollout.trajectory import Trajectory

MOE_LAYERS = [1, 2, 3]  # the tiny Qwen3-MoE: layer 0 is dense


def _requests(count: int = 16, seed: int = 1) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(seed)
    return [
        GenerationRequest(
            torch.randint(3, 96, (3 + (7 * i) % 23,), generator=g).tolist(),  # 3..25 tokens
            SamplingParams(max_new_tokens=6 + i % 5, seed=100 + i, ignore_eos=True),
            return_routed_experts=True,
        )
        for i in range(count)
    ]


def _same(a, b) -> bool:
    return (
        a.token_ids == b.token_ids
        and a.logprobs == b.logprobs
        and a.routed_experts.shape == b.routed_experts.shape
        and bool((a.routed_experts == b.routed_experts).all())
    )


# ---------------------------------------------------------------------------- engine


def test_engine_is_batch_invariant_concurrent_vs_one_by_one():
    """16 seeded requests of 3..25 prompt tokens: served concurrently (threads, one shared
    batching worker), as one batch in two orders, and one by one: bitwise the same answers."""
    engine = GenerationEngine(build_tiny_moe(seed=0), EngineConfig(max_batch_size=16, batch_wait_s=0.05))
    assert engine.batch_invariant
    requests = _requests()
    alone = [engine.generate([r])[0] for r in requests]
    batched = engine.generate(requests)
    reversed_batch = engine.generate(requests[::-1])[::-1]
    with ThreadPoolExecutor(16) as pool:
        concurrent = [f.result() for f in [pool.submit(engine.submit, r) for r in requests]]
    concurrent = [f.result(timeout=120) for f in concurrent]
    engine.close()
    for got in (batched, reversed_batch, concurrent):
        assert all(_same(a, b) for a, b in zip(alone, got, strict=True))


def test_engine_without_batch_invariance_depends_on_the_batch():
    """The check above is sensitive: the plain padded batch forward gives other numbers."""
    engine = GenerationEngine(build_tiny_moe(seed=0), EngineConfig(batch_invariant=False))
    requests = _requests()
    alone = [engine.generate([r])[0] for r in requests]
    assert not all(_same(a, b) for a, b in zip(alone, engine.generate(requests), strict=True))


def test_batch_invariance_is_refused_where_unsupported():
    model = build_tiny_moe(tiny_family_config("gpt_oss"), seed=0)  # sliding window and sinks
    assert not GenerationEngine(model).batch_invariant  # default: only where supported
    with pytest.raises(ValueError, match="sliding-window attention"):
        GenerationEngine(model, EngineConfig(batch_invariant=True))


def _poisoned(params: SamplingParams) -> SamplingParams:
    # A temperature the sampler overflows on (logits / 1e-300 = inf); set past validation so the
    # sampling itself fails, whatever the parameter checks accept.
    object.__setattr__(params, "temperature", 1e-300)
    return params


def test_a_request_whose_sampling_fails_fails_alone():
    engine = GenerationEngine(build_tiny_moe(seed=0), EngineConfig(max_batch_size=8, batch_wait_s=0.2))
    requests = _requests(8)
    expected = [engine.generate([r])[0] for r in requests]
    poison = replace(requests[3], params=_poisoned(replace(requests[3].params)))
    batch = [*requests[:3], poison, *requests[4:]]
    results = engine.generate(batch, return_exceptions=True)
    assert isinstance(results[3], RuntimeError)
    with pytest.raises(RuntimeError):
        engine.generate(batch)  # without return_exceptions: the request's error is raised
    futures = [engine.submit(r) for r in batch]  # through the batching worker
    with pytest.raises(RuntimeError):
        futures[3].result(timeout=120)
    for i, future in enumerate(futures):
        if i != 3:
            assert _same(future.result(timeout=120), expected[i])
            assert _same(results[i], expected[i])
    assert _same(engine.submit(requests[0]).result(timeout=120), expected[0])  # still serving
    engine.close()


def test_a_batch_whose_forward_fails_is_rerun_request_by_request():
    """A fault injected into the serving model (a forward hook raising on a prefill wider than 30
    tokens): only the request with the 40-token prompt fails; its batch-mates (prompts of at most
    25 tokens) get exactly their answers alone."""
    engine = GenerationEngine(build_tiny_moe(seed=0), EngineConfig(max_batch_size=8, batch_wait_s=0.2))
    requests = _requests(6)
    expected = [engine.generate([r])[0] for r in requests]

    def fault(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > 30:
            raise RuntimeError("injected fault")

    engine.model.register_forward_pre_hook(fault, with_kwargs=True)
    poison = GenerationRequest(list(range(3, 43)), SamplingParams(4, seed=1))
    futures = [engine.submit(r) for r in [*requests[:2], poison, *requests[2:]]]
    with pytest.raises(RuntimeError, match="injected fault"):
        futures[2].result(timeout=120)
    got = [f.result(timeout=120) for i, f in enumerate(futures) if i != 2]
    assert all(_same(a, b) for a, b in zip(expected, got, strict=True))
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_tiled_linear_rows_do_not_depend_on_their_batch(dtype):
    """F.linear may pick kernels by row count (MKL's fp32 GEMM does: row i among 300 rows is not
    bitwise row i alone); on fixed tiles each row is what it is alone, with F.linear's values."""
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    x = torch.randn(3, 100, 64, dtype=dtype)  # 300 rows, a 3-D input as the model's layers get
    with RowTiledLinear(16):
        tiled = torch.nn.functional.linear(x, weight, bias)
        alone = torch.stack(
            [torch.nn.functional.linear(x[i, j], weight, bias) for i in range(3) for j in range(100)]
        )
    assert tiled.shape == (3, 100, 64) and torch.equal(tiled.reshape(300, 64), alone)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(tiled, torch.nn.functional.linear(x, weight, bias), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="tile_rows must be an integer >= 1"):
        RowTiledLinear(0)


# ---------------------------------------------------------------------------- knob


def _slot_disagreement(a: np.ndarray, b: np.ndarray) -> float:
    """Share of a's expert slots (MoE layers) that b's set for the same token and layer lacks."""
    differ = total = 0
    for row_a, row_b in zip(a, b, strict=True):
        for layer in MOE_LAYERS:
            ours = set(row_b[layer].tolist())
            differ += sum(e not in ours for e in row_a[layer].tolist())
            total += len(row_a[layer])
    return differ / total


def _prefill_routes(engine: GenerationEngine, prompts: list[list[int]]) -> np.ndarray:
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    outs = engine.generate([GenerationRequest(p, greedy, return_routed_experts=True) for p in prompts])
    return np.concatenate([o.routed_experts for o in outs])  # [tokens, L, K]: the prompts' rows


@pytest.mark.parametrize("target", [0.1, 0.25])
def test_simulated_disagreement_hits_its_target_on_unseen_prompts(target):
    model = build_tiny_moe(seed=0)
    plain = GenerationEngine(model)
    knob = GenerationEngine(model, EngineConfig(simulated_disagreement=target))
    assert knob.perturbation.measured == pytest.approx(target, abs=0.01)  # on its probe batch
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 96, (12,), generator=g).tolist() for _ in range(12)]
    measured = _slot_disagreement(_prefill_routes(knob, prompts), _prefill_routes(plain, prompts))
    assert measured == pytest.approx(target, abs=0.35 * target)
    # weight updates recalibrate: the target still holds for the new weights
    new = build_tiny_moe(seed=5).state_dict()
    for engine in (plain, knob):
        engine.update_weights(new)
    measured = _slot_disagreement(_prefill_routes(knob, prompts), _prefill_routes(plain, prompts))
    assert knob.perturbation.measured == pytest.approx(target, abs=0.01)
    assert measured == pytest.approx(target, abs=0.35 * target)
    # the scale depends on the weights only, not on what the engine was calibrated for before
    fresh = GenerationEngine(build_tiny_moe(seed=5), EngineConfig(simulated_disagreement=target))
    assert fresh.perturbation.scale == knob.perturbation.scale


def test_simulated_disagreement_zero_is_exact_and_bad_values_are_refused():
    model = build_tiny_moe(seed=0)
    prompts = [[4, 5, 6, 7, 8], [9, 10, 11]]
    assert (
        _prefill_routes(GenerationEngine(model, EngineConfig(simulated_disagreement=0.0)), prompts)
        == _prefill_routes(GenerationEngine(model), prompts)
    ).all()
    for bad in (0.7, -0.1, "0.1", True):
        with pytest.raises(
            ValueError, match=r"^simulated_disagreement must be None or a number >= 0 and <= 0.5, got"
        ):
            GenerationEngine(model, EngineConfig(simulated_disagreement=bad))
    with pytest.raises(ValueError, match="does not select the top-k of its logits"):
        GenerationEngine(
            build_tiny_moe(tiny_family_config("deepseek_v3"), seed=0),
            EngineConfig(simulated_disagreement=0.1),
        )


# ---------------------------------------------------------------------------- k3


@pytest.mark.parametrize("x", [1e-9, -3e-8, 1e-6, -2.5e-5, 4e-4, -0.3, 1.2])
def test_k3_is_float64_accurate_at_tiny_ratios(x):
    getcontext().prec = 60
    exact = Decimal(x).exp() - 1 - Decimal(x)  # from the float64 value itself, 60 digits
    got = k3_terms(torch.tensor([x], dtype=torch.float64))
    assert got.dtype == torch.float64
    assert float(got[0]) == pytest.approx(float(exact), rel=1e-9)
    # float32 logprobs: their difference is exact in float64, so the metric keeps this accuracy
    a = torch.tensor([[-2.0, -2.0 + x]], dtype=torch.float32)
    m = mismatch_metrics(a[:, 1:], a[:, :1], torch.ones(1, 1))
    x32 = float(a[0, 1].double() - a[0, 0].double())
    exact32 = Decimal(x32).exp() - 1 - Decimal(x32)
    assert m["k3_kl"].item() == pytest.approx(float(exact32), rel=1e-9) and m["k3_kl"].item() >= 0


# ---------------------------------------------------------------------------- paired metrics


def test_paired_mismatch_matches_a_hand_computation_on_one_batch():
    """Engine rollouts at 15% simulated disagreement; each trajectory rescored alone, unpadded,
    natively and with its routes installed by hand; k3, band and agreement in Python floats."""
    model = build_tiny_moe(seed=0)
    engine = GenerationEngine(model, EngineConfig(simulated_disagreement=0.15))
    requests = _requests(6)
    outs = engine.generate(requests)
    trajectories = [
        Trajectory(r.prompt_ids, o.token_ids, rollout_logprobs=o.logprobs, routed_experts=o.routed_experts)
        for r, o in zip(requests, outs, strict=True)
    ]
    batch = collate_trajectories(trajectories)
    backend = HFRouterReplay.for_model(model)
    module = GRPOModule(model, GRPOConfig(ratio_band=1.02))  # a narrow band: some tokens fall out
    module.trainer = pl.Trainer(callbacks=[RouterReplayCallback(backend=backend)], logger=False)
    got = {k: float(v) for k, v in module.measure_mismatch(batch).items()}

    k3 = {"native": [], "replayed": []}
    band = {"native": [], "replayed": []}
    hits = slots = 0
    entropies = []
    for traj, out in zip(trajectories, outs, strict=True):
        ids = torch.tensor([[*traj.prompt_ids.tolist(), *traj.response_ids.tolist()]])
        n, p = ids.shape[1], len(traj.prompt_ids)
        rows = torch.from_numpy(out.routed_experts).long()  # [n - 1, L, K]: token n - 1 uncaptured
        routes = torch.cat([rows, rows[-1:]])[None]  # the last row is a placeholder, not replayed
        mask = torch.ones(1, n, dtype=torch.bool)
        mask[0, -1] = False
        with torch.no_grad():
            with record_routes(model) as native_rec:
                native_logits = model(input_ids=ids).logits[0].double()
            with replay_routes(model, routes, mask):
                replayed_logits = model(input_ids=ids).logits[0].double()
        for arm, logits in (("native", native_logits), ("replayed", replayed_logits)):
            for t in range(p, n):
                row = logits[t - 1].tolist()
                lse = math.log(sum(math.exp(v) for v in row))
                x = (row[ids[0, t]] - lse) - out.logprobs[t - p]
                k3[arm].append(math.expm1(x) - x)
                band[arm].append(float(abs(x) > math.log(1.02)))
                if arm == "native":
                    probs = [math.exp(v - lse) for v in row]
                    entropies.append(-sum(q * math.log(q) for q in probs))
        native_rows = native_rec.routes[0].numpy()
        for t in range(n - 1):
            for layer in MOE_LAYERS:
                ours = set(native_rows[t, layer].tolist())
                hits += sum(e in ours for e in out.routed_experts[t, layer].tolist())
                slots += out.routed_experts.shape[-1]

    def mean(values):
        return sum(values) / len(values)

    assert got["k3_native"] == pytest.approx(mean(k3["native"]), rel=1e-3)
    assert got["k3_replayed"] == pytest.approx(mean(k3["replayed"]), rel=1e-3)
    assert got["outside_band_native"] == pytest.approx(mean(band["native"]), abs=1e-9)
    assert got["outside_band_replayed"] == pytest.approx(mean(band["replayed"]), abs=1e-9)
    assert got["native_agreement"] == pytest.approx(hits / slots, abs=1e-12)
    assert got["policy_entropy"] == pytest.approx(mean(entropies), rel=1e-4)
    # the measurement means something here: replay cuts the mismatch on the same weights
    assert 0.75 < got["native_agreement"] < 0.95
    assert got["k3_replayed"] * 3 < got["k3_native"]
    assert not backend.installed and not backend.recording  # nothing left behind


# ---------------------------------------------------------------------------- the job


def _burn(stop: threading.Event) -> None:
    """Competes for the interpreter in bursts (2 ms busy, 2 ms idle): request timing changes,
    nothing starves."""
    x = 0
    while not stop.is_set():
        until = time.perf_counter() + 0.002
        while time.perf_counter() < until:
            x = (x * 31 + 7) % 1_000_003
        time.sleep(0.002)


@pytest.mark.slow
def test_same_seed_gives_identical_metrics_rows_under_load(tmp_path):
    """Both arms, twice: once on a quiet engine taking every request of a step in one batch, once
    while threads compete with the engine and requests trickle in a few at a time (what machine
    load does to the batches): identical rows except the wall-clock columns (rollout_s, train_s)."""
    from r3lightning.app.job.main import compose_config, run

    overrides = [
        "experiment=compare",
        "seeds=1",
        "steps=2",
        "prompts_per_step=4",
        "plot=false",
        "trainer.enable_progress_bar=false",
    ]
    histories = []
    for attempt in range(2):
        stop = threading.Event()
        burners = [threading.Thread(target=_burn, args=(stop,), daemon=True) for _ in range(2 * attempt)]
        for burner in burners:
            burner.start()
        try:
            batching = (
                []
                if attempt == 0
                else ["rollout.server.max_batch_size=5", "rollout.collector.max_in_flight=3"]
            )
            histories.append(run(compose_config([*overrides, *batching]), tmp_path / f"run{attempt}"))
        finally:
            stop.set()
    first = histories[0]
    assert set(first) == {"replay=r3", "replay=off"}
    for name in first:
        rows = [[{k: v for k, v in r.items() if not k.endswith("_s")} for r in h[name]] for h in histories]
        assert rows[0] == rows[1] and len(rows[0]) == 2
        assert "mismatch/k3_native" in rows[0][0] and "mismatch/native_agreement" in rows[0][0]
    # step 0: the same weights and rollouts in both arms, so the same paired figures
    keys = [k for k in first["replay=r3"][0] if k.startswith("mismatch/")]
    assert {k: first["replay=r3"][0][k] for k in keys} == {k: first["replay=off"][0][k] for k in keys}


@pytest.mark.slow
def test_paired_mismatch_every_n_steps(tmp_path):
    from r3lightning.app.job.main import compose_config, run

    overrides = ["steps=3", "prompts_per_step=2", "plot=false", "trainer.enable_progress_bar=false"]
    history = run(compose_config([*overrides, "algorithm.mismatch_every_n_steps=2"]), tmp_path)["replay=r3"]
    assert ["mismatch/k3_native" in r for r in history] == [True, False, True]
    assert all(0.9 < r["mismatch/native_agreement"] < 1.0 for r in history[::2])  # bf16 vs fp32 flips


def test_job_passes_the_engine_settings_and_names_a_bad_one(tmp_path):
    from r3lightning.app.job.main import compose_config, run
    from r3lightning.app.job.setup import JobError

    cfg = compose_config(["experiment=compare_realistic"])
    assert cfg.rollout.server.simulated_disagreement == 0.1 and list(cfg.compare) == ["r3", "off"]
    with pytest.raises(
        JobError,
        match=r"^rollout.server.simulated_disagreement must be None or a number >= 0 and <= 0.5, got 0.7$",
    ):
        run(compose_config(["rollout.server.simulated_disagreement=0.7"]), tmp_path)
    with pytest.raises(JobError, match=r"rollout\.server: batch-invariant serving is not supported"):
        run(compose_config(["model.family=gpt_oss", "rollout.server.batch_invariant=true"]), tmp_path)
    with pytest.raises(JobError, match=r"algorithm\.mismatch_every_n_steps must be an integer >= 0"):
        run(compose_config(["algorithm.mismatch_every_n_steps=-1"]), tmp_path)
