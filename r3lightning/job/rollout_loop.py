"""The on-policy RL loop around a Lightning fit: one epoch = one RL step.

``OnPolicyLoop`` is the Lightning callback that keeps the engine on-policy: at fit start and
after every epoch rank 0 pushes the trainer's weights to the engine (one push per step), every
rank waits for that push, then every rank collects *its own* GRPO groups of the next step with a
:class:`~r3lightning.rollout.collector.RolloutCollector` into its own ``ReplayBuffer`` (the data
module reads it unsharded: ``R3DataModule(shard=False)``; the trainer reloads its dataloader
every epoch, ``reload_dataloaders_every_n_epochs=1``). No trajectory, and no route, crosses
ranks; only the collector's scalar statistics are all-reduced. One row of metrics per step.

Its history is part of the checkpoint, and the checkpoint taken after step ``e`` already holds
step ``e + 1``'s rollouts (in the data module's state), so a one-process resumed run continues
exactly. A checkpoint holds rank 0's buffer only, so a multi-rank resume collects the step's
groups again on every rank (same seeds, same restored weights) instead of using it.

The job's prompts come from the task (:class:`TaskPrompts`); its reward is the task's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from r3lightning.job.common import JobError
from r3lightning.job.report import AGREEMENT_PREFIX, CORRECTION_PREFIX, MISMATCH_PREFIX, write_csv
from r3lightning.job.rollout_settings import collector_config, retry_policy
from r3lightning.rollout.collector import RolloutCollector
from r3lightning.rollout.prompts import RolloutPrompt, SamplingConfig, sampling_seed
from r3lightning.rollout.tasks import ScoredTask
from r3lightning.wire.request import RouteSchema

WeightSync = Callable[[Mapping[str, Tensor]], None]

_PROMPTS = -1  # the "group index" of a step's prompt draw in sampling_seed (groups are >= 0)


@dataclass
class Engine:
    """Where rollouts come from and how the trainer's weights reach them.

    ``urls``: the engines' base URLs (None on ranks that learn them from rank 0: the embedded
    engine). ``push``: rank 0's weight sync (None elsewhere, or when the deployment syncs weights
    itself). ``gather``: whether every rank joins the per-step full-weight gather (a collective
    under FSDP2, so it is the same on every rank).
    """

    urls: list[str] | None
    push: WeightSync | None = None
    gather: bool = False


class TaskPrompts:
    """The step's global prompt list, drawn from the task with a generator seeded by
    ``(seed, step)``: the same on every rank, for any number of ranks."""

    def __init__(self, task: ScoredTask, num_prompts: int, seed: int) -> None:
        self.task, self.num_prompts, self.seed = task, num_prompts, seed

    def __call__(self, step: int) -> list[RolloutPrompt]:
        per_step = getattr(self.task.prompts, "prompts_for_step", None)
        if callable(per_step):  # a dataset task: its prompts are a pure function of the step
            return list(per_step(step, self.num_prompts))
        generator = torch.Generator().manual_seed(sampling_seed(self.seed, step, _PROMPTS))
        return [RolloutPrompt(p) for p in self.task.sample_prompts(self.num_prompts, generator)]

    def reward(self, prompt: RolloutPrompt, response_ids: list[int]) -> Any:
        return self.task.score_prompt(prompt, response_ids)

    def pop_metrics(self) -> dict[str, float]:
        return self.task.pop_metrics()


class OnPolicyLoop(pl.Callback):
    """Rollout -> per-rank buffer -> train, once per epoch, with weight pushes in between.

    ``make_collector(urls)``: builds the collector once the engine URLs are known on every rank
    (at fit start; the embedded engine's URL comes from rank 0). ``prompts(step)``: the step's
    global prompt list. ``buffer``: this rank's ``ReplayBuffer`` (refilled each step).
    ``engine``: its URLs and weight sync: every rank joins the full-state-dict gather when
    ``engine.gather`` (a collective under FSDP2), rank 0 pushes it with ``engine.push``, and
    every rank waits at a barrier for that push before collecting. ``metrics_path``: CSV
    rewritten after every step (rank 0). ``labels``: columns with the same value in every row
    (``simulated_disagreement`` when the engine simulates one).
    """

    def __init__(
        self,
        make_collector: Callable[[list[str]], RolloutCollector],
        prompts: Callable[[int], Sequence[RolloutPrompt]],
        buffer,
        *,
        engine: Engine,
        metrics_path: str | Path | None = None,
        full_state_dict: Callable[[pl.LightningModule], dict[str, Tensor]] | None = None,
        labels: Mapping[str, float] | None = None,
    ) -> None:
        self.make_collector = make_collector
        self.prompts = prompts
        self.buffer = buffer
        self.engine = engine
        self.metrics_path = None if metrics_path is None else Path(metrics_path)
        self.full_state_dict = full_state_dict or _plain_state_dict
        self.labels = dict(labels or {})
        self.collector: RolloutCollector | None = None
        self.history: list[dict[str, float]] = []
        self._pending: dict[str, float] = {}  # rollout stats of the step being trained
        self._epoch_start = 0.0
        self._pushed_on_restore = False

    # ------------------------------------------------------------------ lightning hooks

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_ranks(trainer)
        self._ensure_collector(trainer)
        if trainer.ckpt_path is None:  # fresh run: roll out step 0 with the initial weights
            self._push_weights(trainer, pl_module)
            self._collect(trainer, trainer.current_epoch)
        # else the checkpoint holds the next step's rollouts (restored with the data module)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint) -> None:
        if trainer.world_size > 1:
            # the restored buffer is rank 0's: collect this rank's groups of the step again, on
            # the restored weights (the engine still serves its initial ones)
            self._ensure_collector(trainer)
            self._push_weights(trainer, pl_module)
            self._collect(trainer, int(checkpoint["epoch"]) + 1)
            self._pushed_on_restore = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is not None and not self._pushed_on_restore:
            # after the restore (which some strategies run after on_fit_start): the engine
            # still serves its initial weights
            self._push_weights(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.current_epoch
        record = {"step": float(step), **self.labels, **self._pending}
        record["train_s"] = time.perf_counter() - self._epoch_start
        record.update(_epoch_metrics(trainer.callback_metrics))
        self.history.append(record)
        if self.metrics_path is not None and trainer.is_global_zero:
            write_csv(self.metrics_path, self.history)
        # Also after the last step: the checkpoint saved next then holds the next step's
        # rollouts, so a run extended with more steps resumes exactly where it stopped.
        self._push_weights(trainer, pl_module)
        self._collect(trainer, step + 1)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.collector is not None:
            self.collector.close()

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "pending": self._pending}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        if not self._pushed_on_restore:  # else the stats of the collection just repeated
            self._pending = dict(state_dict.get("pending", {}))

    # ------------------------------------------------------------------ helpers

    def _check_ranks(self, trainer: pl.Trainer) -> None:
        world = trainer.world_size
        if world == 1:
            return
        if getattr(trainer.datamodule, "shard", False):
            raise JobError(
                "every rank collects only its own groups, so the data module must not shard its "
                "buffer again: set data.shard=false"
            )
        num_prompts = len(self.prompts(0))
        if num_prompts % world:
            raise JobError(
                f"prompts_per_step ({num_prompts}) must be a multiple of the number of ranks ({world}): "
                "every rank trains on the same number of whole groups"
            )

    def _ensure_collector(self, trainer: pl.Trainer) -> None:
        if self.collector is not None:
            return
        urls = self.engine.urls
        if trainer.world_size > 1:
            urls = trainer.strategy.broadcast(urls, src=0)  # a few short strings, once per fit
            from r3lightning.serve.server import is_loopback

            host = urlsplit(urls[0]).hostname or ""
            if trainer.num_nodes > 1 and self.engine.urls is None and is_loopback(host):
                raise JobError(
                    f"the embedded engine listens on loopback ({urls[0]}), which other nodes cannot "
                    "reach: set rollout.server.host to this node's address, or rollout.url"
                )
        assert urls, "the engine URLs are known on rank 0"
        self.collector = self.make_collector(list(urls))

    def _push_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.engine.gather:
            state_dict = self.full_state_dict(pl_module)
            if self.engine.push is not None:
                self.engine.push(state_dict)
        if trainer.world_size > 1:
            trainer.strategy.barrier("r3lightning-weights-pushed")  # no rank samples stale weights

    def _collect(self, trainer: pl.Trainer, step: int) -> None:
        assert self.collector is not None
        self.buffer.clear()
        rollouts = self.collector.collect(self.prompts(step), step=step, buffer=self.buffer)
        stats = rollouts.stats
        self._pending = {
            "reward": stats.reward_mean,
            "reward_std": stats.reward_std,
            "response_length": stats.response_length_mean,
            "rollout_s": stats.rollout_s,
            "rollout_attempts": float(stats.attempts),
            "engine_errors": float(stats.engine_errors),
            **(self.prompts.pop_metrics() if hasattr(self.prompts, "pop_metrics") else {}),
        }
        if self.collector.environments is not None:  # turns, dropped groups, per-turn rewards and bytes
            self._pending.update(stats.turn_metrics())


def on_policy_loop(
    cfg: DictConfig, engine: Engine, task: ScoredTask, schema: RouteSchema, buffer, *, metrics_path: Path
) -> OnPolicyLoop:
    """The job's loop: the task's prompts and reward, a collector over ``engine``'s URLs built
    from ``rollout.collector``, ``rollout.retry`` and ``rollout.sampling``. Engines known here
    (not the embedded one on ranks > 0) must answer ``GET /health`` (else a ``JobError``)."""
    rollout = cfg.rollout
    prompts = TaskPrompts(task, int(cfg.prompts_per_step), int(cfg.seed))
    sampling = SamplingConfig(**OmegaConf.to_container(rollout.sampling, resolve=True))  # type: ignore[arg-type]
    if sampling.stop_token_ids is None:  # the tokenizer's EOS of a dataset task, in every protocol
        sampling.stop_token_ids = list(getattr(task.prompts, "stop_token_ids", None) or []) or None
    config, retry = collector_config(rollout), retry_policy(rollout)
    # a multi-turn task's environments give the reward
    reward = getattr(task, "environments", lambda: None)() or prompts.reward

    def make_collector(urls: list[str]) -> RolloutCollector:
        options = {"api_key": rollout.api_key}
        return RolloutCollector(
            urls,
            reward,
            config,
            schema=schema,
            sampling=sampling,
            retry=retry,
            client_options=options,
        )

    if engine.urls is not None:
        down = [url for url, ok in make_collector(engine.urls).check_engines().items() if not ok]
        if down:
            raise JobError(
                f"cannot reach the rollout engine at {', '.join(down)}: GET /health did not answer 200 "
                f"within {retry.health_timeout_s:g}s (rollout.retry.health_timeout_s); check rollout.url "
                "or start the engine"
            )
    simulated = OmegaConf.select(rollout, "server.simulated_disagreement") if rollout.url is None else None
    labels = {"simulated_disagreement": float(simulated)} if simulated else {}
    return OnPolicyLoop(
        make_collector, prompts, buffer, engine=engine, metrics_path=metrics_path, labels=labels
    )


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
    ``used_agreement/layer_XX`` name, its paired mismatch metrics their ``mismatch/<name>`` and its
    importance-sampling correction its ``correction/<name>``.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        v = float(value.item() if isinstance(value, Tensor) else value)
        if key.startswith("train/"):
            out[key[len("train/") :]] = v
        elif key.startswith((AGREEMENT_PREFIX, MISMATCH_PREFIX, CORRECTION_PREFIX)):
            out[key] = v
    return out
