"""The job's rollout settings groups as their dataclasses; a bad or moved key is a one-line JobError."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from r3lightning.app.job.build import dataclass_from, plain
from r3lightning.app.job.common import JobError
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.vllm.settings import VllmSettings
from r3lightning.checks import check_setting
from r3lightning.rollout.ahead import AheadConfig
from r3lightning.rollout.config import CollectorConfig, RetryPolicy

# keys that moved into a settings group: old -> new
_MOVED = {
    "rollout.request_timeout_s": "rollout.retry.timeout_s",
    "rollout.max_in_flight": "rollout.collector.max_in_flight",
}


def check_rollout(cfg: DictConfig) -> None:
    """Refuse a moved key or a bad value of the rollout settings groups."""
    for old, new in _MOVED.items():
        if OmegaConf.select(cfg, old) is not None:
            raise JobError(f"{old} moved to {new}; set {new}={OmegaConf.select(cfg, old)} instead")
    retry_policy(cfg.rollout)
    collector_config(cfg.rollout)
    try:  # a hanging environment method drops its group after this long (None: unbounded)
        check_setting(
            "rollout.env_timeout_s", cfg.rollout.get("env_timeout_s"), low=0, above=True, optional=True
        )
    except ValueError as exc:
        raise JobError(str(exc)) from None
    server_settings(cfg.rollout)
    ahead_config(cfg.rollout)
    if launched(cfg.rollout):
        launch_settings(cfg.rollout, model="(the job's model)")


def launched(rollout: DictConfig) -> bool:
    """Whether the job starts its own vLLM engine (``rollout=vllm_local``: ``rollout.launch`` set)."""
    return rollout.get("launch") is not None


def launch_settings(rollout: DictConfig, *, model: str) -> VllmSettings:
    """``rollout.launch`` and ``model`` (the directory the job serves) as the engine's :class:`VllmSettings`."""
    if "model" in rollout.launch:
        raise JobError("rollout.launch.model is set by the job (it serves the job's model); remove it")
    return dataclass_from(VllmSettings, {**plain(rollout.launch), "model": model}, "rollout.launch")


def server_settings(rollout: DictConfig) -> tuple[EngineConfig, ServerLimits]:
    """``rollout.server`` (but ``host`` and ``port``) and ``rollout.limits`` as the embedded server's
    :class:`EngineConfig` and :class:`ServerLimits`."""
    engine = dataclass_from(EngineConfig, rollout.server, "rollout.server", skip=("host", "port"))
    return engine, dataclass_from(ServerLimits, rollout.limits, "rollout.limits")


def retry_policy(rollout: DictConfig) -> RetryPolicy:
    """``rollout.retry`` (with its ``backoff``) as a :class:`RetryPolicy`."""
    return dataclass_from(RetryPolicy, rollout.retry, "rollout.retry")


def collector_config(rollout: DictConfig) -> CollectorConfig:
    """``rollout.collector`` as a :class:`CollectorConfig`."""
    return dataclass_from(CollectorConfig, rollout.collector, "rollout.collector")


def ahead_config(rollout: DictConfig) -> AheadConfig:
    """``rollout.max_staleness`` as an :class:`AheadConfig`."""
    fields = {"max_staleness": OmegaConf.select(rollout, "max_staleness", default=0)}
    return dataclass_from(AheadConfig, fields, "rollout")
