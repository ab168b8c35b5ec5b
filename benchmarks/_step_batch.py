"""The batch of ``bench_step.py``: model configs, the engine's routes and bodies, the loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from r3lightning.app.models.tiny import build_tiny_moe, tiny_moe_config
from r3lightning.app.serve.perturb import RouterLogitPerturbation
from r3lightning.replay.context import record_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.rollout.trajectory import Trajectory
from r3lightning.wire.codec import encode_routes

DISAGREEMENT = 0.10  # simulated engine/trainer slot disagreement (R3 paper, Qwen3-30B-A3B)


class CheckFailed(AssertionError):
    """A timed step did not compute what its arm claims."""


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


def policy_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    mask = batch.attention_mask
    logits = model(
        input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=batch.position_ids
    ).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    weight = batch.loss_mask[:, 1:] * batch.advantages[:, None]  # [B, S - 1]
    return -(logp * weight).sum() / batch.loss_mask[:, 1:].sum()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
