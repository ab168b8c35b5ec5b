"""The job's own settings groups, frozen dataclasses checked when built, as the library's are.

With the library's settings dataclasses they are the one source of the job config's types and
defaults (``conf/`` repeats the defaults with their explanations; a test keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from r3lightning.checks import check_setting, check_soft_threshold
from r3lightning.wire.codec import MISSING_ROWS
from r3lightning.wire.request import PROTOCOL_PATHS

__all__ = [
    "FLOAT_DTYPES",
    "REPLAY_MODES",
    "DataModuleSettings",
    "OptimConfig",
    "ReplaySettings",
    "RolloutSettings",
    "RunSettings",
    "ServerAddress",
    "WeightSyncSettings",
]

INT64_MAX = 2**63 - 1
SEED_MAX = 2**32 - 1  # Lightning's seed_everything range
EMBEDDED_PROTOCOLS = ("skyrl", "sglang")  # what the embedded engine speaks
REPLAY_MODES = ("r3", "r2", "off")
FLOAT_DTYPES = ("bfloat16", "float16", "float32")


def _check_bool(name: str, value: Any, *, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        raise ValueError(f"{name} must be true or false{' or null' if optional else ''}, got {value!r}")


@dataclass(frozen=True)
class RunSettings:
    """The top-level keys of the job config.

    Args:
        seed: the first run's seed; every run of ``seeds`` adds one (``seed + seeds - 1`` at most
            ``2**32 - 1``, Lightning's range).
        steps: RL steps; each is one rollout of the current policy and one pass of updates.
        prompts_per_step: prompts per step, each sampled ``algorithm.group_size`` times.
        reward_threads: threads scoring responses while others still generate (0: the event loop).
        seeds: runs per arm, from ``seed`` on.
        resume: continue from a run folder's ``checkpoints/last.ckpt`` when it exists.
        plot: write ``metrics.png``.
    """

    seed: int = 0
    steps: int = 30
    prompts_per_step: int = 16
    reward_threads: int = 4
    seeds: int = 1
    resume: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        check_setting("seed", self.seed, low=0, high=SEED_MAX, integer=True)
        check_setting("steps", self.steps, low=1, high=INT64_MAX, integer=True)
        check_setting("prompts_per_step", self.prompts_per_step, low=1, high=INT64_MAX, integer=True)
        check_setting("reward_threads", self.reward_threads, low=0, high=1024, integer=True)
        check_setting("seeds", self.seeds, low=1, high=SEED_MAX - self.seed + 1, integer=True)
        _check_bool("resume", self.resume)
        _check_bool("plot", self.plot)


@dataclass(frozen=True)
class ReplaySettings:
    """The ``replay`` group.

    Args:
        mode: ``r3`` (replay the engine's routes), ``r2`` (replay the trainer's own old-policy
            routes) or ``off`` (native routing; routes still measure the mismatch).
        request_routes: ask the engine for routes.
        strict: missing routes raise instead of routing natively; None: strict in r3 mode with an
            external engine (``rollout.url``).
        soft_threshold: soft replay: keep a replayed expert only where the trainer's router gives it
            at least this probability (hf backend); None: plain replay.
    """

    mode: str = "r3"
    request_routes: bool = True
    strict: bool | None = None
    soft_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in REPLAY_MODES:
            raise ValueError(f"mode must be one of {list(REPLAY_MODES)}, got {self.mode!r}")
        _check_bool("request_routes", self.request_routes)
        _check_bool("strict", self.strict, optional=True)
        object.__setattr__(self, "soft_threshold", check_soft_threshold(self.soft_threshold))


def _urls(url: Any) -> list[str] | None:
    if url is None:
        return None
    urls = list(url) if isinstance(url, list | tuple) else [url]
    if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
        raise ValueError(
            f"url must be null (embedded engine), http(s)://host:port or a list of them, got {url!r}"
        )
    return urls


@dataclass(frozen=True)
class RolloutSettings:
    """The engine the job talks to (the ``rollout`` group's own keys).

    Args:
        url: None for the embedded engine, else one engine's ``http(s)://host:port`` or a list.
        require_url: refuse to fall back to the embedded engine when ``url`` is None.
        protocol: ``skyrl`` or ``sglang`` (embedded or external); ``vllm`` or ``openai`` (external).
        api_key: sent as ``Authorization: Bearer``; the embedded engine requires it when set.
        missing_rows: route rows an engine lost: ``error``, ``native`` (those tokens route natively,
            counted) or ``drop_trajectory`` (as native, with loss mask 0); ``RouteSchema``'s.
        env_timeout_s: a hanging environment method drops its group after this long; None: unbounded.
    """

    url: Any = None  # str | list[str] | None
    require_url: bool = False
    protocol: str = "skyrl"
    api_key: str | None = None
    missing_rows: str = "error"
    env_timeout_s: float | None = 300.0

    def __post_init__(self) -> None:
        check_setting("env_timeout_s", self.env_timeout_s, low=0, above=True, optional=True)
        if self.missing_rows not in MISSING_ROWS:
            raise ValueError(f"missing_rows must be one of {list(MISSING_ROWS)}, got {self.missing_rows!r}")
        if self.protocol not in PROTOCOL_PATHS:
            raise ValueError(f"protocol must be one of {list(PROTOCOL_PATHS)}, got {self.protocol!r}")
        _urls(self.url)
        _check_bool("require_url", self.require_url)

    def check_engine(self, launched: bool) -> None:
        """Check the settings that depend on which engine serves.

        The embedded engine serves when ``url`` is None and no engine is ``launched``: it speaks
        only ``EMBEDDED_PROTOCOLS``, and ``require_url`` refuses it. Nothing is checked when another
        engine serves. Imports nothing.

        Args:
            launched: whether the job starts a vLLM engine itself (``rollout.launch`` is set).

        Raises:
            ValueError: naming the key, as ``__post_init__`` does (without the ``rollout.`` prefix).
        """
        if self.url is not None or launched:
            return
        if self.protocol not in EMBEDDED_PROTOCOLS:
            raise ValueError(
                f"protocol={self.protocol} needs rollout.url (the engine's http://host:port); "
                f"the embedded engine speaks {list(EMBEDDED_PROTOCOLS)}"
            )
        if self.require_url:
            raise ValueError("url must be set to the engine's http://host:port (rollout.require_url=true)")


@dataclass(frozen=True)
class WeightSyncSettings:
    """How the trainer's weights reach the engine (the ``rollout`` group's ``*weight*`` keys).

    Args:
        sync_weights: push the trainer's weights to the engine after every step (on-policy).
        weight_sync_dir: sglang, vllm: a directory the engine reads pushed weights from.
        weight_sync_dtype: vllm: the engine's ``--dtype``, in which the checkpoint it reloads is written.
    """

    sync_weights: bool = True
    weight_sync_dir: str | None = None
    weight_sync_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _check_bool("sync_weights", self.sync_weights)
        if self.weight_sync_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"weight_sync_dtype must be one of {list(FLOAT_DTYPES)}, got {self.weight_sync_dtype!r}"
            )


@dataclass(frozen=True)
class ServerAddress:
    """Where the embedded server listens (``rollout.server.host`` / ``.port``).

    Args:
        host: the address to bind, a non-empty host name or IP address.
        port: the port, 0 to 65535; 0 picks a free port.
    """

    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a host name or address, got {self.host!r}")
        check_setting("port", self.port, low=0, high=65535, integer=True)


@dataclass(frozen=True)
class OptimConfig:
    """The GRPO module's AdamW (``algorithm.optim``).

    Args:
        lr: learning rate.
        weight_decay: AdamW's decoupled weight decay.
        betas: AdamW's two moment decays, each in ``[0, 1)``.
        grad_clip: the gradient norm the Trainer clips to (``gradient_clip_val``); None: no clip.
    """

    lr: float = 1e-2
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        check_setting("lr", self.lr, low=0)
        check_setting("weight_decay", self.weight_decay, low=0)
        betas = tuple(self.betas) if isinstance(self.betas, list | tuple) else ()
        ok = len(betas) == 2 and all(isinstance(b, int | float) and 0 <= b < 1 for b in betas)
        if not ok:
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        check_setting("grad_clip", self.grad_clip, low=0, above=True, optional=True)


@dataclass(kw_only=True)  # keywords only, so the required batch_size may follow _target_
class DataModuleSettings:
    """The ``data`` node: ``R3DataModule``'s keywords but ``buffer`` (the job builds it); a test
    keeps these fields and defaults equal to its signature's (``options``: ``DataOptions``).

    Only its structured config is used (`r3lightning.app.job.schema.structured`), where the
    required ``batch_size`` becomes Hydra's mandatory value ``???``.
    """

    _target_: str = "r3lightning.data.datamodule.R3DataModule"
    batch_size: int  # required, as in the signature
    shuffle: bool = True
    seed: int = 0
    collate_threads: int | None = None
    pin_memory: bool | None = None
    drop_last: bool = False
