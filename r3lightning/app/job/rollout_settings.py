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
    "ahead_config",
    "collector_config",
    "launch_settings",
    "launched",
    "retry_policy",
    "sampling_config",
    "server_settings",
]


def _build(cls: type, node: DictConfig | dict, key: str, skip: tuple[str, ...] = ()):
    """`build`, its `SettingsError` turned into the job's one-line `JobError`."""
    try:
        return build(cls, node, key, skip=skip)
    except SettingsError as exc:
        raise JobError(str(exc)) from None


def server_settings(rollout: DictConfig) -> tuple[EngineConfig, ServerLimits]:
    """The embedded server's settings.

    Cost: imports torch (a built ``EngineConfig`` holds a ``torch.dtype``); `check_values` checks
    every other value before it.

    Args:
        rollout: the job config's ``rollout`` node.

    Returns:
        ``rollout.server`` (its keys but ``host`` and ``port``, which say where the server listens)
        as an ``EngineConfig``, and ``rollout.limits`` as ``ServerLimits``.

    Raises:
        JobError: a refused value, naming its key.
    """
    engine = _build(EngineConfig, rollout.server, "rollout.server", skip=("host", "port"))
    limits = _build(ServerLimits, rollout.limits, "rollout.limits")
    return engine, limits


def retry_policy(rollout: DictConfig) -> RetryPolicy:
    """The rollout client's retries.

    Args:
        rollout: the job config's ``rollout`` node.

    Returns:
        ``rollout.retry`` (with its ``backoff``) as a ``RetryPolicy``.

    Raises:
        JobError: a refused value, naming its key.
    """
    return _build(RetryPolicy, rollout.retry, "rollout.retry")


def collector_config(rollout: DictConfig) -> CollectorConfig:
    """The rollout collector's settings.

    Args:
        rollout: the job config's ``rollout`` node.

    Returns:
        ``rollout.collector`` as a ``CollectorConfig``.

    Raises:
        JobError: a refused value, naming its key.
    """
    return _build(CollectorConfig, rollout.collector, "rollout.collector")


def sampling_config(rollout: DictConfig) -> SamplingConfig:
    """The engine's sampling parameters.

    Args:
        rollout: the job config's ``rollout`` node.

    Returns:
        ``rollout.sampling`` as a ``SamplingConfig``.

    Raises:
        JobError: a refused value, naming its key.
    """
    return _build(SamplingConfig, rollout.sampling, "rollout.sampling")


def launched(rollout: DictConfig) -> bool:
    """Whether the job starts a vLLM engine itself.

    Args:
        rollout: the job config's ``rollout`` node.

    Returns:
        True when ``rollout.launch`` is set (e.g. ``rollout=vllm_local``).
    """
    return rollout.get("launch") is not None


def launch_settings(rollout: DictConfig, *, model: str) -> VllmSettings:
    """The settings of the vLLM engine the job starts.

    Args:
        rollout: the job config's ``rollout`` node; ``rollout.launch`` must be set (`launched`).
        model: what the engine serves: the job's model, which the job sets itself.

    Returns:
        ``rollout.launch`` (interpolations resolved) with ``model`` as ``VllmSettings``.

    Raises:
        JobError: ``rollout.launch.model`` is set, or a refused value, naming its key.
    """
    if "model" in rollout.launch:
        raise JobError("rollout.launch.model is set by the job (it serves the job's model); remove it")
    values = OmegaConf.to_container(rollout.launch, resolve=True)
    return _build(VllmSettings, {**values, "model": model}, "rollout.launch")


def ahead_config(rollout: DictConfig) -> AheadConfig:
    """How far rollouts may run ahead of training.

    Args:
        rollout: the job config's ``rollout`` node.

    Returns:
        ``rollout.max_staleness`` as an ``AheadConfig``.

    Raises:
        JobError: a refused value, naming its key.
    """
    return _build(AheadConfig, OmegaConf.masked_copy(rollout, ["max_staleness"]), "rollout")
