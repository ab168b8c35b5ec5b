"""Settings of the rollout client and collector: frozen dataclasses, checked when built.

:class:`RetryPolicy` (with its :class:`Backoff`) says how a :class:`RemoteGenerateClient` talks
to one engine; :class:`CollectorConfig` how a :class:`RolloutCollector` gathers a step. The job's
``rollout.retry.*`` and ``rollout.collector.*`` keys map to their fields one to one.
:func:`route_schema` reads the route schema from a model config. Every bad value is a
``ValueError`` whose message starts with the field name.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from r3lightning.wire.request import PROTOCOL_PATHS, RouteSchema

__all__ = ["Backoff", "CollectorConfig", "RetryPolicy", "check_setting", "route_schema"]

PROTOCOLS = tuple(PROTOCOL_PATHS)


def check_setting(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    integer: bool = False,
    above: bool = False,
    optional: bool = False,
) -> None:
    """``ValueError`` unless ``value`` is a finite number (an int if ``integer``; never a bool)
    ``>= low`` (``> low`` if ``above``) and ``<= high``; ``None`` passes when ``optional``."""
    if value is None and optional:
        return
    kind = "an integer" if integer else "a number"
    bounds = [f"{'>' if above else '>='} {low:g}"] if low is not None else []
    bounds += [f"<= {high:g}" if isinstance(high, float) else f"<= {high}"] if high is not None else []
    expected = " ".join([f"{'None or ' if optional else ''}{kind}", " and ".join(bounds)]).strip()
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    ok = ok and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if above else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class Backoff:
    """Delay before retry ``r`` (1-based): ``min(cap_s, base_s * 2**(r-1))``, less a random
    fraction up to ``jitter`` of it (1: full jitter, 0: none). A ``Retry-After`` header replaces
    the computed delay, clipped to ``max_retry_after_s``."""

    base_s: float = 0.5
    cap_s: float = 8.0
    jitter: float = 1.0
    max_retry_after_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("base_s", "cap_s", "max_retry_after_s"):
            check_setting(name, getattr(self, name), low=0)
        check_setting("jitter", self.jitter, low=0, high=1)

    def delay(self, retry: int, rng: random.Random) -> float:
        delay = min(self.cap_s, self.base_s * 2.0 ** (retry - 1))
        return delay * (1.0 - self.jitter * rng.random())


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries one engine and notices that it stopped answering.

    ``max_attempts`` per ``generate`` call, spaced by ``backoff``. ``timeout_s`` bounds one
    attempt (long: a generation may take minutes; waiting for a free connection is not counted),
    ``connect_timeout_s`` opening a connection and ``health_timeout_s`` one ``GET /health``.
    While requests wait on an engine, its ``/health`` is probed every ``health_interval_s``
    (``None``: never); ``health_failures`` probes in a row that fail declare it hung, and its
    waiting requests raise :class:`~r3lightning.wire.errors.RetriesExhaustedError` at once (a
    collector then moves them to another engine). With the defaults a hung engine is found
    within ``health_failures * (health_interval_s + health_timeout_s)`` = 20 s; an engine that
    answers ``/health`` keeps its long generations up to ``timeout_s``.
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
    """How a :class:`~r3lightning.rollout.collector.RolloutCollector` gathers one RL step.

    ``group_size``: samples per prompt (a GRPO group, >= 2, kept whole on one rank). ``seed``:
    the run's seed (every sample's is :func:`~r3lightning.rollout.prompts.sampling_seed` of it).
    ``protocol``: the wire protocol of engines given as URLs. ``request_routes``: ask engines for
    routes. ``normalize_std``: GRPO advantages divide by the group's reward std (False: Dr.
    GRPO). ``max_in_flight``: this rank's requests in flight over all engines.
    ``reward_threads`` > 0 runs a plain reward function in a thread pool of that size.
    ``progress``: a progress bar on rank 0.
    """

    group_size: int
    seed: int = 0
    protocol: str = "skyrl"
    request_routes: bool = True
    normalize_std: bool = True
    max_in_flight: int = 64
    reward_threads: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        check_setting("group_size", self.group_size, low=2, integer=True)
        check_setting("seed", self.seed, integer=True)
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {list(PROTOCOLS)}, got {self.protocol!r}")
        for name in ("request_routes", "normalize_std", "progress"):
            _check_bool(name, getattr(self, name))
        check_setting("max_in_flight", self.max_in_flight, low=1, integer=True)
        check_setting("reward_threads", self.reward_threads, low=0, integer=True)


# where each family's config keeps the total number of routed experts
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def route_schema(
    model_config: RouteSchema | Mapping[str, Any] | Any, *, layers: Sequence[int] | None = None
) -> RouteSchema:
    """The route schema (``num_layers``, ``top_k``, ``num_experts``) of a model config, keeping
    only decoder layers ``layers`` when given (a pipeline stage's, a partial model's).

    ``model_config``: a :class:`~r3lightning.wire.request.RouteSchema` (returned as is), a
    Hugging Face ``PretrainedConfig`` or its dict: ``num_hidden_layers`` (every decoder layer,
    dense ones included), ``num_experts_per_tok`` and the expert count under ``num_experts``
    (Qwen-MoE, OLMoE), ``num_local_experts`` (Mixtral, gpt-oss) or ``n_routed_experts``
    (DeepSeek-V3). A multimodal config is read through ``get_text_config()``.
    """
    if isinstance(model_config, RouteSchema):
        return model_config if layers is None else replace(model_config, layers=layers)
    if hasattr(model_config, "get_text_config"):
        model_config = model_config.get_text_config()
    if isinstance(model_config, Mapping):
        get = model_config.get
    else:

        def get(key: str) -> Any:
            return getattr(model_config, key, None)

    experts = next((get(k) for k in _EXPERT_COUNT_KEYS if get(k)), None)
    found = {
        "num_hidden_layers": get("num_hidden_layers"),
        "num_experts_per_tok": get("num_experts_per_tok"),
        " / ".join(_EXPERT_COUNT_KEYS): experts,
    }
    missing = [key for key, value in found.items() if not isinstance(value, int) or value < 1]
    if missing:
        raise ValueError(
            f"model config has no MoE route schema: missing or not a positive integer: {missing}"
        )
    num_layers, top_k, _ = found.values()
    return RouteSchema(num_layers, top_k, experts, layers=layers)
