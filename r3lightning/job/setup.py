"""Builds the main job's pieces from its Hydra config and runs one training run.

Kept apart from ``main.py`` so that tests and notebooks can build a run from a composed config
(``compose_config``) without going through Hydra's command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
log = logging.getLogger("r3lightning.job")


class JobError(Exception):
    """A problem the user can fix (configuration, engine address); reported as one line."""


def is_global_zero() -> bool:
    """Rank 0 of a (possibly not yet launched) multi-process run, from the launcher's env vars."""
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    return rank == 0 and int(os.environ.get("NODE_RANK", "0")) == 0


_MODES = ("r3", "r2", "off")

# ${product:a,b} in conf/config.yaml (e.g. the batch size of one whole RL step)
OmegaConf.register_new_resolver("product", lambda a, b: int(a) * int(b), replace=True)
_PROTOCOLS = ("skyrl", "sglang")


# ---------------------------------------------------------------------------- validation


def _positive_int(cfg: DictConfig, key: str, *, minimum: int = 1) -> None:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise JobError(f"{key} must be an integer >= {minimum}, got {value!r}")


def check_config(cfg: DictConfig) -> None:
    """Reject bad values before anything is built; messages name the key and what it expects."""
    _positive_int(cfg, "steps")
    _positive_int(cfg, "prompts_per_step")
    _positive_int(cfg, "algorithm.group_size", minimum=2)
    _positive_int(cfg, "task.response_length")
    _positive_int(cfg, "task.prompt_length")
    if str(cfg.replay.mode) not in _MODES:
        raise JobError(f"replay.mode must be one of {list(_MODES)}, got {cfg.replay.mode!r}")
    for mode in cfg.compare:
        if str(mode) not in _MODES:
            raise JobError(f"compare entries must be replay modes {list(_MODES)}, got {mode!r}")
    if cfg.rollout.protocol not in _PROTOCOLS:
        raise JobError(f"rollout.protocol must be one of {list(_PROTOCOLS)}, got {cfg.rollout.protocol!r}")
    url = cfg.rollout.url
    if url is None and cfg.rollout.get("require_url", False):
        raise JobError("rollout.url must be set to the engine's http://host:port (rollout.require_url=true)")
    if url is not None and not str(url).startswith(("http://", "https://")):
        raise JobError(f"rollout.url must be null (embedded engine) or http(s)://host:port, got {url!r}")
    lr = cfg.algorithm.optim.lr
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise JobError(f"algorithm.optim.lr must be a number > 0, got {lr!r}")
    if cfg.model.path is None and cfg.model.family is None:
        raise JobError("model.path (a Hugging Face checkpoint) or model.family (a tiny model) must be set")


def replay_settings(cfg: DictConfig, mode: str) -> DictConfig:
    """``cfg`` with the ``replay`` group swapped for ``conf/replay/<mode>.yaml``."""
    path = CONF_DIR / "replay" / f"{mode}.yaml"
    if not path.exists():
        raise JobError(f"no replay config for mode {mode!r} ({path})")
    out = OmegaConf.merge(cfg, {"replay": OmegaConf.load(path)})
    assert isinstance(out, DictConfig)
    return out


# ---------------------------------------------------------------------------- model


def build_model(model_cfg: DictConfig) -> torch.nn.Module:
    """The policy in fp32: the tiny MoE (``family`` + ``overrides``) or a checkpoint (``path``)."""
    if model_cfg.path is not None:
        from transformers import AutoModelForCausalLM

        path = Path(str(model_cfg.path)).expanduser()
        if not path.exists():
            raise JobError(f"model.path does not exist: {path}")
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    from ..models.tiny import TINY_FAMILIES, build_tiny_moe, tiny_family_config

    if model_cfg.family not in TINY_FAMILIES:
        raise JobError(f"model.family must be one of {list(TINY_FAMILIES)}, got {model_cfg.family!r}")
    overrides = OmegaConf.to_container(model_cfg.overrides, resolve=True) or {}
    try:
        config = tiny_family_config(str(model_cfg.family), **overrides)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise JobError(f"model.overrides: {exc}") from None
    return build_tiny_moe(config, seed=int(model_cfg.seed))


# ---------------------------------------------------------------------------- engine


@dataclass
class Engine:
    """Where rollouts come from: ``url`` (None on ranks that never collect) and how to push weights."""

    url: str | None
    push: Any = None  # callable(state_dict) or None


def _http_push(url: str, api_key: str | None, timeout_s: float):
    """Weight sync for an external ``r3lightning-serve`` engine: ``POST /update_weights`` (safetensors)."""
    import aiohttp
    from safetensors.torch import save

    async def post(body: bytes) -> None:
        headers = {"Content-Type": "application/octet-stream"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(f"{url}/update_weights", data=body, headers=headers) as response,
        ):
            if response.status == 404:
                raise JobError(
                    f"the engine at {url} has no /update_weights endpoint; set rollout.sync_weights=false "
                    "and sync weights through the deployment"
                )
            if response.status != 200:
                raise JobError(
                    f"weight update at {url} failed: HTTP {response.status}: {(await response.text())[:200]}"
                )

    def push(state_dict: Mapping[str, Tensor]) -> None:
        tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in state_dict.items()}
        asyncio.run(post(save(tensors)))

    return push


def _sglang_disk_push(
    url: str, api_key: str | None, timeout_s: float, directory: Path, model_path: str | None
):
    """Weight sync for SGLang: save a safetensors checkpoint into ``directory`` (shared with the
    engine) and ask the engine to load it with ``POST /update_weights_from_disk``."""
    import shutil

    import aiohttp
    from safetensors.torch import save_file

    async def post() -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(
                f"{url}/update_weights_from_disk", json={"model_path": str(directory)}, headers=headers
            ) as response,
        ):
            body = await response.json(content_type=None)
            if response.status != 200 or not (isinstance(body, dict) and body.get("success", False)):
                raise JobError(
                    f"update_weights_from_disk at {url} failed: HTTP {response.status}: {str(body)[:200]}"
                )

    def push(state_dict: Mapping[str, Tensor]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in state_dict.items()}
        save_file(tensors, str(directory / "model.safetensors"))
        if model_path is not None and (Path(model_path) / "config.json").exists():
            shutil.copy(Path(model_path) / "config.json", directory / "config.json")
        asyncio.run(post())

    return push


@contextlib.contextmanager
def embedded_server(cfg: DictConfig) -> Iterator[Engine]:
    """The embedded ``RolloutServer`` (rank 0 only) unless ``rollout.url`` names an external engine."""
    rollout = cfg.rollout
    if rollout.url is not None:
        url = str(rollout.url).rstrip("/")
        push = None
        if rollout.sync_weights and is_global_zero():
            timeout = float(rollout.request_timeout_s)
            if rollout.protocol == "skyrl":
                push = _http_push(url, rollout.api_key, timeout)
            elif rollout.get("weight_sync_dir"):
                directory = Path(str(rollout.weight_sync_dir))
                push = _sglang_disk_push(url, rollout.api_key, timeout, directory, cfg.model.path)
            else:
                warnings.warn(
                    "rollout.weight_sync_dir is not set: the SGLang engine keeps its weights, so rollouts "
                    "drift off-policy; set it to a directory the engine can read",
                    stacklevel=2,
                )
        yield Engine(url, push)
        return
    if not is_global_zero():
        yield Engine(None, None)
        return
    from ..rollout.server import RolloutServer

    server_cfg = rollout.server
    dtype = getattr(torch, str(server_cfg.dtype), None)
    if not isinstance(dtype, torch.dtype):
        raise JobError(
            f"rollout.server.dtype must be a torch dtype name (bfloat16, float32), got {server_cfg.dtype!r}"
        )
    model = build_model(cfg.model)
    server = RolloutServer(
        model,
        host=str(server_cfg.host),
        port=int(server_cfg.port),
        api_key=rollout.api_key,
        dtype=dtype,
        device=server_cfg.device,
        max_batch_size=int(server_cfg.max_batch_size),
        seed=int(cfg.seed),
        copy_model=False,
    )
    try:
        server.__enter__()  # serves from a daemon thread until __exit__
    except OSError as exc:
        raise JobError(
            f"cannot start the embedded rollout server on {server_cfg.host}:{server_cfg.port}: {exc}"
        ) from None
    try:
        yield Engine(server.url, server.update_weights)
    finally:
        server.__exit__(None, None, None)


# ---------------------------------------------------------------------------- one run


def _trainer_kwargs(trainer_cfg: DictConfig) -> dict[str, Any]:
    from hydra.utils import instantiate

    kwargs = OmegaConf.to_container(trainer_cfg, resolve=True)
    assert isinstance(kwargs, dict)
    strategy = kwargs.get("strategy")
    if isinstance(strategy, dict) and "_target_" in strategy:
        kwargs["strategy"] = instantiate(strategy)
    return kwargs


def train_one(cfg: DictConfig, out_dir: Path, engine: Engine) -> list[dict[str, float]]:
    """Train one run (one replay mode) into ``out_dir``; returns its per-step history."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from ..data.buffer import ReplayBuffer
    from ..data.datamodule import R3DataModule
    from ..replay.callback import RouterReplayCallback
    from ..replay.hf import HFRouterReplay
    from .grpo import GRPOConfig
    from .module import GRPOModule, OptimConfig
    from .rollout_loop import ClientConfig, OnPolicyLoop, RolloutCollector, RouteSchema, SamplingConfig
    from .task import TokenClassTask, TokenClassTaskConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    model = build_model(cfg.model)
    mode = str(cfg.replay.mode)
    backend = HFRouterReplay.for_model(model)
    schema = RouteSchema(backend.num_layers, backend.top_k, backend.num_experts)
    vocab_size = int(cfg.task.vocab_size or model.config.vocab_size)
    task_kwargs = OmegaConf.to_container(cfg.task, resolve=True)
    assert isinstance(task_kwargs, dict)
    task_kwargs["vocab_size"] = vocab_size
    try:
        task = TokenClassTask(TokenClassTaskConfig(**task_kwargs))
    except (TypeError, ValueError) as exc:
        raise JobError(str(exc)) from None

    algo = cfg.algorithm
    grpo = GRPOConfig(
        group_size=int(algo.group_size),
        clip_low=float(algo.clip_low),
        clip_high=float(algo.clip_high),
        normalize_std=bool(algo.normalize_std),
        std_eps=float(algo.std_eps),
        ratio_band=float(algo.ratio_band),
    )
    optim = OptimConfig(
        lr=float(algo.optim.lr),
        weight_decay=float(algo.optim.weight_decay),
        betas=tuple(algo.optim.betas),  # type: ignore[arg-type]
        grad_clip=algo.optim.grad_clip,
    )
    rollout = cfg.rollout
    collector = RolloutCollector(
        ClientConfig(
            url=engine.url or "http://unused.invalid",
            protocol=str(rollout.protocol),
            api_key=rollout.api_key,
            request_timeout_s=float(rollout.request_timeout_s),
            max_in_flight=int(rollout.max_in_flight),
        ),
        task,
        group_size=grpo.group_size,
        sampling=SamplingConfig(**OmegaConf.to_container(rollout.sampling, resolve=True)),  # type: ignore[arg-type]
        schema=schema,
        request_routes=bool(cfg.replay.request_routes),
        normalize_std=grpo.normalize_std,
        seed=int(cfg.seed),
    )
    if engine.url is not None and not collector.check_engine():
        raise JobError(
            f"cannot reach the rollout engine at {engine.url} (GET /health failed within "
            f"{float(rollout.request_timeout_s):g}s); check rollout.url or start the engine"
        )

    buffer = ReplayBuffer(vocab_size=vocab_size, num_experts=schema.num_experts)
    data_kwargs = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k != "_target_"}  # type: ignore[union-attr]
    try:
        datamodule = R3DataModule(buffer, **data_kwargs)
    except (TypeError, ValueError) as exc:
        raise JobError(f"data: {exc}") from None

    # conf/callbacks: either {router_replay: {...}} or the callback's own keys at the top level
    callbacks_cfg = cfg.callbacks if "_target_" in cfg.callbacks else cfg.callbacks.get("router_replay", {})
    callback_kwargs = dict(OmegaConf.to_container(callbacks_cfg, resolve=True) or {})  # type: ignore[arg-type]
    for key in ("_target_", "backend", "mode"):  # the backend is built here, the mode is replay.mode
        callback_kwargs.pop(key, None)
    if mode == "off":
        # the module measures the agreement itself by recording the training forward
        callback_kwargs["log_agreement"] = False
    try:
        replay_callback = RouterReplayCallback(backend=backend, mode=mode, **callback_kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise JobError(f"callbacks.router_replay: {exc}") from None
    loop = OnPolicyLoop(
        collector,
        buffer,
        prompts_per_step=int(cfg.prompts_per_step),
        sync_weights=engine.push if rollout.sync_weights else None,
        gather_weights=bool(rollout.sync_weights),
        metrics_path=out_dir / "metrics.csv",
        progress=bool(cfg.trainer.get("enable_progress_bar", True)),
    )
    module = GRPOModule(model, grpo, optim, recompute_old_logprobs=mode == "r2")
    checkpoint = ModelCheckpoint(
        dirpath=out_dir / "checkpoints",
        filename="last",
        save_top_k=1,
        every_n_epochs=1,
        enable_version_counter=False,
    )
    trainer = pl.Trainer(
        **_trainer_kwargs(cfg.trainer),
        max_epochs=int(cfg.steps),
        reload_dataloaders_every_n_epochs=1,
        gradient_clip_val=optim.grad_clip,
        callbacks=[replay_callback, loop, checkpoint],
        logger=CSVLogger(str(out_dir), name="lightning_logs"),
        default_root_dir=str(out_dir),
        num_sanity_val_steps=0,
        enable_model_summary=False,
    )
    last = out_dir / "checkpoints" / "last.ckpt"
    ckpt_path = str(last) if cfg.resume and last.exists() else None
    if ckpt_path is not None and is_global_zero():
        print(f"resuming {out_dir.name} from {last}")
    with warnings.catch_warnings():
        # Lightning's own deprecated pytree call, and the expected note when resuming into
        # the same checkpoint directory
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return loop.history
