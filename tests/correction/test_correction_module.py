"""Corrections in a real Lightning training run: ``GRPOModule`` with every mode and replay mode,
and the docs recipe (a user's own LightningModule), against per-trajectory float64 references."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from sync_detector import ArmDetector, DisarmDetector, SyncDetector
from torch.utils.data import DataLoader

from r3lightning.app.job.grpo import GRPOConfig, policy_loss, token_logprobs
from r3lightning.app.job.module import GRPOModule, OptimConfig
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.serve.config import EngineConfig
from r3lightning.app.serve.engine import GenerationEngine, GenerationRequest
from r3lightning.app.serve.sampling import SamplingParams
from r3lightning.correction import MODES, CorrectionConfig, CorrectionMetrics, correction_weights
from r3lightning.data.collate import collate_trajectories
from r3lightning.packed import PackedTensor
from r3lightning.padded import position_ids_from_mask
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import replay_routes
from r3lightning.rollout.trajectory import Trajectory


@pytest.fixture(scope="module")
def rollouts():
    """Two batches of three trajectories from the embedded engine at 15% simulated disagreement
    (with the engine's routes, and without them as for r2), each trajectory's response-token
    log-ratios rescored alone and unpadded in float64 (routed natively and with the engine's routes
    replayed by hand), and the correction settings the tests use.

    The premise "the cap or the band is at work on some tokens, not all" must not rest on one CPU's
    float results, so it holds by construction: the settings come from the observed log-ratios of
    trajectories 1..5 (the cap above, the band around every one of them), and trajectory 0's engine
    logprobs are lowered so that each of its log-ratios lies past both."""
    model = build_tiny_moe(seed=0)
    engine = GenerationEngine(model, EngineConfig(simulated_disagreement=0.15))
    g = torch.Generator().manual_seed(5)
    requests = [
        GenerationRequest(
            torch.randint(3, 96, (4 + 3 * i,), generator=g).tolist(),
            SamplingParams(max_new_tokens=5 + i, seed=10 + i, ignore_eos=True),
            return_routed_experts=True,
        )
        for i in range(6)
    ]
    outs = engine.generate(requests)
    native, replayed = [], []
    for request, out in zip(requests, outs, strict=True):
        ids = torch.tensor([[*request.prompt_ids, *out.token_ids]])
        n, p = ids.shape[1], len(request.prompt_ids)
        rows = torch.from_numpy(out.routed_experts).long()
        routes = torch.cat([rows, rows[-1:]])[None]  # the last token is never forwarded
        mask = torch.ones(1, n, dtype=torch.bool)
        mask[0, -1] = False
        with torch.no_grad():
            arms = [model(input_ids=ids).logits[0].double()]
            with replay_routes(model, routes, mask):
                arms.append(model(input_ids=ids).logits[0].double())
        for sink, logits in zip((native, replayed), arms, strict=True):
            logp = logits.log_softmax(-1)
            sink.append([logp[t - 1, ids[0, t]].item() - out.logprobs[t - p] for t in range(p, n)])
    rest = [x for arm in (native, replayed) for seq in arm[1:] for x in seq]
    sums = [sum(seq) for arm in (native, replayed) for seq in arm[1:]]
    # the cap is >= 2x every other sequence's ratio, so each of them has a token below it too
    cap = max(1.05, 2 * math.exp(max(sums)))
    band = (min(1.0, 0.5 * math.exp(min(rest))), max(1.0, 2 * math.exp(max(rest))))
    shift = 1 + max(math.log(cap), math.log(band[1])) - min(min(arm[0]) for arm in (native, replayed))
    for arm in (native, replayed):
        arm[0] = [x + shift for x in arm[0]]
    trajectories, routeless = [], []
    for i, (request, out) in enumerate(zip(requests, outs, strict=True)):
        logprobs = [lp - shift for lp in out.logprobs] if i == 0 else out.logprobs
        for sink, routes in ((trajectories, out.routed_experts), (routeless, None)):
            sink.append(
                Trajectory(
                    request.prompt_ids,
                    out.token_ids,
                    rollout_logprobs=logprobs,
                    advantage=1.0,
                    routed_experts=routes,
                )
            )
    batches = {
        name: [collate_trajectories(trajs[:3]), collate_trajectories(trajs[3:])]
        for name, trajs in (("routes", trajectories), ("none", routeless))
    }
    settings = {"threshold": cap, "lower": band[0], "upper": band[1]}
    return batches, {"native": native, "replayed": replayed}, settings


def reference(
    log_ratios: list[list[float]], config: CorrectionConfig, steps: bool = True
) -> dict[str, float]:
    """The step's correction/* over every response token of ``log_ratios``, in Python floats; with
    ``steps``, the one step's own ``<mode>/*`` too (the GRPO module logs them: it has the log-ratios)."""
    weights, truncated, masked = [], 0, 0
    for seq in log_ratios:
        if config.mode == "token_tis":
            w = [min(math.exp(x), config.threshold) for x in seq]
            truncated += sum(math.exp(x) >= config.threshold for x in seq)
        elif config.mode == "sequence_tis":
            w = [min(math.exp(sum(seq)), config.threshold)] * len(seq)
            truncated += len(seq) * (math.exp(sum(seq)) >= config.threshold)
        elif config.mode == "geometric_mask":
            w = [float(config.lower <= math.exp(sum(seq) / len(seq)) <= config.upper)] * len(seq)
            masked += len(seq) - sum(w)
        else:
            w = [float(config.lower <= math.exp(x) <= config.upper) for x in seq]
            masked += len(seq) - sum(w)
        weights += w
    n = len(weights)
    out = {
        "weight_mean": sum(weights) / n,
        "weight_max": max(weights),
        "ess": sum(weights) ** 2 / (n * sum(v * v for v in weights)),
        "truncated_fraction": truncated / n,
        "masked_fraction": masked / n,
        "loss_tokens": float(n),
    }
    if steps and "tis" in config.mode:
        out |= {
            f"{config.mode}/weight_mean": out["weight_mean"],
            f"{config.mode}/truncated_fraction": truncated / n,
        }
    elif steps:
        out[f"{config.mode}/masked_fraction"] = masked / n
    return out


def fit(module: pl.LightningModule, batches, replay: str) -> dict[str, float]:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RouterReplayCallback(backend="hf", mode=replay)],
    )
    trainer.fit(module, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    return {
        k.removeprefix("correction/"): float(v)
        for k, v in trainer.callback_metrics.items()
        if k.startswith("correction/")
    }


def _close(got: dict[str, float], expected: dict[str, float], tokens: float) -> bool:
    return set(got) == set(expected) and all(
        got[k] == pytest.approx(v, rel=2e-4, abs=1.01 / tokens if "fraction" in k else 1e-6)
        for k, v in expected.items()
    )


@pytest.mark.slow
@pytest.mark.parametrize("replay,forward", [("r3", "replayed"), ("off", "native"), ("r2", "native")])
def test_the_loss_forward_gives_the_log_ratios_in_every_replay_mode(rollouts, replay, forward):
    """token_tis over two batches of one RL step (lr 0: the same weights in both): the logged
    ratios are sums over both batches of the log-ratios of the forward the loss used, the replayed
    one under r3, the trainer's own routing under off and r2 (whose routes it recorded)."""
    batches, log_ratios, settings = rollouts
    batches = batches["none" if replay == "r2" else "routes"]  # r2: an engine that returns no routes
    config = CorrectionConfig(mode="token_tis", threshold=settings["threshold"])
    module = GRPOModule(
        build_tiny_moe(seed=0),
        GRPOConfig(correction=config),
        OptimConfig(lr=0.0),
        recompute_old_logprobs=replay == "r2",
    )
    got = fit(module, batches, replay)
    expected = reference(log_ratios[forward], config)
    other = reference(log_ratios["replayed" if forward == "native" else "native"], config)
    tokens = expected["loss_tokens"]
    assert _close(got, expected, tokens), (got, expected)
    assert not _close(got, other, tokens)  # the two forwards are told apart at this disagreement
    assert 0 < got["truncated_fraction"] < 1 and got["ess"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_grpo_module_logs_every_mode(rollouts, mode):
    batches, log_ratios, settings = rollouts
    batches = batches["routes"]
    config = CorrectionConfig(mode=mode, **settings)
    module = GRPOModule(build_tiny_moe(seed=0), GRPOConfig(correction=config), OptimConfig(lr=0.0))
    got = fit(module, batches, "r3")
    if mode == "none":  # nothing applied, nothing logged
        assert got == {}
        return
    expected = reference(log_ratios["replayed"], config)
    assert _close(got, expected, expected["loss_tokens"]), (got, expected)
    share = got["truncated_fraction" if "tis" in mode else "masked_fraction"]
    assert 0 < share < 1  # the cap or the band is at work (by the fixture's construction)


# ---------------------------------------------------------------------------- the docs recipe


class MyPolicy(pl.LightningModule):
    """A user's own GRPO LightningModule with truncated importance sampling on top of R3."""

    def __init__(self, model, correction: CorrectionConfig):
        super().__init__()
        self.model = model.train()  # from_pretrained hands out eval-mode models
        self.correction = correction
        self.correction_metrics = CorrectionMetrics(correction)

    def training_step(self, batch, batch_idx):
        mask = batch.attention_mask  # [B, S] left-padded
        logits = self.model(
            input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask)
        ).logits
        logprobs = token_logprobs(logits, batch.input_ids)  # [B, S]; the replayed forward under R3
        loss_mask = batch.loss_mask.to(logprobs.dtype)
        log_ratio = logprobs.detach() - batch.rollout_logprobs  # log p_trainer - log p_engine
        weights = correction_weights(log_ratio, loss_mask, self.correction)  # detached, 0 off the mask
        loss, _ = policy_loss(logprobs, batch.rollout_logprobs, batch.advantages, loss_mask, weights=weights)
        self.correction_metrics.update(weights, loss_mask)  # once per micro-batch
        metrics = self.correction_metrics.compute(sync_dist=True)  # exact sums over ranks
        self.log_dict({k: v.float() for k, v in metrics.items()}, batch_size=1)
        self.correction_metrics.reset()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


@pytest.mark.slow
def test_docs_recipe_runs_and_logs_the_replayed_correction(rollouts):
    batches, log_ratios, settings = rollouts
    config = CorrectionConfig(mode="token_tis", threshold=settings["threshold"])
    got = fit(MyPolicy(build_tiny_moe(seed=0), config), batches["routes"][:1], "r3")
    expected = reference(log_ratios["replayed"][:3], config, steps=False)  # no log-ratios passed
    assert _close(got, expected, expected["loss_tokens"]), (got, expected)


# ---------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize("mode", MODES[1:])
def test_a_corrected_grpo_step_makes_no_host_sync(rollouts, mode):
    detector = SyncDetector()
    config = CorrectionConfig(mode=mode, **rollouts[2])
    module = GRPOModule(build_tiny_moe(seed=0), GRPOConfig(correction=config))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ArmDetector(detector), RouterReplayCallback(), DisarmDetector(detector)],
    )
    with detector:
        trainer.fit(module, DataLoader(rollouts[0]["routes"][:1], batch_size=None, collate_fn=lambda b: b))
    assert detector.syncs == []
    assert "correction/ess" in trainer.callback_metrics


def test_packed_corrections_and_metrics_make_no_host_sync():
    detector = SyncDetector()
    host = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    device_cu = host.clone()  # the offsets a GPU batch carries next to its host copy
    log_ratio = PackedTensor(torch.randn(8) * 0.3, device_cu, cu_seqlens_host=host)
    mask = PackedTensor(torch.ones(8), device_cu, cu_seqlens_host=host)
    detector.mark(log_ratio.values, mask.values, device_cu)
    with detector:
        detector.armed = True
        for mode in MODES:
            config = CorrectionConfig(mode=mode)
            metrics = CorrectionMetrics(config)
            metrics.update(correction_weights(log_ratio, mask, config), mask)
            metrics.compute(sync_dist=True)
    assert detector.syncs == []
