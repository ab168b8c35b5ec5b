"""The job's rollout settings groups as their dataclasses (checked by building them)."""

from __future__ import annotations

from omegaconf import DictConfig

from r3lightning.app.job.common import JobError
from r3lightning.app.job.schema import SettingsError, build
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.rollout.config import CollectorConfig, RetryPolicy
from r3lightning.rollout.prompts import SamplingConfig

__all__ = ["collector_config", "retry_policy", "sampling_config", "server_settings"]


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
