"""The on-policy RL loop around a Lightning fit: one epoch = one RL step.

``RolloutCollector`` samples a group of responses per prompt from a rollout engine over HTTP
(``RemoteGenerateClient``), routes and all, scores them with the task, computes GRPO advantages
and returns ``Trajectory`` objects (routes go through a ``RoutedExpertTrace`` per trajectory).

``OnPolicyLoop`` is the Lightning callback that keeps the engine on-policy: at fit start and
after every epoch it pushes the trainer's weights to the engine, collects the next step's
rollouts into the ``ReplayBuffer`` the data module reads (the trainer reloads its dataloader
every epoch, ``reload_dataloaders_every_n_epochs=1``), and records one row of metrics per step.
Its history is part of the checkpoint, and the checkpoint taken after step ``e`` already holds
step ``e + 1``'s rollouts (in the data module's state), so a resumed run continues exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from ..data.trajectory import Trajectory
from ..rollout.client import RemoteGenerateClient
from ..rollout.client_protocol import RouteSchema, engine_sampling_params
from ..trace import RoutedExpertTrace
from .grpo import group_advantages
from .report import AGREEMENT_PREFIX, write_csv
from .task import ScoredTask


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 4
    ignore_eos: bool = True
    stop_token_ids: list[int] | None = None  # e.g. the tokenizer's end-of-turn ids

    def wire_params(self, protocol: str, seed: int) -> dict[str, Any]:
        """The request's ``sampling_params`` in ``protocol``'s field names."""
        return engine_sampling_params(
            protocol,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )


@dataclass
class ClientConfig:
    url: str
    protocol: str = "skyrl"
    api_key: str | None = None
    request_timeout_s: float = 120.0
    max_in_flight: int = 64  # the client's connection limit
    extra: dict[str, Any] = field(default_factory=dict)  # more RemoteGenerateClient keywords


def _step_seed(seed: int, step: int, index: int = 0) -> int:
    """Deterministic per-(run, step, sample) seed, so a resumed run samples the same rollouts."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**31 - 1)


class RolloutCollector:
    """Collects and scores one RL step's trajectories from a rollout engine.

    Each step draws ``num_prompts`` prompts from a generator seeded by ``(seed, step)`` and sends
    ``group_size`` requests per prompt (one per sample, each with its own sampling seed), at most
    ``max_in_flight`` at a time. Cost: host-side only; the routes stay compact numpy/torch
    arrays in the engine's dtype.
    """

    def __init__(
        self,
        client: ClientConfig,
        task: ScoredTask,
        *,
        group_size: int,
        sampling: SamplingConfig,
        schema: RouteSchema,
        request_routes: bool = True,
        normalize_std: bool = True,
        seed: int = 0,
    ) -> None:
        if group_size < 2:
            raise ValueError(f"algorithm.group_size must be >= 2 for group advantages, got {group_size}")
        self.client_config = client
        self.task = task
        self.group_size = group_size
        self.sampling = sampling
        self.schema = schema
        self.request_routes = request_routes
        self.normalize_std = normalize_std
        self.seed = seed

    def make_client(self) -> RemoteGenerateClient:
        cfg = self.client_config
        return RemoteGenerateClient(
            cfg.url,
            protocol=cfg.protocol,  # type: ignore[arg-type]
            api_key=cfg.api_key,
            timeout_s=cfg.request_timeout_s,
            max_connections=max(1, cfg.max_in_flight),
            num_layers=self.schema.num_layers,
            top_k=self.schema.top_k,
            num_experts=self.schema.num_experts,
            **cfg.extra,
        )

    def check_engine(self) -> bool:
        """Whether the engine answers ``GET /health`` (one attempt, ``request_timeout_s``)."""

        async def probe() -> bool:
            async with self.make_client() as client:
                return await client.health()

        return asyncio.run(probe())

    def collect(self, step: int, num_prompts: int, *, progress: bool = True) -> tuple[list[Trajectory], dict]:
        """Trajectories of step ``step`` (``num_prompts * group_size`` of them) and their stats."""
        return asyncio.run(self._collect(step, num_prompts, progress))

    async def _collect(self, step: int, num_prompts: int, progress: bool) -> tuple[list[Trajectory], dict]:
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(_step_seed(self.seed, step))
        prompts = self.task.sample_prompts(num_prompts, generator)
        jobs = [
            (p, _step_seed(self.seed, step, i * self.group_size + j))
            for i, p in enumerate(prompts)
            for j in range(self.group_size)
        ]
        bar = _progress_bar(len(jobs), f"rollout step {step}", progress)
        async with self.make_client() as client:

            async def one(prompt: list[int], seed: int):
                result = await self._generate(client, prompt, seed)
                bar.update(1)
                return result

            try:
                samples = await asyncio.gather(*(one(p, s) for p, s in jobs))
            finally:
                bar.close()
        rewards = torch.tensor(
            [self.task.reward(p, r.response_ids) for (p, _), r in zip(jobs, samples, strict=True)]
        )
        advantages = group_advantages(rewards, self.group_size, normalize_std=self.normalize_std)
        trajectories = [
            self._trajectory(prompt, result, float(reward), float(adv))
            for (prompt, _), result, reward, adv in zip(jobs, samples, rewards, advantages, strict=True)
        ]
        stats = {
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "response_length": sum(t.response_length for t in trajectories) / len(trajectories),
            "rollout_s": time.perf_counter() - start,
        }
        return trajectories, stats

    async def _generate(self, client: RemoteGenerateClient, prompt: list[int], seed: int):
        return await client.generate(
            prompt,
            self.sampling.wire_params(self.client_config.protocol, seed),
            return_routed_experts=self.request_routes,
            routed_experts_prompt_start=0 if self.request_routes else None,
        )

    def _trajectory(self, prompt: list[int], result, reward: float, advantage: float) -> Trajectory:
        response = list(result.response_ids)
        routes = None
        if self.request_routes:
            trace = RoutedExpertTrace(self.schema.num_layers, self.schema.top_k, self.schema.num_experts)
            trace.record_generation(len(prompt), len(response), result.routed_experts)
            routes = trace.finalize(len(prompt) + len(response))
        return Trajectory(
            prompt,
            response,
            rollout_logprobs=result.response_logprobs,
            reward=reward,
            advantage=advantage,
            routed_experts=routes,
        )


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled, dynamic_ncols=True)


WeightSync = Callable[[Mapping[str, Tensor]], None]


class OnPolicyLoop(pl.Callback):
    """Rollout -> buffer -> train, once per epoch, with weight pushes in between.

    ``buffer``: the ``ReplayBuffer`` the data module draws from (refilled each step).
    ``gather_weights``: gather the full state dict each step (a collective under FSDP2, so it
    must be the same on every rank); ``sync_weights`` then pushes it to the engine (rank 0;
    ``None`` elsewhere or when the deployment syncs weights itself). ``metrics_path``: CSV
    rewritten after every step. In multi-process runs rank 0 collects and broadcasts the
    trajectories, so every rank's buffer is identical and the data module shards it.
    """

    def __init__(
        self,
        collector: RolloutCollector,
        buffer,
        *,
        prompts_per_step: int,
        sync_weights: WeightSync | None,
        gather_weights: bool = True,
        metrics_path: str | Path | None = None,
        progress: bool = True,
        full_state_dict: Callable[[pl.LightningModule], dict[str, Tensor]] | None = None,
    ) -> None:
        self.collector = collector
        self.buffer = buffer
        self.prompts_per_step = prompts_per_step
        self.sync_weights = sync_weights
        self.gather_weights = gather_weights
        self.metrics_path = None if metrics_path is None else Path(metrics_path)
        self.progress = progress
        self.full_state_dict = full_state_dict or _plain_state_dict
        self.history: list[dict[str, float]] = []
        self._pending: dict[str, float] = {}  # rollout stats of the step being trained
        self._epoch_start = 0.0

    # ------------------------------------------------------------------ lightning hooks

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is None:  # fresh run: roll out step 0 with the initial weights
            self._push_weights(pl_module)
            self._collect(trainer, trainer.current_epoch)
        # else the checkpoint holds the next step's rollouts (restored with the data module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is not None:
            # after the restore (which some strategies run after on_fit_start): the engine
            # still serves its initial weights
            self._push_weights(pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.current_epoch
        record = {"step": float(step), **self._pending}
        record["train_s"] = time.perf_counter() - self._epoch_start
        record.update(_epoch_metrics(trainer.callback_metrics))
        self.history.append(record)
        if self.metrics_path is not None and trainer.is_global_zero:
            write_csv(self.metrics_path, self.history)
        # Also after the last step: the checkpoint saved next then holds the next step's
        # rollouts, so a run extended with more steps resumes exactly where it stopped.
        self._push_weights(pl_module)
        self._collect(trainer, step + 1)

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "pending": self._pending}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self._pending = dict(state_dict.get("pending", {}))

    # ------------------------------------------------------------------ helpers

    def _push_weights(self, pl_module: pl.LightningModule) -> None:
        if not self.gather_weights:
            return
        state_dict = self.full_state_dict(pl_module)
        if self.sync_weights is not None:
            self.sync_weights(state_dict)

    def _collect(self, trainer: pl.Trainer, step: int) -> None:
        if trainer.world_size > 1:
            payload = None
            if trainer.is_global_zero:
                payload = self.collector.collect(step, self.prompts_per_step, progress=self.progress)
            trajectories, stats = trainer.strategy.broadcast(payload, src=0)
        else:
            trajectories, stats = self.collector.collect(step, self.prompts_per_step, progress=self.progress)
        self.buffer.clear()
        self.buffer.extend(trajectories)
        self._pending = stats


def _plain_state_dict(pl_module: pl.LightningModule) -> dict[str, Tensor]:
    """The policy's full weights keyed as in the HF model (what the engine serves), on rank 0;
    the other ranks get an empty dict (only rank 0 pushes).

    FSDP2-sharded parameters (DTensors) are all-gathered one at a time, a collective every rank
    must join; rank 0 moves each gathered tensor to the host at once, so no device ever holds
    more than one unsharded tensor (a whole unsharded policy would not fit beside its shards).
    Unsharded values are returned as they are, without a copy.
    """
    from torch.distributed.tensor import DTensor

    keep = pl_module.trainer.is_global_zero
    out = {}
    for name, value in pl_module.model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
            if keep:
                value = value.cpu()
        if keep:
            out[name] = value.detach()
    return out


def _epoch_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Flatten the epoch-aggregated logged metrics into CSV columns.

    ``train/<name>`` -> ``<name>``; the module's per-layer routing agreement keeps its
    ``agreement/layer_XX`` name.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        v = float(value.item() if isinstance(value, Tensor) else value)
        if key.startswith("train/"):
            out[key[len("train/") :]] = v
        elif key.startswith(AGREEMENT_PREFIX):
            out[key] = v
    return out
