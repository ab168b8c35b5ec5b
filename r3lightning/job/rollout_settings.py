"""The job's rollout settings: ``rollout.retry``, ``rollout.collector``, ``rollout.server`` (but
``host`` and ``port``) and ``rollout.limits`` as :class:`RetryPolicy`, :class:`CollectorConfig`,
:class:`EngineConfig` and :class:`ServerLimits`, field for field, checked when the config is read
(a one-line ``JobError`` naming the key, and a moved key's new place)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from r3lightning.job.build import dataclass_from
from r3lightning.job.common import JobError
from r3lightning.rollout.config import Backoff, CollectorConfig, RetryPolicy

if TYPE_CHECKING:
    from r3lightning.serve.config import EngineConfig, ServerLimits

T = TypeVar("T")

# keys that moved into a settings group: old -> new
_MOVED = {
    "rollout.request_timeout_s": "rollout.retry.timeout_s",
    "rollout.max_in_flight": "rollout.collector.max_in_flight",
}


def check_rollout(cfg: DictConfig) -> None:
    """Refuse a moved key or a bad value of ``rollout.retry`` / ``collector`` / ``server`` /
    ``limits`` (a one-line ``JobError`` naming the key) before anything is built."""
    for old, new in _MOVED.items():
        if OmegaConf.select(cfg, old) is not None:
            raise JobError(f"{old} moved to {new}; set {new}={OmegaConf.select(cfg, old)} instead")
    retry_policy(cfg.rollout)
    collector_config(cfg.rollout)
    server_settings(cfg.rollout)


def server_settings(rollout: DictConfig) -> tuple[EngineConfig, ServerLimits]:
    """The embedded server's :class:`EngineConfig` (``rollout.server`` but ``host`` and
    ``port``) and :class:`ServerLimits` (``rollout.limits``)."""
    from r3lightning.serve.config import EngineConfig, ServerLimits

    engine = settings_from(EngineConfig, rollout.server, "rollout.server", skip=("host", "port"))
    return engine, settings_from(ServerLimits, rollout.limits, "rollout.limits")


def retry_policy(rollout: DictConfig) -> RetryPolicy:
    """``rollout.retry`` (with its ``backoff``) as a :class:`RetryPolicy`; a bad value is a
    ``JobError`` naming the key."""
    backoff = settings_from(Backoff, rollout.retry.backoff, "rollout.retry.backoff")
    return settings_from(RetryPolicy, rollout.retry, "rollout.retry", backoff=backoff)


def collector_config(rollout: DictConfig) -> CollectorConfig:
    """``rollout.collector`` as a :class:`CollectorConfig`."""
    return settings_from(CollectorConfig, rollout.collector, "rollout.collector")


def settings_from(cls: type[T], node: DictConfig, key: str, skip: tuple[str, ...] = (), **fixed: Any) -> T:
    """``cls`` from ``node`` (types checked, unknown keys refused, ``skip`` left out) with ``fixed``
    fields set; a refused value is a ``JobError`` naming ``key.<field>`` and, for an
    interpolated one, where it comes from (``${reward_threads}``)."""
    try:
        settings = dataclass_from(cls, node, key, skip=(*skip, *fixed))
        return replace(settings, **fixed) if fixed else settings
    except (ValueError, JobError) as exc:  # the config's messages start with the field name
        message = str(exc) if isinstance(exc, JobError) else f"{key}.{exc}"
        raw = OmegaConf.to_container(node, resolve=False).get(message.removeprefix(f"{key}.").split()[0])
        source = f" (set by {raw})" if isinstance(raw, str) and raw.startswith("${") else ""
        raise JobError(message + source) from None
