"""How a local vLLM engine is started: [`VllmSettings`][r3lightning.app.vllm.settings.VllmSettings], the command line and the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from r3lightning.checks import check_setting

__all__ = [
    "ENGINE_PYTHON_ENV",
    "ENGINE_SIDE_DIR",
    "WORKER_EXTENSION",
    "ProcessOptions",
    "ServeOptions",
    "VllmSettings",
    "engine_command",
    "engine_environment",
    "engine_python",
]

# The engine's Python, when not given: this variable, else .venv-vllm (``make vllm``) in the
# current directory or in the checkout r3lightning is imported from.
ENGINE_PYTHON_ENV = "R3_VLLM_PYTHON"
_DTYPES = ("float32", "bfloat16", "float16", "auto")
# The worker extension the weight sync calls (``r3_reload_weights``), from a folder of standalone
# modules that goes on the engine's PYTHONPATH.
WORKER_EXTENSION = "r3lightning_worker.WeightReload"
ENGINE_SIDE_DIR = Path(__file__).resolve().with_name("engine_side")


@dataclass(frozen=True)
class ServeOptions:
    """What ``vllm serve`` is told besides the model, its dtype and the routes switch.

    Args:
        dev_mode: ``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/reset_prefix_cache``,
            ``/pause``, ``/resume`` and ``/update_weight_version`` (what weight sync uses), and the
            worker extension whose ``r3_reload_weights`` the sync calls (``weight_sync.py``);
            these endpoints are unauthenticated, so keep the engine on loopback with it on.
        eager: ``--enforce-eager``: no graph compilation (a CPU start in about half the time);
            False on a GPU keeps CUDA graphs.
        max_model_len: ``--max-model-len`` (prompt plus response tokens).
        seed: ``--seed`` (sampling of requests without their own seed).
        extra_args: more ``vllm serve`` arguments, appended as given (e.g. ``--tensor-parallel-size 2``).
    """

    dev_mode: bool = True
    eager: bool = True
    max_model_len: int = 256
    seed: int = 0
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        check_setting("max_model_len", self.max_model_len, low=1, integer=True)
        check_setting("seed", self.seed, low=0, integer=True)
        if isinstance(self.extra_args, str | bytes) or not isinstance(self.extra_args, list | tuple):
            # a lone string would be split into characters, one argument each
            raise TypeError(f"extra_args must be a list of strings, got {self.extra_args!r}")
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))


@dataclass(frozen=True)
class ProcessOptions:
    """The engine process: its share of the host and how long the launcher waits for it.

    Args:
        threads: OpenMP threads of the CPU engine (unbound), so it shares the host's cores.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``, the CPU engine's KV cache in GiB.
        health_timeout_s: how long to wait for ``/health`` after the start (57-83 s on 2 busy cores).
        health_interval_s: seconds between health probes while waiting.
        stop_timeout_s: seconds between ``SIGTERM`` and ``SIGKILL`` when stopping.
    """

    threads: int = 1
    kv_cache_gib: int = 1
    health_timeout_s: float = 600.0
    health_interval_s: float = 0.5
    stop_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        for name in ("threads", "kv_cache_gib"):
            check_setting(name, getattr(self, name), low=1, integer=True)
        for name in ("health_timeout_s", "health_interval_s", "stop_timeout_s"):
            check_setting(name, getattr(self, name), low=0, above=True)


@dataclass(frozen=True)
class VllmSettings:
    """Settings of a ``vllm serve`` started by [`VllmServer`][r3lightning.app.vllm.launcher.VllmServer].

    Args:
        model: the model directory (``config.json`` and safetensors weights).
        dtype: ``--dtype`` of the engine (``float32`` for exact routes against an fp32 trainer).
        python: the engine's Python (default: ``$R3_VLLM_PYTHON``, else ``.venv-vllm/bin/python``).
        host: the address the engine binds (loopback by default).
        port: the port on ``host``; 0 picks a free one.
        routed_experts: pass ``--enable-return-routed-experts`` (routes are a server-wide switch).
        serve: the other ``vllm serve`` options (`ServeOptions`).
        process: threads, KV cache and timeouts of the engine process (`ProcessOptions`).
    """

    model: str
    dtype: str = "float32"
    python: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    routed_experts: bool = True
    serve: ServeOptions = field(default_factory=ServeOptions)
    process: ProcessOptions = field(default_factory=ProcessOptions)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        check_setting("port", self.port, low=0, high=65535, integer=True)
        for name, kind in (("serve", ServeOptions), ("process", ProcessOptions)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")


def engine_python(python: str | None = None) -> Path:
    """The Python that runs the engine.

    Args:
        python: an explicit interpreter (wins over everything).

    Returns:
        ``python``, else ``$R3_VLLM_PYTHON``, else the first ``.venv-vllm/bin/python`` that exists
        in the current directory or the checkout this package is imported from.

    Raises:
        FileNotFoundError: none exists; the message says to run ``make vllm``.
    """
    explicit = python or os.environ.get(ENGINE_PYTHON_ENV)
    if explicit:
        if not Path(explicit).exists():
            raise FileNotFoundError(
                f"the vLLM Python {explicit} does not exist; run `make vllm` or fix the path"
            )
        return Path(explicit)
    checkout = Path(__file__).resolve().parents[3]
    candidates = [Path.cwd() / ".venv-vllm/bin/python", checkout / ".venv-vllm/bin/python"]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"no vLLM environment: {candidates[-1]} does not exist; run `make vllm`, or set "
        f"{ENGINE_PYTHON_ENV} to the Python of an environment with vLLM installed"
    )


def engine_command(settings: VllmSettings, shim: Path, port: int) -> list[str]:
    """``<python> cli_shim.py serve MODEL ...`` with the token-in endpoint and the routes.

    Args:
        settings: the engine's settings.
        shim: the path of ``cli_shim.py``.
        port: the port to bind.

    Returns:
        The argument vector.
    """
    command = [str(engine_python(settings.python)), str(shim), "serve", settings.model]
    command += ["--host", settings.host, "--port", str(port), "--dtype", settings.dtype]
    serve = settings.serve
    command += ["--max-model-len", str(serve.max_model_len), "--seed", str(serve.seed)]
    command.append("--enable-scale-out")  # POST /inference/v1/generate next to /v1/completions
    if settings.routed_experts:
        command.append("--enable-return-routed-experts")
    if serve.eager:
        command.append("--enforce-eager")
    if serve.dev_mode:  # the weight sync's reload (engine_side/ is on the engine's PYTHONPATH)
        command += ["--worker-extension-cls", WORKER_EXTENSION]
    return command + list(serve.extra_args)


def engine_environment(settings: VllmSettings) -> dict[str, str]:
    """This process's environment, with what the engine needs set and this Python's paths removed.

    Args:
        settings: the engine's settings.

    Returns:
        The environment of the engine process.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": str(settings.process.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env |= {"VLLM_CPU_KVCACHE_SPACE": str(settings.process.kv_cache_gib), "VLLM_NO_USAGE_STATS": "1"}
    env |= {"DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    if settings.serve.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env["PYTHONPATH"] = str(ENGINE_SIDE_DIR)  # standalone modules only: nothing of r3lightning's
    return env
