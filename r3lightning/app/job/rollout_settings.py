"""The job's rollout settings groups as their dataclasses (checked by building them)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from r3lightning.app.job.common import JobError
from r3lightning.app.job.schema import SettingsError, build
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.vllm.settings import VllmSettings
from r3lightning.rollout.config import AheadConfig, CollectorConfig, RetryPolicy
from r3lightning.rollout.prompts import SamplingConfig

__all__ = [
    "collector_config",
    "launch_settings",
    "launched",
    "retry_policy",
    "sampling_config",
    "server_settings",
]


def _build(cls: type, node: DictConfig, key: str, skip: tuple[str, ...] = ()):
    try:
        return build(cls, node, key, skip=skip)
    except SettingsError as exc:
        raise JobError(str(exc)) from None


def server_settings(rollout: DictConfig) -> tuple[EngineConfig, ServerLimits]:
    """``rollout.server`` (but ``host`` and ``port``) and ``rollout.limits`` as the embedded server's
    ``EngineConfig`` and ``ServerLimits``."""
    engine = _build(EngineConfig, rollout.server, "rollout.server", skip=("host", "port"))
    return engine, _build(ServerLimits, rollout.limits, "rollout.limits")


def retry_policy(rollout: DictConfig) -> RetryPolicy:
    """``rollout.retry`` (with its ``backoff``) as a ``RetryPolicy``."""
    return _build(RetryPolicy, rollout.retry, "rollout.retry")


def collector_config(rollout: DictConfig) -> CollectorConfig:
    """``rollout.collector`` as a ``CollectorConfig``."""
    return _build(CollectorConfig, rollout.collector, "rollout.collector")


def sampling_config(rollout: DictConfig) -> SamplingConfig:
    """``rollout.sampling`` as a ``SamplingConfig``."""
    return _build(SamplingConfig, rollout.sampling, "rollout.sampling")


def launched(rollout: DictConfig) -> bool:
    """Whether the job starts a vLLM engine itself (``rollout.launch``, e.g. ``rollout=vllm_local``)."""
    return rollout.get("launch") is not None


def launch_settings(rollout: DictConfig, *, model: str) -> VllmSettings:
    """``rollout.launch`` as the ``VllmSettings`` of the engine the job starts on ``model``."""
    if "model" in rollout.launch:
        raise JobError("rollout.launch.model is set by the job (it serves the job's model); remove it")
    values = OmegaConf.to_container(rollout.launch, resolve=True)
    return _build(VllmSettings, {**values, "model": model}, "rollout.launch")


def ahead_config(rollout: DictConfig) -> AheadConfig:
    """``rollout.max_staleness`` as an ``AheadConfig``."""
    return _build(AheadConfig, OmegaConf.masked_copy(rollout, ["max_staleness"]), "rollout")
