"""What R3 costs per training step: ``replay=r3`` against ``replay=off`` on one model, batch and weights.

A step is what a user of the package feels, run by a real Lightning ``Trainer``: ``R3DataModule``
collation, ``transfer_batch_to_device``, ``RouterReplayCallback``'s layout + align + install (r3)
or recording + comparison (off, the job's ``replay=off``: routes still collated to log the
mismatch), forward, backward, the AdamW step, and clearing. The two arms alternate inside one fit
(r3 off off r3 r3 off ...) on identical batches, the weights restored after every step (outside
the clock), so both run the same forward on the same weights; the figure is each arm's median.

The route work is then timed piece by piece with the package's own functions, in the same run:
parse (``wire.response.parse_response`` of the batch's SkyRL bodies, with routes minus without),
collate (the data module's collator, with routes minus without), transfer, layout + align, install,
and the router hooks' replay in forward + backward (replayed minus native). Engine routes come from
a copy of the model whose router logits are perturbed to a SIMULATED ~10% slot disagreement
(``serve.perturb``), so replay changes ~10% of the experts, as in production.

Each run checks that the timed steps did what they claim (r3: every route expert used, the loss of
an independent replayed forward; off: nothing replayed, the native loss) and exits 1 otherwise.
Usage: ``python benchmarks/bench_step.py [--quick] [--repeats N] [--threads N] [--models tiny,mid]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import _common
import lightning.pytorch as pl
import orjson
import torch

from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.collate import collate_trajectories
from r3lightning.data.datamodule import R3DataModule
from r3lightning.data.trajectory import Trajectory
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.serve.perturb import RouterLogitPerturbation
from r3lightning.testing.tiny import build_tiny_moe, tiny_moe_config
from r3lightning.wire.codec import encode_routes
from r3lightning.wire.request import RouteSchema
from r3lightning.wire.response import parse_response

TARGET = 1.02  # r3 step / off step on the CPU
DISAGREEMENT = 0.10  # simulated engine/trainer slot disagreement (R3 paper, Qwen3-30B-A3B)
ARMS = ("r3", "off")


@dataclass(frozen=True)
class StepCase:
    """A model config and a batch: ``lengths`` real tokens per trajectory, ``prompt`` of them prompt."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)  # tiny_moe_config overrides
    lengths: tuple[int, ...] = ()
    prompt: int = 8

    @property
    def label(self) -> str:
        c = tiny_moe_config(**self.config)
        dense = len(c.mlp_only_layers)
        return (
            f"{self.name}: Qwen3-MoE {c.num_hidden_layers} layers ({dense} dense), {c.num_experts} experts, "
            f"top-{c.num_experts_per_tok}, hidden {c.hidden_size}, expert width {c.moe_intermediate_size}; "
            f"batch {len(self.lengths)} x {min(self.lengths)}-{max(self.lengths)} = {sum(self.lengths)} tokens"
        )


def _spread(batch: int, total: int) -> tuple[int, ...]:
    """``batch`` lengths from 0.5x to 1.5x the mean, summing to ``total`` (a typical RL spread)."""
    mean = total // batch
    lengths = [mean // 2 + (mean * i) // max(batch - 1, 1) for i in range(batch)]
    lengths[-1] += total - sum(lengths)
    return tuple(lengths)


_MID = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "mlp_only_layers": [],
    "max_position_embeddings": 1024,
}


def cases(quick: bool) -> dict[str, StepCase]:
    tiny = StepCase("tiny", {}, _spread(8, 128), prompt=4)
    if quick:  # the mid-size schema (8 x 64 x top-8) on a small batch and narrower layers
        mid = StepCase("mid", {**_MID, "moe_intermediate_size": 32}, _spread(4, 256), prompt=16)
    else:
        mid = StepCase("mid", _MID, _spread(8, 4096), prompt=64)
    return {"tiny": tiny, "mid": mid}


# ------------------------------------------------------------------------------------ the batch
def engine_trajectories(case: StepCase, seed: int = 0) -> tuple[list[Trajectory], float]:
    """The batch, its routes recorded by the engine: the model with SIMULATED router disagreement.

    Returns the trajectories (routes for all ``n - 1`` forwarded tokens, uint8 or int16) and the
    calibrated disagreement."""
    config = tiny_moe_config(**case.config)
    engine = build_tiny_moe(config, seed=seed)
    perturbation = RouterLogitPerturbation(engine, DISAGREEMENT, seed=seed)
    backend = HFRouterReplay.for_model(engine, validate=False)

    def probe_routes() -> torch.Tensor:
        with torch.no_grad(), record_routes(backend) as rec:
            engine(perturbation.probe)
        return rec.routes[..., list(backend.moe_layers), :]

    perturbation.calibrate(probe_routes)
    dtype = torch.uint8 if config.num_experts <= 256 else torch.int16
    generator = torch.Generator().manual_seed(seed + 1)
    trajectories = []
    for index, n in enumerate(case.lengths):
        tokens = torch.randint(3, config.vocab_size, (n,), generator=generator)
        with torch.no_grad(), record_routes(backend) as rec:
            engine(tokens[None, :-1])  # the last sampled token is never forwarded: n - 1 rows
        response = n - case.prompt
        trajectories.append(
            Trajectory(
                tokens[: case.prompt],
                tokens[case.prompt :],
                rollout_logprobs=-torch.rand(response, generator=generator),
                advantage=float(index % 2) - 0.5,
                routed_experts=rec.routes[0].to(dtype),
            )
        )
    backend.remove()
    perturbation.remove()
    return trajectories, perturbation.measured


def skyrl_body(trajectory: Trajectory) -> bytes:
    """The SkyRL response body an engine sends for ``trajectory`` (routes from position 0)."""
    choice = {
        "token_ids": trajectory.response_ids.tolist(),
        "finish_reason": "stop",
        "logprobs": {"content": [{"logprob": float(x)} for x in trajectory.rollout_logprobs]},
        "routed_experts": encode_routes(trajectory.routed_experts.numpy()),
    }
    return orjson.dumps({"choices": [choice]})


def without_routes(trajectories: list[Trajectory]) -> list[Trajectory]:
    return [
        Trajectory(
            t.prompt_ids,
            t.response_ids,
            loss_mask=t.loss_mask,
            rollout_logprobs=t.rollout_logprobs,
            advantage=t.advantage,
        )
        for t in trajectories
    ]


# ------------------------------------------------------------------------------------ the step
class Policy(pl.LightningModule):
    """Advantage-weighted token log-likelihood on the loss mask (a policy-gradient step)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model.train()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = policy_loss(self.model, batch)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def policy_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    mask = batch.attention_mask
    logits = model(
        input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=batch.position_ids
    ).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    weight = batch.loss_mask[:, 1:] * batch.advantages[:, None]  # [B, S - 1]
    return -(logp * weight).sum() / batch.loss_mask[:, 1:].sum()


def arm_of(step: int) -> str:
    """r3 off off r3 r3 off ...: each arm runs first in every other pair."""
    return ARMS[(step + step // 2) % 2]


class Alternate(pl.Callback):
    """Hands each step's hooks to the r3 or the off ``RouterReplayCallback`` (:func:`arm_of`),
    times every step from the end of the previous one, then, off the clock, notes what the step
    logged and restores the weights."""

    HOOKS = ("on_fit_start", "on_train_epoch_end", "on_exception", "teardown")

    def __init__(self, callbacks: dict[str, RouterReplayCallback], device: torch.device) -> None:
        self.callbacks, self.device = callbacks, device
        self.seconds: list[float] = []
        self.logged: list[dict[str, float]] = []
        self._start = 0.0
        self._weights: list[torch.Tensor] = []
        for hook in self.HOOKS:
            setattr(self, hook, self._every(hook))

    def _every(self, hook: str):
        def call(*args: Any, **kwargs: Any) -> None:
            for callback in self.callbacks.values():
                getattr(callback, hook)(*args, **kwargs)

        return call

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._weights = [p.detach().clone() for p in pl_module.parameters()]
        synchronize(self.device)
        self._start = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.callbacks[arm_of(batch_idx)].on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.callbacks[arm_of(batch_idx)].on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - self._start)
        metrics = trainer.callback_metrics
        self.logged.append({k.removeprefix("router_replay/"): float(v) for k, v in metrics.items()})
        with torch.no_grad():
            for p, saved in zip(pl_module.parameters(), self._weights, strict=True):
                p.copy_(saved)
        synchronize(self.device)
        self._start = time.perf_counter()


class CheckFailed(AssertionError):
    """A timed step did not compute what its arm claims."""


def reference_losses(model: torch.nn.Module, batch: Any, trajectories: list[Trajectory]) -> dict[str, float]:
    """The loss of each arm's first step, computed apart from the callback: native routing (off),
    and the engine's routes placed on each trajectory's tokens by a plain loop and replayed (r3)."""
    b, s = batch.input_ids.shape
    backend = HFRouterReplay.for_model(model)
    routes = torch.arange(backend.top_k).expand(b, s, backend.num_layers, -1).clone()  # [B, S, L, K]
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i, t in enumerate(trajectories):
        start, rows = s - t.num_tokens, t.routed_experts.shape[0]
        routes[i, start : start + rows] = t.routed_experts.long()
        mask[i, start : start + rows] = True
    with torch.no_grad():
        native = float(policy_loss(model, batch))
        with replay_routes(backend, routes.to(batch.device), mask.to(batch.device)):
            replayed = float(policy_loss(model, batch))
    return {"off": native, "r3": replayed}


def check_steps(clock: Alternate, losses: list[float], reference: dict[str, float]) -> dict[str, float]:
    """Every timed step did what its arm claims; returns the off arm's native agreement."""
    native = []
    for step, (logged, loss) in enumerate(zip(clock.logged, losses, strict=True)):
        arm = arm_of(step)
        expected = {"r3": (1.0, 1.0), "off": (0.0, logged["native_agreement"])}[arm]
        got = (logged["replayed_fraction"], logged["used_agreement"])
        if got != expected:
            raise CheckFailed(
                f"step {step} ({arm}): replayed_fraction, used_agreement = {got}, expected {expected}"
            )
        if abs(loss - reference[arm]) > 1e-5 * abs(reference[arm]):
            raise CheckFailed(
                f"step {step} ({arm}): loss {loss!r}, the {arm} reference gives {reference[arm]!r}"
            )
        if arm == "off":
            native.append(logged["native_agreement"])
    if reference["r3"] == reference["off"]:
        raise CheckFailed("replaying the engine's routes did not change the loss: nothing was replayed")
    return {"native_agreement": sum(native) / len(native)}


def time_steps(
    model: torch.nn.Module,
    trajectories: list[Trajectory],
    device: torch.device,
    repeats: int,
    warmup: int = 1,
) -> dict[str, Any]:
    """Median seconds of each arm's training step (``warmup`` pairs dropped) and the checks' figures."""
    config = model.config
    steps = 2 * (warmup + repeats)
    buffer = ReplayBuffer(num_experts=config.num_experts, vocab_size=config.vocab_size)
    buffer.extend(trajectories * steps)
    data = R3DataModule(buffer, len(trajectories), shuffle=False)
    first = data.transfer_batch_to_device(collate_trajectories(trajectories), device, 0)
    reference = reference_losses(model, first, trajectories)
    clock = Alternate({arm: RouterReplayCallback(mode=arm) for arm in ARMS}, device)
    module = Policy(model)
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=[device.index or 0] if device.type == "cuda" else 1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(module, datamodule=data)
    if len(clock.seconds) != steps:
        raise CheckFailed(f"expected {steps} steps, ran {len(clock.seconds)}")
    figures = check_steps(clock, [float(x) for x in module.losses], reference)
    samples = {arm: [t for i, t in enumerate(clock.seconds) if arm_of(i) == arm][warmup:] for arm in ARMS}
    medians = {arm: statistics.median(values) for arm, values in samples.items()}
    spans = {arm: [_common.ms(min(v)), _common.ms(max(v))] for arm, v in samples.items()}
    return {**medians, **figures, "range": spans, "steps": steps}


# ------------------------------------------------------------------------------------ the pieces
def time_pieces(
    case: StepCase, trajectories: list[Trajectory], model: torch.nn.Module, device: torch.device, repeats: int
) -> dict[str, tuple[float | None, float | None, float]]:
    """piece -> (with routes s, without s, route work s), each timed with the package's own functions."""
    config = tiny_moe_config(**case.config)
    schema = RouteSchema(
        num_layers=config.num_hidden_layers, top_k=config.num_experts_per_tok, num_experts=config.num_experts
    )
    bodies = [skyrl_body(t) for t in trajectories]
    bare = without_routes(trajectories)
    buffer = ReplayBuffer(num_experts=config.num_experts)
    buffer.extend(trajectories)
    data = R3DataModule(buffer, len(trajectories), shuffle=False)
    collate = data.train_dataloader().collate_fn  # the data module's own collator
    host = {"with": collate_trajectories(trajectories), "without": collate_trajectories(bare)}
    if device.type == "cuda":
        host = {k: v.pin_memory() for k, v in host.items()}
    batch = data.transfer_batch_to_device(host["with"], device, 0)
    callback = RouterReplayCallback(backend=HFRouterReplay.for_model(model, validate=False))
    backend = callback.backend
    mask_host = host["with"].attention_mask

    def parse(want: bool) -> list[Any]:
        return [
            parse_response(body, "skyrl", schema, want_routes=want, prompt_len=t.prompt_length)
            for body, t in zip(bodies, trajectories, strict=True)
        ]

    for parsed, t in zip(parse(True), trajectories, strict=True):  # the arms decode what was sent
        if not torch.equal(torch.from_numpy(parsed.routed_experts).long(), t.routed_experts.long()):
            raise CheckFailed("parse_response decoded other routes than the engine sent")

    def collated(items: list[Trajectory]) -> None:
        collate(items).release()  # the pooled buffers go back, as after a transfer

    def align() -> tuple[torch.Tensor, torch.Tensor]:
        return callback.align_routes(batch.routed_experts, callback.build_layout(mask_host))

    routes, replay_mask = align()

    def install() -> None:
        backend.install(routes, replay_mask)
        backend.clear()

    def train(replayed: bool) -> None:
        model.zero_grad(set_to_none=True)
        if replayed:
            backend.install(routes, replay_mask)
        try:
            policy_loss(model, batch).backward()
        finally:
            backend.clear()
        synchronize(device)

    arms = {
        ("parse", "with"): lambda: parse(True),
        ("parse", "without"): lambda: parse(False),
        ("collate", "with"): lambda: collated(trajectories),
        ("collate", "without"): lambda: collated(bare),
        ("transfer", "with"): lambda: (
            data.transfer_batch_to_device(host["with"], device, 0),
            synchronize(device),
        ),
        ("transfer", "without"): lambda: (
            data.transfer_batch_to_device(host["without"], device, 0),
            synchronize(device),
        ),
        ("layout + align", "with"): lambda: (align(), synchronize(device)),
        ("install + clear", "with"): install,
        ("forward + backward", "with"): lambda: train(True),
        ("forward + backward", "without"): lambda: train(False),
    }
    gc.freeze()  # time_arms collects before every call: only the arms' own garbage is scanned
    try:
        times = _common.time_arms(arms, repeats=repeats)
    finally:
        gc.unfreeze()
        data.teardown("fit")
    out = {}
    for piece in dict.fromkeys(name for name, _ in arms):
        with_s, without_s = times[(piece, "with")], times.get((piece, "without"))
        out[piece] = (with_s, without_s, max(0.0, with_s - (without_s or 0.0)))
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(case: StepCase, device: torch.device, repeats: int, piece_repeats: int) -> dict[str, Any]:
    """Both arms' step medians (checked), the route pieces, and the simulated disagreement."""
    trajectories, disagreement = engine_trajectories(case)
    model = build_tiny_moe(tiny_moe_config(**case.config), seed=0).to(device)
    steps = time_steps(model, trajectories, device, repeats)
    pieces = time_pieces(case, trajectories, model, device, piece_repeats)
    return {**steps, "pieces": pieces, "disagreement": disagreement}


def report(case: StepCase, result: dict[str, Any]) -> float:
    """Print the two tables of one case; returns r3 / off."""
    r3, off = result["r3"], result["off"]
    print(f"\n# {case.label}")
    print(
        f"# SIMULATED engine disagreement {DISAGREEMENT:.0%} of expert slots (measured {result['disagreement']:.1%}; "
        f"the off steps' native agreement {result['native_agreement']:.1%}); {result['steps']} steps"
    )
    rows = [
        [
            "off (replay=off: routes collated, native routing compared)",
            _common.ms(off),
            *result["range"]["off"],
            "1.00x",
        ],
        [
            "r3 (replay=r3: routes aligned, installed, replayed)",
            _common.ms(r3),
            *result["range"]["r3"],
            _common.ratio(r3, off),
        ],
    ]
    _common.print_table(
        f"R3 step vs off step: {case.name}", ["arm", "median ms", "min ms", "max ms", "vs off"], rows
    )
    rows = []
    for piece, (with_s, without_s, work) in result["pieces"].items():
        shown = [_common.ms(x) if x is not None else "" for x in (with_s, without_s)]
        rows.append([piece, *shown, _common.ms(work), f"{work / r3:.2%}"])
    _common.print_table(
        f"Route work, each piece alone: {case.name}",
        ["piece", "with routes ms", "without ms", "route work ms", "share of the r3 step"],
        rows,
    )
    return r3 / off


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized batches and repeats")
    parser.add_argument("--models", default="tiny,mid", help="comma-separated subset of tiny,mid")
    parser.add_argument("--repeats", type=int, help="timed steps per arm (default 10, 3 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 10)
    chosen = cases(args.quick)
    names = [n for n in args.models.split(",") if n]
    print(f"# step: {_common.machine_line()}")
    verdicts = {}
    for name in names:
        try:
            result = measure(chosen[name], torch.device("cpu"), repeats, piece_repeats=repeats)
        except CheckFailed as error:
            print(f"FAILED: {name}: {error}", file=sys.stderr)
            return 1
        verdicts[name] = report(chosen[name], result)
    shown = "; ".join(f"{n} {'met' if v <= TARGET else 'missed'} ({v:.3f}x)" for n, v in verdicts.items())
    print(f"\ntarget: r3 step <= {TARGET}x the off step on the CPU: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
