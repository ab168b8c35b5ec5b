"""Checks the job's config (:func:`check_config`), then trains one run from it (:func:`train_one`)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from r3lightning.app.job import build
from r3lightning.app.job.build import (
    BOOL,
    Rule,
    build_model,
    dataclass_from,
    instantiate_node,
    plain,
    require,
)
from r3lightning.app.job.common import JobError, is_global_zero
from r3lightning.app.job.grpo import GRPOConfig
from r3lightning.app.job.models import torch_dtype
from r3lightning.app.job.rollout_settings import ahead_config, check_rollout, launched
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.stream import StreamingReplayBuffer
from r3lightning.rollout.prompts import SamplingConfig
from r3lightning.wire.request import RouteSchema

if TYPE_CHECKING:
    from r3lightning.app.job.rollout_loop import Engine

__all__ = ["CONF_DIR", "JobError", "build_model", "check_config", "is_global_zero", "train_one"]

# A wheel carries the configs inside the package (setup.py copies them at build time); a source
# checkout or an editable install reads the repository's top-level conf/.
_PACKAGED_CONF = Path(__file__).resolve().parents[2] / "conf"
CONF_DIR = _PACKAGED_CONF if _PACKAGED_CONF.is_dir() else Path(__file__).resolve().parents[3] / "conf"
_EMBEDDED_PROTOCOLS = ("skyrl", "sglang")  # what the embedded engine speaks
_JOB_TRAINER_KEYS = {  # Trainer keywords the job sets itself, and what to use instead
    "max_epochs": "steps (one epoch is one RL step)",
    "reload_dataloaders_every_n_epochs": "nothing: every RL step reloads the data (it is 1)",
    "callbacks": "callbacks.<name>._target_ entries",
}
# ${product:a,b} in conf/config.yaml (e.g. the batch size of one whole RL step)
OmegaConf.register_new_resolver("product", lambda a, b: int(a) * int(b), replace=True)


def integer(low: int, high: int | None = None) -> Rule:
    text = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    return text, lambda v: type(v) is int and low <= v <= (v if high is None else high)


def number(low: float, *, above: bool = True) -> Rule:
    def ok(v: Any) -> bool:
        return type(v) in (int, float) and math.isfinite(v) and (v > low if above else v >= low)

    return f"a number {'>' if above else '>='} {low:g}", ok


def or_null(rule: Rule) -> Rule:
    return f"{rule[0]} or null", lambda v: v is None or rule[1](v)


def one_of(*options: Any) -> Rule:
    return f"one of {list(options)}", lambda v: v in options


def _urls_ok(value: Any) -> bool:
    urls = value if isinstance(value, list) else [value]
    return value is None or (urls != [] and all(str(u).startswith(("http://", "https://")) for u in urls))


_DTYPE: Rule = (
    "a floating torch dtype name (float32, bfloat16, float16)",
    lambda v: torch_dtype(v).is_floating_point,
)
_URLS: Rule = ("null (embedded engine), http(s)://host:port or a list of them", _urls_ok)
# algorithm keys GRPOConfig does not hold: optim (OptimConfig) and std_eps (the collector's GRPOAdvantages)
OUTSIDE_GRPO_CONFIG = ("optim", "std_eps")
# Every value the job reads itself, checked (where present) before anything is built; the settings
# groups are checked by their dataclasses, the data module's keys by building it once.
RULES: dict[str, Rule] = {
    "seed": integer(0, 2**32 - 1),  # Lightning's seed_everything range
    "steps": integer(1),
    "seeds": integer(1),
    "prompts_per_step": integer(1),
    "reward_threads": integer(0),
    "resume": BOOL,
    "plot": BOOL,
    "loggers": ("a list of {_target_: ...} entries (or null)", lambda v: v is None or isinstance(v, list)),
    "reward.timeout_s": or_null(number(0)),
    "task.vocab_size": or_null(integer(1)),
    "task.num_classes": integer(2),
    "task.prompt_length": integer(1),
    "task.response_length": integer(1),
    "task.first_token": integer(0),
    "task.max_prompt_length": integer(1),
    "task.overlong": one_of("drop", "truncate_left", "truncate_right"),
    "task.shuffle": BOOL,
    "model.dtype": _DTYPE,
    "replay.mode": one_of("r3", "r2", "off"),
    "replay.strict": or_null(BOOL),
    "replay.soft_threshold": or_null(number(0, above=False)),
    "rollout.protocol": one_of("skyrl", "vllm", "sglang", "openai"),
    "rollout.url": _URLS,
    "rollout.require_url": BOOL,
    "algorithm.std_eps": number(0),
    "rollout.missing_rows": one_of("error", "native", "drop_trajectory"),
    "rollout.sync_weights": BOOL,
    "rollout.server.port": integer(0, 65535),
    "algorithm.group_size": integer(2),
    "algorithm.clip_low": number(0),
    "algorithm.clip_high": number(0),
    "algorithm.ratio_band": number(1, above=False),
    "algorithm.mismatch_every_n_steps": integer(0),
    "algorithm.optim.lr": number(0),
    "algorithm.optim.weight_decay": number(0, above=False),
    "algorithm.optim.betas": ("two numbers in [0, 1)", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v)),
    "algorithm.optim.grad_clip": or_null(number(0)),
}
_ABSENT = object()


def _megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no parent package, or one set to None in sys.modules
        return False


def check_config(cfg: DictConfig) -> None:
    """Reject bad values before anything is built: one :class:`JobError` naming the key and what it
    expects. Cost: imports the ``_target_`` modules and builds the data module once."""
    from r3lightning.app.job.module import OptimConfig  # lightning: not imported for --help

    for key, rule in RULES.items():
        if (value := OmegaConf.select(cfg, key, default=_ABSENT)) is not _ABSENT:
            require(key, plain(value), rule)
    try:  # the first ``???`` (mandatory, unset) key
        OmegaConf.to_container(
            OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), throw_on_missing=True
        )
    except MissingMandatoryValue as exc:
        raise JobError(f"{exc.full_key} must be set (add {exc.full_key}=... to the command line)") from None
    for key in _JOB_TRAINER_KEYS:
        if key in cfg.trainer:
            raise JobError(f"trainer.{key} is set by the job; use {_JOB_TRAINER_KEYS[key]}")
    dataclass_from(GRPOConfig, cfg.algorithm, "algorithm", skip=OUTSIDE_GRPO_CONFIG)
    dataclass_from(OptimConfig, cfg.algorithm.optim, "algorithm.optim")
    dataclass_from(SamplingConfig, cfg.rollout.sampling, "rollout.sampling")
    local = cfg.rollout.url is None and not launched(cfg.rollout)  # the embedded engine serves
    if local and cfg.rollout.protocol not in _EMBEDDED_PROTOCOLS:
        raise JobError(
            f"rollout.protocol={cfg.rollout.protocol} needs rollout.url (the engine's http://host:port); "
            f"the embedded engine speaks {list(_EMBEDDED_PROTOCOLS)}"
        )
    if local and cfg.rollout.require_url:
        raise JobError("rollout.url must be set to the engine's http://host:port (rollout.require_url=true)")
    path = OmegaConf.select(cfg, "task.path")
    if path is not None and not Path(str(path)).expanduser().is_file():
        raise JobError(f"task.path: no such file: {path}")
    check_rollout(cfg)  # rollout.retry / collector / server / limits (after algorithm.*: interpolated)
    gpu = torch.cuda.is_available() or torch.backends.mps.is_available()
    if cfg.trainer.get("accelerator") == "gpu" and not gpu:  # else found only when the Trainer is built
        raise JobError(
            f"trainer.accelerator=gpu but no GPU is visible here; use trainer=cpu, or trainer=cpu_fsdp "
            f"for FSDP2 on CPU processes (got trainer.devices={cfg.trainer.get('devices')!r})"
        )
    targets = [(f"callbacks.{name}", node) for name, node in cfg.callbacks.items() if node is not None]
    targets += [(key, cfg[key]) for key in ("model", "task", "reward", "module", "data")]
    for key, node in targets + [(f"loggers[{i}]", node) for i, node in enumerate(cfg.loggers or [])]:
        build.target_of(node, key)
    replay = build.replay_callback_settings(cfg)
    if replay is not None and replay[1].get("backend") == "megatron" and not _megatron_installed():
        raise JobError(
            f"callbacks.{replay[0]}.backend=megatron needs megatron-core, which is not installed: {build.MEGATRON_HINT}"
        )
    build.build_callbacks(cfg, None, str(cfg.replay.mode))  # their own checks (the backend is built later)
    instantiate_node(cfg.data, "data", buffer=ReplayBuffer())  # the data module's own checks


def replay_settings(cfg: DictConfig, mode: str) -> DictConfig:
    """``cfg`` with the ``replay`` group swapped for ``conf/replay/<mode>.yaml``."""
    replay = OmegaConf.load(CONF_DIR / "replay" / f"{mode}.yaml")
    return OmegaConf.merge(cfg, {"replay": replay})  # type: ignore[return-value]


@contextlib.contextmanager
def model_runtime(model_cfg: DictConfig) -> Iterator[None]:
    """``model.runtime`` (a context manager, e.g. megatron-core's process group) around the run."""
    node = model_cfg.get("runtime")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(
                contextlib.nullcontext() if node is None else instantiate_node(node, "model.runtime")
            )
        except ModuleNotFoundError as exc:
            raise JobError(f"model.runtime: {build.import_problem(exc)}") from None
        yield


_EXPECTED_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\).*",  # Lightning's own deprecated pytree call
    r"Checkpoint directory .* exists and is not empty",  # resuming into the same folder
    r".*overridden `on_after_batch_transfer`.*",  # the GRPO module's paired mismatch (intended)
)


def train_one(cfg: DictConfig, out_dir: Path, engine: Engine) -> list[dict[str, float]]:
    """Train one run (one arm, one seed) into ``out_dir``; returns its per-step history."""
    import lightning.pytorch as pl

    from r3lightning.app.job.checkpoint import RunCheckpoint, refuse_bad_data_state, resume_checkpoint
    from r3lightning.app.job.module import OptimConfig
    from r3lightning.app.job.rollout_loop import rollout_failure, rollout_loop
    from r3lightning.rollout.stats import GroupsDroppedError

    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    model = build_model(cfg.model, trainer=True)
    mode = str(cfg.replay.mode)
    backend = build.replay_backend(cfg, model)
    missing = str(cfg.rollout.get("missing_rows", "error"))
    schema = RouteSchema(backend.num_layers, backend.top_k, backend.num_experts, missing_rows=missing)
    vocab_size = cfg.task.get("vocab_size") or getattr(getattr(model, "config", None), "vocab_size", None)
    task = build.build_task(cfg, vocab_size)
    grpo = dataclass_from(GRPOConfig, cfg.algorithm, "algorithm", skip=OUTSIDE_GRPO_CONFIG)
    optim = dataclass_from(OptimConfig, cfg.algorithm.optim, "algorithm.optim")
    ahead = ahead_config(cfg.rollout)
    buffer = StreamingReplayBuffer(ahead.ahead, vocab_size=vocab_size, num_experts=schema.num_experts)
    datamodule = instantiate_node(cfg.data, "data", buffer=buffer)
    extra = {"model": model, "grpo": grpo, "optim": optim, "recompute_old_logprobs": mode == "r2"}
    if cfg.model.get("sharded_weights") is not None:  # a meta-device model: the module loads its shards
        extra["sharded_weights"] = str(cfg.model.sharded_weights)
    module = instantiate_node(cfg.module, "module", **extra)
    if not isinstance(module, pl.LightningModule):
        raise JobError(f"module._target_ must build a LightningModule, got {type(module).__name__}")
    out_dir.mkdir(parents=True, exist_ok=True)
    loop = rollout_loop(cfg, engine, task, schema, buffer, metrics_path=out_dir / "metrics.csv")
    callbacks = [*build.build_callbacks(cfg, backend, mode), loop, RunCheckpoint(out_dir, cfg)]
    trainer = build.build_trainer(cfg, out_dir, callbacks, optim.grad_clip)
    ckpt_path = resume_checkpoint(cfg, out_dir, module)
    if ckpt_path is not None:
        refuse_bad_data_state(datamodule, ckpt_path)
    if ckpt_path is not None and is_global_zero():
        print(f"resuming {out_dir.name} from {ckpt_path}")
    with warnings.catch_warnings():
        for message in _EXPECTED_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        if trainer.world_size == 1:  # a process group of one (megatron's runtime) has nothing to sync
            warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\(.*sync_dist=True")
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        except GroupsDroppedError as exc:  # raised by the rollout worker, at the trainer's next step
            raise rollout_failure(exc) from None
        except SystemExit:  # Lightning turns Ctrl-C into a graceful shutdown and exit status 1
            if trainer.interrupted:
                raise KeyboardInterrupt from None
            raise
    if trainer.interrupted:
        raise KeyboardInterrupt
    return loop.history
