"""End-to-end checks of the data, Hugging Face and megatron-core replay paths on one CUDA GPU.

Run it on a machine with a GPU (sized to take about a minute; it stops itself, printing every
thread's stack, after ``--time-limit`` seconds, 170 by default)::

    .venv/bin/python scripts/gpu_check.py                  # every check on cuda:0
    .venv/bin/python scripts/gpu_check.py --only transfer,megatron --json results.json

``make setup`` installs the CPU build of torch into ``.venv``: there every check prints
``SKIP: no CUDA`` and the script exits 0. On a GPU machine, use a Python that already has a CUDA
build of torch plus transformers 5.x and lightning 2.5+ (check with ``python3 -c "import torch;
print(torch.cuda.is_available())"``); nothing of this checkout needs installing, the script puts
the checkout on ``sys.path`` itself::

    python3 scripts/gpu_check.py

Such images rarely hold megatron-core, or orjson and pybase64 (imported by the route wire codec).
Without network access there, download their wheels where pip reaches PyPI, matching the GPU
machine's Python (3.12 here), bring ``.whl/`` along and install them without dependencies
(megatron-core needs only torch, numpy and packaging)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        megatron-core==0.16.1 orjson==3.13.0 pybase64==1.5.1
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 scripts/gpu_check.py

Without megatron-core the ``megatron`` check reports SKIP. ``--device cpu`` runs the same checks on
the CPU wherever their meaning survives (pinning, copy bandwidth, Lightning's FSDP1 strategy and
the sync guard need CUDA), so the script is known to work before it meets a GPU.

Checks (one ``PASS`` / ``FAIL`` / ``SKIP`` line each, then a summary with figures; exit status 1
when any check fails):

* ``transfer``: trajectories -> ``ReplayBuffer`` -> ``R3DataModule`` (pinned buffer pool) ->
  ``transfer_batch_to_device`` with ``non_blocking`` copies. Host batches are pinned; device
  values equal a plain-loop reference, also after the pool rewrote the pinned buffers for later
  batches (each copy queued behind ``torch.cuda._sleep`` so a missing fence corrupts them); the
  pool reuses its buffers without a miss; the callback's layout + align + install runs with
  ``torch.cuda.set_sync_debug_mode("error")`` (no device->host sync) and the installed routes are
  the ones a forward uses. Figures: host->device copy GB/s, pinned vs pageable.
* ``hf``, ``hf-fsdp``, ``hf-fsdp2``: a tiny Qwen3-MoE trained by a real Lightning ``Trainer``
  (single device; Lightning's ``fsdp`` strategy; ``ModelParallelStrategy`` + ``fully_shard``)
  with ``R3DataModule`` and ``RouterReplayCallback``: every training forward uses exactly the
  engine's experts on every captured token and MoE layer (100%), routes are installed during each
  step and cleared after it, batches arrive pinned and on the device, the routers get updated.
* ``grpo``, ``grpo-bf16``, ``grpo-fsdp2``: the package's ``GRPOModule`` with HF activation
  checkpointing, trained by a Lightning ``Trainer`` (32-true; ``precision="bf16-true"``; the
  module's own FSDP2 sharding under ``ModelParallelStrategy``): every step after the first runs
  under ``torch.cuda.set_sync_debug_mode("error")`` (any device->host sync fails the check), batch
  float fields reach the step as float32, batches arrive pinned, the pool never misses, and the
  forwards use the engine's experts on every captured slot.
* ``megatron``: a megatron-core ``MoELayer`` (``TopKRouter`` + ``SequentialMLP``) with
  ``MegatronRouterReplay`` on packed, pinned routes aligned without a device->host sync: its
  output and router gradient equal an independent reference computed from the installed experts
  (native experts where the replay mask is False); megatron's MoE activation recompute
  (``REPLAY_BACKWARD``) gives the same gradients.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CHECKS = ("transfer", "hf", "hf-fsdp", "hf-fsdp2", "grpo", "grpo-bf16", "grpo-fsdp2", "megatron")
# the tiny Qwen3-MoE of r3lightning.testing.tiny: 4 decoder layers (0 dense), 8 experts, top-2
LAYERS, TOP_K, EXPERTS, VOCAB = 4, 2, 8, 96
MOE_LAYERS = (1, 2, 3)


class CheckFailed(AssertionError):
    """A check's expectation did not hold (reported as FAIL with this message)."""


class Skip(Exception):
    """The check cannot run here (reported as SKIP with this message)."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass
class Result:
    name: str
    status: str  # "PASS" | "FAIL" | "SKIP"
    detail: str = ""
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in self.figures.items())
        text = f"[{self.name}] {self.status}" + (f": {self.detail}" if self.detail else "")
        return text + f" ({self.seconds:.1f} s)" + (f" | {shown}" if shown else "")


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ------------------------------------------------------------------------------- environment
_OWN_PROCESS_GROUP = False  # whether this script created the default process group


def ensure_process_group(device: torch.device) -> None:
    """A world-size-1 process group (nccl on CUDA, gloo on CPU) for FSDP and megatron-core."""
    import torch.distributed as dist

    global _OWN_PROCESS_GROUP
    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    _OWN_PROCESS_GROUP = True


def shutdown_process_group() -> None:
    """Destroy the process group if this script created it (NCCL warns about leaked ones)."""
    import torch.distributed as dist

    global _OWN_PROCESS_GROUP
    if _OWN_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_PROCESS_GROUP = False


@contextmanager
def no_device_syncs(device: torch.device) -> Iterator[None]:
    """Any device->host synchronisation inside the block raises (CUDA only; no-op on CPU)."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def gpu_sleep(device: torch.device, cycles: int = 20_000_000) -> None:
    """Queue ~10 ms of busy GPU work on the current stream (no-op on the CPU), so asynchronous
    copies issued next run late: host buffers rewritten without waiting on a fence corrupt them."""
    if device.type == "cuda":
        torch.cuda._sleep(cycles)


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> dict[str, float]:
    """Host->device GB/s of ``non_blocking`` copies from pinned and from pageable memory."""
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sources = {
        "pinned": torch.ones(nbytes, dtype=torch.uint8).pin_memory(),
        "pageable": torch.ones(nbytes, dtype=torch.uint8),
    }
    figures = {}
    for name, source in sources.items():
        target.copy_(source, non_blocking=True)  # warm-up
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            target.copy_(source, non_blocking=True)
        stop.record()
        stop.synchronize()
        figures[f"h2d_{name}_GBps"] = nbytes * repeats / (start.elapsed_time(stop) / 1e3) / 1e9
    return figures


# ------------------------------------------------------------------------------- trajectories
def random_routes(rows: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 ``[rows, LAYERS, TOP_K]``: distinct experts per row, as an engine returns them."""
    scores = torch.rand(rows, LAYERS, EXPERTS, generator=generator)
    return scores.topk(TOP_K, dim=-1).indices.to(torch.uint8)


def make_trajectories(count: int, seed: int, route_fn: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """``count`` trajectories of 5..15 tokens with routes for all but the last token (every
    third: all but the last 3 tokens, an uncaptured suffix routed natively).

    ``route_fn(tokens) -> [n - 1, L, K]`` gives each trajectory's engine routes (default: random).
    """
    from r3lightning.data.trajectory import Trajectory

    generator = torch.Generator().manual_seed(seed)
    trajectories = []
    for index in range(count):
        prompt = int(torch.randint(2, 6, (), generator=generator))
        response = int(torch.randint(3, 11, (), generator=generator))
        tokens = torch.randint(3, VOCAB, (prompt + response,), generator=generator)
        routes = route_fn(tokens) if route_fn else random_routes(len(tokens) - 1, generator)
        captured = len(tokens) - 1 - (2 if index % 3 == 2 else 0)  # n - 1 rows, or n - 3
        trajectories.append(
            Trajectory(
                tokens[:prompt],
                tokens[prompt:],
                rollout_logprobs=-torch.rand(response, generator=generator),
                reward=float(index % 2),
                advantage=float(index % 2) - 0.5,
                routed_experts=routes[:captured],
            )
        )
    return trajectories


def reference_fields(trajectories) -> dict[str, torch.Tensor]:
    """Left-padded batch fields and packed routes of ``trajectories``, by plain loops."""
    width = max(t.num_tokens for t in trajectories)
    b = len(trajectories)
    out = {
        "input_ids": torch.zeros(b, width, dtype=torch.int64),
        "attention_mask": torch.zeros(b, width, dtype=torch.bool),
        "loss_mask": torch.zeros(b, width),
        "rollout_logprobs": torch.zeros(b, width),
        "advantages": torch.tensor([t.advantage for t in trajectories], dtype=torch.float32),
    }
    for i, t in enumerate(trajectories):
        n, p = t.num_tokens, t.prompt_length
        out["input_ids"][i, width - n :] = torch.cat([t.prompt_ids, t.response_ids])
        out["attention_mask"][i, width - n :] = True
        out["loss_mask"][i, width - n + p :] = t.loss_mask
        out["rollout_logprobs"][i, width - n + p :] = t.rollout_logprobs
    out["routes"] = torch.cat([t.routed_experts.long() for t in trajectories])
    out["route_lengths"] = torch.tensor([t.route_rows for t in trajectories])
    return out


def replayed_slots(used: torch.Tensor, trajectories) -> tuple[int, int]:
    """(agreeing, total) expert slots on the MoE layers: experts that the left-padded forward
    ``used`` (``[B, S, L, K]``) and each trajectory's captured routes have in common per token."""
    width = used.shape[1]
    agree = total = 0
    for i, t in enumerate(trajectories):
        start = width - t.num_tokens
        for j in range(t.route_rows):
            for layer in MOE_LAYERS:
                want = t.routed_experts[j, layer].tolist()
                got = used[i, start + j, layer].tolist()
                agree += len(set(want) & set(got))
                total += TOP_K
    return agree, total


# ------------------------------------------------------------------------------- check 1: transfer
def check_transfer(device: torch.device) -> dict[str, Any]:
    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.data.datamodule import R3DataModule
    from r3lightning.replay.callback import RouterReplayCallback
    from r3lightning.replay.context import record_routes
    from r3lightning.replay.hf.replay import HFRouterReplay
    from r3lightning.testing.tiny import build_tiny_moe

    cuda = device.type == "cuda"
    batch_size, count = 4, 16
    # longest first: later batches fit in the pooled buffers of earlier ones, so every pinned
    # buffer the pool hands out again keeps its address
    trajectories = sorted(make_trajectories(count, seed=1), key=lambda t: -t.num_tokens)
    buffer = ReplayBuffer(num_experts=EXPERTS)
    buffer.extend(trajectories)
    data = R3DataModule(buffer, batch_size, shuffle=False, pin_memory=cuda, collate_threads=2)
    model = build_tiny_moe(seed=0).to(device)
    callback = RouterReplayCallback(backend=HFRouterReplay(model, validate=False))  # validate syncs
    hosts, moved, pointers, copy_events = [], [], set(), []
    for batch in data.train_dataloader():
        if cuda:
            expect(batch.is_pinned(), "a collated batch is not in pinned memory")
            expect(batch.routed_experts.is_pinned(), "batch.routed_experts is not in pinned memory")
            pointers.add(batch.input_ids.data_ptr())
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        hosts.append(batch)  # kept alive: a reused pointer can only come from the pool
        gpu_sleep(device)  # the copy queues behind GPU work: a missing fence lets later writes win
        on_device = data.transfer_batch_to_device(batch, device, 0)
        if cuda:
            events[1].record()
            copy_events.append(events)
        expect(on_device.input_ids.device.type == device.type, f"batch landed on {on_device.device}")
        expect(on_device.routed_experts.device.type == device.type, "routes were not moved to the device")
        moved.append(on_device)
    expect(len(moved) == count // batch_size, f"expected {count // batch_size} batches, got {len(moved)}")
    figures: dict[str, Any] = {"batches": len(moved)}
    if cuda:
        expect(
            len(pointers) <= 2,
            f"the pinned pool did not reuse its buffers: {len(pointers)} distinct input_ids buffers "
            f"for {len(moved)} batches (2 pool slots)",
        )
        torch.cuda.synchronize(device)
        figures["batch_copy_ms"] = sum(a.elapsed_time(b) for a, b in copy_events) / len(copy_events)
        figures["pool_buffers"] = len(pointers)
        misses = data._collator.pool.misses
        expect(misses == 0, f"the pinned pool missed {misses} times (a batch found no free slot)")
    # after later batches rewrote the pooled host buffers, every device batch must be intact
    for index, on_device in enumerate(moved):
        group = trajectories[index * batch_size : (index + 1) * batch_size]
        ref = reference_fields(group)
        for name in ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs", "advantages"):
            expect(torch.equal(getattr(on_device, name).cpu(), ref[name]), f"batch {index}: {name} differs")
        routes = on_device.routed_experts
        expect(torch.equal(routes.values.cpu().long(), ref["routes"]), f"batch {index}: route values differ")
        expect(torch.equal(routes.lengths, ref["route_lengths"]), f"batch {index}: route lengths differ")
        expect(routes.cu_seqlens.dtype == torch.int32, "cu_seqlens must stay int32")
        expect(
            torch.equal(routes.cu_seqlens.cpu(), routes.cu_seqlens_host),
            f"batch {index}: device and host cu_seqlens differ",
        )
    # layout + align + install of the callback: no device->host sync, and a forward uses them
    agree = total = 0
    for index, on_device in enumerate(moved):
        gpu_sleep(device)  # staged index maps must stay intact until their copies ran
        with no_device_syncs(device):
            callback.on_train_batch_start(None, None, on_device, index)  # type: ignore[arg-type]
        mask = on_device.attention_mask
        with torch.no_grad(), record_routes(model) as rec:
            model(input_ids=on_device.input_ids, attention_mask=mask.long(), position_ids=_position_ids(mask))
        callback.teardown(None, None, "fit")  # type: ignore[arg-type]
        expect(not callback.backend.installed, "routes still installed after teardown")
        a, t = replayed_slots(rec.routes.cpu(), trajectories[index * batch_size : (index + 1) * batch_size])
        agree, total = agree + a, total + t
    expect(agree == total, f"forward used the installed experts on {agree}/{total} slots")
    figures["replay_agreement"] = agree / total
    if cuda:
        figures.update(copy_bandwidth(device))
    data.teardown("fit")
    return figures


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ------------------------------------------------------------------------------- check 2: HF + Lightning
def engine_trajectories(device: torch.device, count: int):
    """Trajectories whose routes a bf16 engine with perturbed routers recorded on ``device``."""
    from r3lightning.replay.context import record_routes
    from r3lightning.testing.tiny import build_tiny_moe

    engine = build_tiny_moe(seed=0, dtype=torch.bfloat16).to(device)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in engine.named_parameters():
            if name.endswith("mlp.gate.weight"):
                noise = torch.randn(p.shape, generator=generator).to(device, p.dtype)
                p.add_(0.3 * p.float().std().to(p.dtype) * noise)

    def route_fn(tokens: torch.Tensor) -> torch.Tensor:
        # the engine forwards every token but the last sampled one: n - 1 rows
        with torch.no_grad(), record_routes(engine) as rec:
            engine(tokens[None, :-1].to(device))
        return rec.routes[0].cpu().to(torch.uint8)

    return make_trajectories(count, seed=3, route_fn=route_fn)


def _lightning_module(shard: bool):
    import lightning.pytorch as pl

    from r3lightning.replay.callback import RouterReplayCallback
    from r3lightning.replay.context import record_routes
    from r3lightning.testing.tiny import build_tiny_moe

    class ReplayedPolicy(pl.LightningModule):
        """Token NLL on the loss mask; notes what every training step saw and routed."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_tiny_moe(seed=0).train()
            self.shard = shard
            self.pinned: list[bool] = []
            self.steps: list[dict[str, Any]] = []
            self.gates: list[dict[str, torch.Tensor]] = []

        def configure_model(self) -> None:
            if self.shard:
                from torch.distributed.fsdp import fully_shard

                for layer in self.model.model.layers:
                    fully_shard(layer, mesh=self.device_mesh)
                fully_shard(self.model, mesh=self.device_mesh)

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            self.pinned.append(batch.is_pinned())
            return batch

        def gate_weights(self) -> dict[str, torch.Tensor]:
            out = {}
            for name, p in self.model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    t = p.detach()
                    t = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 DTensor
                    out[name] = t.float().cpu().clone()
            return out

        def on_train_start(self) -> None:
            self.gates.append(self.gate_weights())

        def on_train_end(self) -> None:
            self.gates.append(self.gate_weights())

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            backend = RouterReplayCallback.find(self.trainer).backend
            mask = batch.attention_mask
            with record_routes(self.model) as rec:
                logits = self.model(
                    input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=_position_ids(mask)
                ).logits
            self.steps.append(
                {"installed": backend.installed, "device": batch.device.type, "used": rec.routes.cpu()}
            )
            logp = torch.log_softmax(logits[:, :-1].float(), -1)
            logp = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # [B, S - 1]
            weight = batch.loss_mask[:, 1:]
            return -(logp * weight).sum() / weight.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return ReplayedPolicy()


def check_hf(device: torch.device, variant: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger

    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.data.datamodule import R3DataModule
    from r3lightning.replay.callback import RouterReplayCallback

    cuda = device.type == "cuda"
    if variant == "fsdp" and not cuda:
        raise Skip("Lightning's fsdp strategy needs CUDA")
    batch_size, count = 4, 8
    trajectories = engine_trajectories(device, count)
    buffer = ReplayBuffer(num_experts=EXPERTS, vocab_size=VOCAB)
    buffer.extend(trajectories)
    data = R3DataModule(buffer, batch_size, shuffle=False, collate_threads=2)  # pins on a CUDA trainer
    strategy: Any = "auto"
    if variant == "fsdp":
        strategy = "fsdp"
    elif variant == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    if variant != "single":
        ensure_process_group(device)
    router_callback = RouterReplayCallback(mode="r3")
    cleared: list[bool] = []
    agreement: list[float] = []

    class AfterStep(pl.Callback):  # runs after the replay callback's on_train_batch_end
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            cleared.append(not router_callback.backend.installed)

    class Metrics(Logger):
        name, version = "memory", 0

        def log_metrics(self, metrics, step=None):
            if "router_replay/native_agreement" in metrics:
                agreement.append(float(metrics["router_replay/native_agreement"]))

        def log_hyperparams(self, *args, **kwargs):
            pass

    module = _lightning_module(shard=variant == "fsdp2")
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=[device.index] if cuda else 1,
        strategy=strategy,
        max_epochs=1,
        logger=Metrics(),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[router_callback, AfterStep()],
    )
    trainer.fit(module, datamodule=data)
    if variant == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = any(isinstance(m, FullyShardedDataParallel) for m in trainer.strategy.model.modules())
        expect(wrapped, "the fsdp strategy did not wrap the model in FullyShardedDataParallel")
    elif variant == "fsdp2":
        sharded = all(hasattr(p, "full_tensor") for p in module.model.parameters())
        expect(sharded, "ModelParallelStrategy left parameters that are not DTensors (not fully_shard-ed)")
    steps = count // batch_size
    expect(len(module.steps) == steps, f"expected {steps} training steps, ran {len(module.steps)}")
    expect(all(s["installed"] for s in module.steps), "routes were not installed during a training step")
    expect(cleared == [True] * steps, f"routes not cleared after every step: {cleared}")
    expect(all(s["device"] == device.type for s in module.steps), "a batch reached training_step off-device")
    if cuda:
        expect(
            module.pinned[:steps] == [True] * steps,
            f"batches were not pinned before transfer: {module.pinned}",
        )
        misses = data._collator.pool.misses
        expect(misses == 0, f"the pinned pool missed {misses} times")
    agree = total = 0
    for index, step in enumerate(module.steps):
        a, t = replayed_slots(step["used"], trajectories[index * batch_size : (index + 1) * batch_size])
        agree, total = agree + a, total + t
    expect(agree == total, f"training forwards used the rollout's experts on {agree}/{total} slots")
    before, after = module.gates
    moved = sum(not torch.equal(before[k], after[k]) for k in before)
    expect(moved == len(MOE_LAYERS), f"only {moved}/{len(MOE_LAYERS)} routers were updated by training")
    return {
        "replay_agreement": agree / total,
        "native_agreement": sum(agreement) / max(len(agreement), 1),
        "slots": total,
    }


# ------------------------------------------------------------------------------- check: GRPO fit steps
def check_grpo(device: torch.device, variant: str) -> dict[str, Any]:
    """The package's ``GRPOModule`` (HF activation checkpointing on) trained by a Lightning
    ``Trainer`` with ``R3DataModule`` and ``RouterReplayCallback``; every step after the first
    (collation, transfer, layout, install, forward, recompute, backward, optimizer, metrics) runs
    under ``torch.cuda.set_sync_debug_mode("error")``. ``bf16``: ``precision="bf16-true"`` (the
    batch keeps float32 logprobs, masks and advantages, and stays pinned); ``fsdp2``: the module's
    own ``configure_model`` sharding under ``ModelParallelStrategy``."""
    import lightning.pytorch as pl

    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.data.datamodule import R3DataModule
    from r3lightning.job.module import GRPOModule
    from r3lightning.replay.callback import RouterReplayCallback
    from r3lightning.replay.context import record_routes
    from r3lightning.testing.tiny import build_tiny_moe

    cuda = device.type == "cuda"
    batch_size, count = 4, 12
    trajectories = engine_trajectories(device, count)
    buffer = ReplayBuffer(num_experts=EXPERTS, vocab_size=VOCAB)
    buffer.extend(trajectories)
    data = R3DataModule(buffer, batch_size, shuffle=False, collate_threads=2)  # pins on a CUDA trainer
    seen: dict[str, list[Any]] = {"used": [], "pinned": [], "dtypes": []}

    class Policy(GRPOModule):
        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            seen["pinned"].append(batch.is_pinned())
            return batch

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.in_training_step = True  # the paired-mismatch forwards before it are not counted
            try:
                return super().training_step(batch, batch_idx)
            finally:
                self.in_training_step = False

        def batch_logprobs(self, batch: Any) -> torch.Tensor:
            if not getattr(self, "in_training_step", False):
                return super().batch_logprobs(batch)
            seen["dtypes"].append(
                {batch.rollout_logprobs.dtype, batch.loss_mask.dtype, batch.advantages.dtype}
            )
            with record_routes(self.model) as rec:
                out = super().batch_logprobs(batch)
            seen["used"].append(rec.routes)  # stays on the device: copied after the fit
            return out

    class SyncGuard(pl.Callback):
        """Sync debug mode "error" from the end of the first step (warm-up) to the end of the fit."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda and batch_idx == 0:
                torch.cuda.synchronize(device)
                torch.cuda.set_sync_debug_mode("error")

        def on_train_end(self, trainer, pl_module):
            if cuda:
                torch.cuda.set_sync_debug_mode("default")

    model = build_tiny_moe(seed=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module = Policy(model)
    strategy: Any = "auto"
    if variant == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        ensure_process_group(device)
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=[device.index] if cuda else 1,
        strategy=strategy,
        precision="bf16-true" if variant == "bf16" else "32-true",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RouterReplayCallback(mode="r3"), SyncGuard()],
    )
    try:
        trainer.fit(module, datamodule=data)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    steps = count // batch_size
    expect(len(seen["used"]) == steps, f"expected {steps} training forwards, ran {len(seen['used'])}")
    expect(
        seen["dtypes"] == [{torch.float32}] * steps,
        f"batch float fields reached the step as {seen['dtypes']}",
    )
    if variant == "fsdp2":
        sharded = all(hasattr(p, "full_tensor") for p in module.model.parameters())
        expect(sharded, "GRPOModule.configure_model left parameters that are not DTensors")
    if cuda:
        expect(seen["pinned"] == [True] * steps, f"batches were not pinned before transfer: {seen['pinned']}")
        misses = data._collator.pool.misses
        expect(misses == 0, f"the pinned pool missed {misses} times")
    agree = total = 0
    for index, used in enumerate(seen["used"]):
        a, t = replayed_slots(used.cpu(), trajectories[index * batch_size : (index + 1) * batch_size])
        agree, total = agree + a, total + t
    expect(agree == total, f"training forwards used the rollout's experts on {agree}/{total} slots")
    return {"replay_agreement": agree / total, "slots": total, "steps": steps}


# ------------------------------------------------------------------------------- check 3: megatron
@contextmanager
def megatron_runtime(device: torch.device) -> Iterator[None]:
    """Process group, ``parallel_state`` and the few shims megatron-core 0.16 needs off its usual
    setup, all undone on exit: without Transformer Engine ``moe_utils.te_general_gemm`` is left
    undefined (``None`` selects megatron's torch path); on the CPU, router weights would be moved
    to ``torch.cuda.current_device()`` and activation recompute would save the CUDA RNG state."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from r3lightning.testing.megatron_cpu import megatron_device_shims

    with megatron_device_shims(device):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ensure_process_group(device)
        started = not parallel_state.model_parallel_is_initialized()
        if started:
            parallel_state.initialize_model_parallel()
        try:
            if device.type == "cuda":
                tp_random.model_parallel_cuda_manual_seed(0)
            yield
        finally:
            if started:
                parallel_state.destroy_model_parallel()
            RouterReplay.clear_global_router_replay_instances()


def _moe_layer(device: torch.device, **overrides: Any):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=2,
        ffn_hidden_size=48,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K,
        moe_layer_freq=[0, 1, 1, 1],
        moe_enable_routing_replay=True,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **overrides,
    )
    layer = build_module(get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp, config=config)
    layer.set_layer_number(3)  # 1-based: decoder layer index 2
    return layer.to(device)


def check_megatron(device: torch.device) -> dict[str, Any]:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise Skip("megatron-core is not installed (see the docstring for its wheel)") from None
    with megatron_runtime(device):
        return _megatron_replay(device)


def _megatron_replay(device: torch.device) -> dict[str, Any]:
    from r3lightning.align.align import align_packed_token_metadata, build_replay_mask
    from r3lightning.align.dummy import dummy_routes
    from r3lightning.packed import PackedTensor
    from r3lightning.replay.megatron.replay import MegatronRouterReplay

    layer_index = 2
    torch.manual_seed(0)
    layer = _moe_layer(device)
    recomputing = _moe_layer(device, recompute_granularity="selective", recompute_modules=["moe"])
    recomputing.load_state_dict(layer.state_dict())
    expect(recomputing.moe_layer_recompute, "the recompute config did not enable MoE recompute")
    generator = torch.Generator().manual_seed(5)
    lengths = [7, 3, 9, 5]
    captured = [6, 3, 4, 0]  # uncaptured suffixes and one trajectory without routes
    width = max(lengths)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        attention_mask[i, width - n :] = True
    segments = [random_routes(rows, generator) for rows in captured]
    packed = PackedTensor.from_segments(segments)
    if device.type == "cuda":
        packed = packed.pin_memory()
        expect(packed.is_pinned(), "pin_memory() did not pin the routes")
    packed = packed.to(device, non_blocking=True)

    backend = MegatronRouterReplay(layer)
    expect(
        backend.moe_layers == (layer_index,), f"moe_layers {backend.moe_layers}, expected ({layer_index},)"
    )
    layout = backend.build_layout(attention_mask)  # packed [1, T]
    expect(layout.token_shape == (1, sum(lengths)), f"packed token shape {layout.token_shape}")
    with no_device_syncs(device):
        aligned = align_packed_token_metadata(
            packed, layout, pad=lambda n: dummy_routes(n, LAYERS, TOP_K, EXPERTS, device=device)
        )  # [1, T, L, K]
        replay_mask = build_replay_mask(packed, layout)  # [1, T]
    tokens = sum(lengths)
    hidden = torch.randn(tokens, 1, layer.config.hidden_size, generator=generator).to(device)  # [s, b, h]
    target = torch.randn(tokens, 1, layer.config.hidden_size, generator=generator).to(device)

    # independent reference, by plain loops over the packed sequences: installed experts where a
    # row was captured, native top-k of the live logits elsewhere
    weight = layer.router.weight.detach().clone().requires_grad_(True)
    logits = hidden.reshape(tokens, -1) @ weight.t()  # [T, E]
    native = logits.detach().topk(TOP_K, dim=-1).indices.cpu()
    expected = native.clone()
    position = 0
    for n, rows, segment in zip(lengths, captured, segments, strict=True):
        expected[position : position + rows] = segment[:, layer_index].long()
        position += n
    expected_dev = expected.to(device)
    probs = torch.softmax(logits.gather(1, expected_dev), dim=-1)  # softmax over the chosen logits
    with torch.no_grad():
        flat = hidden.reshape(tokens, -1)
        expert_out = torch.stack([layer.experts.local_experts[e](flat)[0] for e in range(EXPERTS)], dim=1)
    chosen = expert_out.gather(1, expected_dev[..., None].expand(-1, -1, expert_out.shape[-1]))  # [T, K, H]
    reference = (probs[..., None] * chosen).sum(1)  # [T, H]
    (reference * target.reshape(tokens, -1)).sum().backward()

    grads, outputs = [], []
    for module in (layer, recomputing):
        replay = MegatronRouterReplay(module)
        module.zero_grad(set_to_none=True)
        replay.install(aligned, replay_mask)
        replay.start_recording()
        out, _ = module(hidden.clone().requires_grad_(True))
        used = replay.stop_recording()  # [1, T, L, K]
        (out * target).sum().backward()
        stats = replay.routing_stats()
        queued = len(module.router.router_replay.replay_backward_list)
        replay.clear()
        if module is recomputing:  # every forward's entry is popped by its recomputation
            expect(queued == 0, f"{queued} recompute entries left queued after backward")
        expect(
            module.router.router_replay.target_topk_idx is None
            and module.router.router_replay.router_replay_action is None,
            "clear() left routes or a replay action on the router",
        )
        differs = (used[0, :, layer_index].long().cpu().sort(-1).values != expected.sort(-1).values).any(-1)
        expect(
            not differs.any(), f"router used other experts than the reference on {int(differs.sum())} tokens"
        )
        rows = sum(captured)
        expect(
            stats["replayed_rows"].tolist() == [rows],
            f"replayed rows {stats['replayed_rows'].tolist()} != [{rows}]",
        )
        outputs.append(out.detach().reshape(tokens, -1))
        grads.append(
            {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
        )
    torch.testing.assert_close(outputs[0], reference.detach(), rtol=1e-4, atol=1e-5)
    router_grad = grads[0]["router.weight"]
    expect(bool(router_grad.abs().sum() > 0), "the router weight got no gradient")
    torch.testing.assert_close(router_grad, weight.grad, rtol=1e-4, atol=1e-5)
    # CUDA's scatter-add in the unpermute is not bit-reproducible: equal up to fp32 rounding
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    expect(grads[0].keys() == grads[1].keys(), "recompute changed which parameters get gradients")
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)
    masked = replay_mask.reshape(-1).cpu()
    native_agreement = (expected[masked, :, None] == native[masked, None, :]).any(-1).float().mean()
    return {
        "tokens": tokens,
        "replayed_rows": int(masked.sum()),
        "native_agreement": float(native_agreement),
        "max_out_err": float((outputs[0] - reference.detach()).abs().max()),
        "max_router_grad_err": float((router_grad - weight.grad).abs().max()),
    }


# ------------------------------------------------------------------------------- driver
def _run(name: str, device: torch.device | None) -> Result:
    start = time.perf_counter()
    if device is None:
        return Result(name, "SKIP", "no CUDA")
    try:
        if name == "transfer":
            figures = check_transfer(device)
        elif name == "megatron":
            figures = check_megatron(device)
        elif name.startswith("grpo"):
            figures = check_grpo(device, name.removeprefix("grpo").removeprefix("-") or "single")
        else:
            figures = check_hf(device, {"hf": "single", "hf-fsdp": "fsdp", "hf-fsdp2": "fsdp2"}[name])
    except Skip as skip:
        return Result(name, "SKIP", str(skip), time.perf_counter() - start)
    except Exception as error:  # every failure is reported; the remaining checks still run
        tail = traceback.format_exc(limit=-3).strip().splitlines()
        message = str(error).strip().splitlines()
        detail = type(error).__name__ + (f": {message[0]}" if message else "")
        print("\n".join(f"    {line}" for line in tail), flush=True)
        return Result(name, "FAIL", detail, time.perf_counter() - start)
    return Result(name, "PASS", "", time.perf_counter() - start, figures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default="auto", help="auto (cuda:0 if available, else skip everything), cuda[:N], or cpu"
    )
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {CHECKS}")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--time-limit", type=float, default=170.0, help="abort (exit 1) after this many seconds"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        parser.error(f"--only: unknown checks {unknown}; choose from {CHECKS}")
    if args.device == "auto":
        device = torch.device("cuda", 0) if torch.cuda.is_available() else None
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cuda", "cpu"):
            parser.error(f"--device must be auto, cuda[:N] or cpu, got {args.device!r}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                device = None
            elif device.index is None:
                device = torch.device("cuda", 0)
    if args.time_limit > 0:  # a hung collective must not eat the machine's time
        faulthandler.dump_traceback_later(args.time_limit, exit=True)
    where = "no CUDA" if device is None else str(device)
    if device is not None and device.type == "cuda":
        where += f" ({torch.cuda.get_device_name(device)})"
    print(f"gpu_check: torch {torch.__version__} on {where}; checks {names}", flush=True)
    start = time.perf_counter()
    results = []
    for name in names:
        result = _run(name, device)
        print(result.line(), flush=True)
        results.append(result)
    faulthandler.cancel_dump_traceback_later()
    shutdown_process_group()
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    figures = {f"{r.name}.{k}": v for r in results for k, v in r.figures.items()}
    shown = " ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
    print(
        f"SUMMARY: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP "
        f"in {time.perf_counter() - start:.1f} s" + (f" | {shown}" if shown else ""),
        flush=True,
    )
    if args.json is not None:
        payload = {
            "device": None if device is None else str(device),
            "torch": torch.__version__,
            "results": [r.__dict__ for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
