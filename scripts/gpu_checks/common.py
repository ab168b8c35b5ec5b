"""What every check shares: results, the process group, sync guards and the tiny model's trajectories."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# the tiny Qwen3-MoE of r3lightning.app.models.tiny: 4 decoder layers (0 dense), 8 experts, top-2
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
        shown = ", ".join(f"{k}={fmt(v)}" for k, v in self.figures.items())
        text = f"[{self.name}] {self.status}" + (f": {self.detail}" if self.detail else "")
        return text + f" ({self.seconds:.1f} s)" + (f" | {shown}" if shown else "")


def fmt(value: Any) -> str:
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
    from r3lightning.rollout.trajectory import Trajectory

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


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def engine_trajectories(device: torch.device, count: int):
    """Trajectories whose routes a bf16 engine with perturbed routers recorded on ``device``."""
    from r3lightning.app.models.tiny import build_tiny_moe
    from r3lightning.replay.context import record_routes

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
