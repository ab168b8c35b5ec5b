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
from typing import Any

import _common
import lightning.pytorch as pl
import torch
from _step_batch import (
    DISAGREEMENT,
    CheckFailed,
    StepCase,
    cases,
    engine_trajectories,
    policy_loss,
    skyrl_body,
    synchronize,
    without_routes,
)

from r3lightning.app.models.tiny import build_tiny_moe, tiny_moe_config
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.collate import collate_trajectories
from r3lightning.data.datamodule import R3DataModule
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.rollout.trajectory import Trajectory
from r3lightning.wire.request import RouteSchema
from r3lightning.wire.response import parse_response

TARGET = 1.02  # r3 step / off step on the CPU
ARMS = ("r3", "off")


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
