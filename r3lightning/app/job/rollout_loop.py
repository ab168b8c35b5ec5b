"""The on-policy RL loop around a Lightning fit, one epoch per RL step: the trainer's weights go to the
engine, then every rank collects its own GRPO groups of the next step into its own ``ReplayBuffer``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf
from torch import Tensor
from torch.distributed.tensor import DTensor

from r3lightning.app.job.common import JobError
from r3lightning.app.job.grpo import GRPOAdvantages
from r3lightning.app.job.report import AGREEMENT_PREFIX, CORRECTION_PREFIX, MISMATCH_PREFIX, write_csv
from r3lightning.app.job.rollout_settings import collector_config, retry_policy, sampling_config
from r3lightning.app.serve.server import is_loopback
from r3lightning.app.tasks.token_class import ScoredTask
from r3lightning.rollout.collector import RolloutCollector
from r3lightning.rollout.stats import GroupsDroppedError
from r3lightning.wire.errors import RemoteGenerateError
from r3lightning.wire.request import RouteSchema


class WeightSync(Protocol):
    """Rank 0's weight push: the full weights of policy version ``version`` (optimizer steps) to the
    engines; returns once every engine serves them, raises ``JobError`` otherwise."""

    def __call__(self, state_dict: Mapping[str, Tensor], version: int) -> None: ...


@dataclass
class Engine:
    """Where rollouts come from: ``urls`` (None where rank 0 broadcasts the embedded engine's);
    ``push``, rank 0's weight sync (or None); ``gather``: every rank joins the full-weight gather."""

    urls: list[str] | None
    push: WeightSync | None = None
    gather: bool = False


class OnPolicyLoop(pl.Callback):
    """Rollout (``prompts_per_step`` prompts from ``engine``) -> this rank's ``buffer`` -> train, once per
    epoch, weights pushed in between; one row per step in ``metrics_path`` (rank 0)."""

    def __init__(
        self,
        cfg: DictConfig,
        engine: Engine,
        task: ScoredTask,
        schema: RouteSchema,
        buffer,
        metrics_path: Path,
    ) -> None:
        self.cfg, self.engine, self.task, self.schema, self.buffer = cfg, engine, task, schema, buffer
        self.metrics_path = metrics_path
        self.sampling = sampling_config(cfg.rollout)
        if self.sampling.stop_token_ids is None:  # the tokenizer's EOS of a dataset task, in every protocol
            stop = list(getattr(task.prompts, "stop_token_ids", None) or []) or None
            self.sampling = dataclasses.replace(self.sampling, stop_token_ids=stop)
        simulated = cfg.rollout.url is None and OmegaConf.select(cfg, "rollout.server.simulated_disagreement")
        self.labels = {"simulated_disagreement": float(simulated)} if simulated else {}
        if cfg.rollout.protocol == "vllm":
            self.labels["vllm_engine"] = 1.0
        self.collector: RolloutCollector | None = None
        self.history: list[dict[str, float]] = []
        self._pending: dict[str, float] = {}  # rollout stats of the step being trained
        self._epoch_start = 0.0
        self._pushed_on_restore = False
        self._next_collected = False  # whether the buffer holds the next step's rollouts
        self._version = 0  # the policy version (optimizer steps) last pushed to the engine

    def new_collector(self, urls: list[str]) -> RolloutCollector:
        rollout = self.cfg.rollout
        environments = getattr(self.task, "environments", lambda: None)()  # multi-turn
        return RolloutCollector(
            urls,
            environments or self.task.score_prompt,
            collector_config(rollout),
            advantages=GRPOAdvantages(
                normalize_std=bool(self.cfg.algorithm.normalize_std),
                std_eps=float(self.cfg.algorithm.std_eps),
            ),
            schema=self.schema,
            sampling=self.sampling,
            client_options={"retry": retry_policy(rollout), "api_key": rollout.api_key},
        )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size > 1 and getattr(trainer.datamodule, "shard", False):
            raise JobError(
                "every rank collects only its own groups, so the data module must not shard its "
                "buffer again: set data.options.shard=false"
            )
        if int(self.cfg.prompts_per_step) % trainer.world_size:
            raise JobError(
                f"prompts_per_step ({self.cfg.prompts_per_step}) must be a multiple of the number of ranks "
                f"({trainer.world_size}): every rank trains on the same number of whole groups"
            )
        self._ensure_collector(trainer)
        if trainer.ckpt_path is None:  # fresh run: roll out step 0 with the initial weights
            self._push_weights(trainer, pl_module)
            self._collect(trainer.current_epoch)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint) -> None:
        step = int(checkpoint["epoch"]) + 1
        collected = checkpoint.get("callbacks", {}).get(self.state_key, {}).get("next_collected", True)
        if (trainer.world_size > 1 or not collected) and step < trainer.max_epochs:
            # the restored buffer is rank 0's, or not the next step's: collect this rank's groups
            # of the step again, on the restored weights (the engine still serves its initial ones)
            self._ensure_collector(trainer)
            # the trainer's step counter is restored after the callbacks: the checkpoint's own
            self._push_weights(trainer, pl_module, int(checkpoint.get("global_step", 0)))
            self._collect(step)
            self._pushed_on_restore = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is not None and not self._pushed_on_restore:
            # after the restore (some strategies run it after on_fit_start): the engine still
            # serves its initial weights
            self._push_weights(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.current_epoch
        record = {"step": float(step), **self.labels, **self._pending}
        record["train_s"] = time.perf_counter() - self._epoch_start
        for key, value in trainer.callback_metrics.items():  # train/<name> as <name>
            if key.startswith(("train/", AGREEMENT_PREFIX, MISMATCH_PREFIX, CORRECTION_PREFIX)):
                record[key.removeprefix("train/")] = float(value)
        self.history.append(record)
        if trainer.is_global_zero:
            write_csv(self.metrics_path, self.history)
        self._next_collected = step + 1 < trainer.max_epochs  # none after the last step
        if self._next_collected:
            self._push_weights(trainer, pl_module)
            self._collect(step + 1)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.collector is not None:
            self.collector.close()

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "pending": self._pending, "next_collected": self._next_collected}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        if not self._pushed_on_restore:  # else the stats of the collection just repeated
            self._pending = dict(state_dict.get("pending", {}))

    def _ensure_collector(self, trainer: pl.Trainer) -> None:
        urls = self.engine.urls
        if self.collector is None and trainer.world_size > 1:
            urls = trainer.strategy.broadcast(urls, src=0)  # a few short strings, once per fit
            host = urlsplit(urls[0]).hostname or ""
            if trainer.num_nodes > 1 and self.engine.urls is None and is_loopback(host):
                raise JobError(
                    f"the embedded engine listens on loopback ({urls[0]}), which other nodes cannot "
                    "reach: set rollout.server.host to this node's address, or rollout.url"
                )
        if self.collector is None:
            assert urls, "the engine URLs are known on rank 0"
            self.collector = self.new_collector(list(urls))

    def _push_weights(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, version: int | None = None
    ) -> None:
        """The trainer's weights to the engine as policy ``version`` (default: its optimizer steps)."""
        self._version = trainer.global_step if version is None else version
        if self.engine.gather:
            state_dict = full_state_dict(pl_module)
            if self.engine.push is not None:
                self.engine.push(state_dict, self._version)
        if trainer.world_size > 1:
            trainer.strategy.barrier("r3lightning-weights-pushed")  # no rank samples stale weights

    def _collect(self, step: int) -> None:
        assert self.collector is not None
        self.buffer.clear()
        prompts = self.task.prompts_for_step(step, int(self.cfg.prompts_per_step), int(self.cfg.seed))
        # the weights pushed before every collection: the policy version of the trainer's step
        version = self._version if self.engine.gather else None
        try:
            stats = self.collector.collect(
                prompts, step=step, buffer=self.buffer, weight_version=version
            ).stats
        except GroupsDroppedError as exc:  # one line: exit 3 if the engine failed every group, else 2
            engine = all(isinstance(e, RemoteGenerateError) for e in exc.errors.values())
            raise (RemoteGenerateError if engine else JobError)(str(exc)) from None
        self._pending = {
            "reward": stats.reward_mean,
            "reward_std": stats.reward_std,
            "response_length": stats.response_length_mean,
            "rollout_s": stats.rollout_s,
            "rollout_attempts": float(stats.attempts),
            "engine_errors": float(stats.engine_errors),
            **self.task.pop_metrics(),
        }
        if self.collector.environments is not None:  # turns, dropped groups, per-turn rewards and bytes
            self._pending.update(stats.turn_metrics())


def on_policy_loop(
    cfg: DictConfig, engine: Engine, task: ScoredTask, schema: RouteSchema, buffer, *, metrics_path: Path
) -> OnPolicyLoop:
    """The job's :class:`OnPolicyLoop`, once the engines known here answered ``GET /health``."""
    loop = OnPolicyLoop(cfg, engine, task, schema, buffer, metrics_path)
    health = loop.new_collector(engine.urls).check_engines() if engine.urls is not None else {}
    down = [url for url, ok in health.items() if not ok]
    if down:
        raise JobError(
            f"cannot reach the rollout engine at {', '.join(down)}: GET /health did not answer 200 "
            f"within {retry_policy(cfg.rollout).health_timeout_s:g}s (rollout.retry.health_timeout_s); "
            "check rollout.url or start the engine"
        )
    return loop


def full_state_dict(pl_module: pl.LightningModule) -> dict[str, Tensor]:
    """The policy's full weights keyed as in the HF model on rank 0 (an empty dict elsewhere). FSDP2
    DTensors are all-gathered one at a time (every rank joins) and moved to rank 0's host at once."""
    keep, out = pl_module.trainer.is_global_zero, {}
    for name, value in pl_module.model.state_dict().items():
        if isinstance(value, DTensor):  # at most one unsharded tensor on the device beside the shards
            value = value.full_tensor()  # a collective: every rank joins
            value = value.cpu() if keep else value
        if keep:  # unsharded values without a copy
            out[name] = value.detach()
    return out
