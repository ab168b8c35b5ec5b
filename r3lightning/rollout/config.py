"""Settings of the rollout client and collector: frozen dataclasses, checked when built (a bad
value is a ``ValueError`` whose message starts with the field name), and `route_schema`.
The configuration page has each field and its job key.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from r3lightning.checks import check_setting
from r3lightning.wire.request import PROTOCOL_PATHS, RouteSchema

__all__ = ["AheadConfig", "Backoff", "CollectorConfig", "RetryPolicy", "route_schema"]


@dataclass(frozen=True)
class Backoff:
    """Delay before retry ``r`` (1-based): ``min(cap_s, base_s * 2**(r-1))`` less a random fraction
    up to ``jitter`` of it; a ``Retry-After`` header replaces it, clipped to ``max_retry_after_s``."""

    base_s: float = 0.5
    cap_s: float = 8.0
    jitter: float = 1.0
    max_retry_after_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("base_s", "cap_s", "max_retry_after_s"):
            check_setting(name, getattr(self, name), low=0)
        check_setting("jitter", self.jitter, low=0, high=1)

    def delay(self, retry: int, rng: random.Random) -> float:
        """The delay before one retry.

        Args:
            retry: The retry's number, from 1.
            rng: The jitter's source (the client's own).

        Returns:
            Seconds: ``min(cap_s, base_s * 2**(retry - 1))`` less up to ``jitter`` of it.
        """
        delay = min(self.cap_s, self.base_s * 2.0 ** (retry - 1))
        return delay * (1.0 - self.jitter * rng.random())


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries one engine and notices that it hung.

    Args:
        max_attempts: Attempts per generate call (retryable errors: connection errors, timeouts,
            408 / 429 / 5xx, cut-off bodies).
        backoff: The delay between attempts.
        timeout_s: One generate attempt's limit, in seconds (finite: a hung engine is given up on).
        connect_timeout_s: The limit on opening a connection.
        health_timeout_s: One ``/health`` probe's limit.
        health_interval_s: While requests wait, probe ``/health`` this often (None: never).
        health_failures: Failed probes in a row that declare the engine hung: its waiting requests
            end at once with ``RetriesExhaustedError``.

    Raises:
        ValueError: A field of the wrong type, out of range or not finite.
    """

    max_attempts: int = 5
    backoff: Backoff = field(default_factory=Backoff)
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    health_timeout_s: float = 5.0
    health_interval_s: float | None = 5.0
    health_failures: int = 2

    def __post_init__(self) -> None:
        check_setting("max_attempts", self.max_attempts, low=1, integer=True)
        if not isinstance(self.backoff, Backoff):
            raise ValueError(f"backoff must be a Backoff, got {type(self.backoff).__name__}")
        for name in ("timeout_s", "connect_timeout_s", "health_timeout_s"):
            check_setting(name, getattr(self, name), low=0, above=True)
        check_setting("health_interval_s", self.health_interval_s, low=0, above=True, optional=True)
        check_setting("health_failures", self.health_failures, low=1, integer=True)

    @property
    def hung_after_s(self) -> float | None:
        """Longest time before a hung engine is declared (None: never probed)."""
        if self.health_interval_s is None:
            return None
        return self.health_failures * (self.health_interval_s + self.health_timeout_s)


@dataclass(frozen=True)
class CollectorConfig:
    """How a [`RolloutCollector`][r3lightning.rollout.collector.RolloutCollector] gathers one RL step.

    Args:
        group_size: Samples per prompt (a group, at least 2), kept whole on one rank and engine.
        seed: Every sample's sampling seed is a function of it, the step, the group and the sample.
        protocol: The wire protocol of engines given as URLs (``skyrl``, ``vllm``, ``sglang``, ``openai``).
        request_routes: Ask the engines for routes (needs the route schema).
        max_in_flight: This rank's requests in flight over all engines.
        reward_threads: Run plain reward functions and environments in a thread pool of this size
            (0: on the event loop).
        progress: Show a progress bar on rank zero.

    Raises:
        ValueError: A field of the wrong type or out of range (the message names it).
    """

    group_size: int
    seed: int = 0
    protocol: str = "skyrl"
    request_routes: bool = True
    max_in_flight: int = 64
    reward_threads: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        check_setting("group_size", self.group_size, low=2, integer=True)
        check_setting(
            "seed", self.seed, low=0, high=2**63 - 1, integer=True
        )  # sampling seeds hash it as int64
        if self.protocol not in PROTOCOL_PATHS:
            raise ValueError(f"protocol must be one of {list(PROTOCOL_PATHS)}, got {self.protocol!r}")
        for name in ("request_routes", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_setting("max_in_flight", self.max_in_flight, low=1, integer=True)
        check_setting("reward_threads", self.reward_threads, low=0, integer=True)


# where each family's config keeps the total number of routed experts
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class AheadConfig:
    """How far rollouts may run ahead of training.

    Args:
        max_staleness: most policy versions between the weights that generated a trajectory and
            the weights that train on it; 0: on-policy (collect, train, collect).
    """

    max_staleness: int = 0

    def __post_init__(self) -> None:
        check_setting("max_staleness", self.max_staleness, low=0, integer=True)

    @property
    def ahead(self) -> int:
        """Whole steps that may wait beside the one in training (a streaming buffer's bound)."""
        return max(1, self.max_staleness)


def route_schema(
    model_config: RouteSchema | Mapping[str, Any] | Any, *, layers: Sequence[int] | None = None
) -> RouteSchema:
    """The route schema of a model.

    Args:
        model_config: A `RouteSchema` (returned as is), or a Hugging Face config or its dict:
            ``num_hidden_layers`` (dense layers included), ``num_experts_per_tok``, and
            ``num_experts``, ``num_local_experts`` or ``n_routed_experts``; a multimodal config's
            ``get_text_config()`` is used.
        layers: Keep only these decoder layers' routes (a pipeline stage's).

    Returns:
        The schema.

    Raises:
        ValueError: A config without those fields as positive ints, or bad ``layers``.
    """
    if isinstance(model_config, RouteSchema):
        return model_config if layers is None else replace(model_config, layers=layers)
    if hasattr(model_config, "get_text_config"):
        model_config = model_config.get_text_config()
    mapping = isinstance(model_config, Mapping)

    def get(key: str) -> Any:
        return model_config.get(key) if mapping else getattr(model_config, key, None)

    found = {key: get(key) for key in ("num_hidden_layers", "num_experts_per_tok")}
    found[" / ".join(_EXPERT_COUNT_KEYS)] = next((get(k) for k in _EXPERT_COUNT_KEYS if get(k)), None)
    missing = [key for key, value in found.items() if not isinstance(value, int) or value < 1]
    if missing:
        raise ValueError(
            f"model config has no MoE route schema: missing or not a positive integer: {missing}"
        )
    return RouteSchema(*found.values(), layers=layers)
