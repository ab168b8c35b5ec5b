"""Builds the main job's pieces from its Hydra config and runs one training run.

Kept apart from ``main.py`` so that tests and notebooks can build a run from a composed config
(``compose_config``) without going through Hydra's command line.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from .common import JobError, is_global_zero

if TYPE_CHECKING:
    from .rollout_loop import Engine

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # shipped inside the package


_MODES = ("r3", "r2", "off")
_PROTOCOLS = ("skyrl", "vllm", "sglang", "openai")
_EMBEDDED_PROTOCOLS = ("skyrl", "sglang")  # what the embedded engine speaks

# ${product:a,b} in conf/config.yaml (e.g. the batch size of one whole RL step)
OmegaConf.register_new_resolver("product", lambda a, b: int(a) * int(b), replace=True)


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
    if OmegaConf.select(cfg, "algorithm.mismatch_every_n_steps") is not None:
        _positive_int(cfg, "algorithm.mismatch_every_n_steps", minimum=0)
    if str(cfg.replay.mode) not in _MODES:
        raise JobError(f"replay.mode must be one of {list(_MODES)}, got {cfg.replay.mode!r}")
    for mode in cfg.compare:
        if str(mode) not in _MODES:
            raise JobError(f"compare entries must be replay modes {list(_MODES)}, got {mode!r}")
    if cfg.rollout.protocol not in _PROTOCOLS:
        raise JobError(f"rollout.protocol must be one of {list(_PROTOCOLS)}, got {cfg.rollout.protocol!r}")
    url = cfg.rollout.url
    if url is None and cfg.rollout.protocol not in _EMBEDDED_PROTOCOLS:
        raise JobError(
            f"rollout.protocol={cfg.rollout.protocol} needs rollout.url (the engine's http://host:port); "
            f"the embedded engine speaks {list(_EMBEDDED_PROTOCOLS)}"
        )
    if url is None and cfg.rollout.get("require_url", False):
        raise JobError("rollout.url must be set to the engine's http://host:port (rollout.require_url=true)")
    urls = list(url) if isinstance(url, ListConfig) else [url]
    if url is not None and not (urls and all(str(u).startswith(("http://", "https://")) for u in urls)):
        raise JobError(
            f"rollout.url must be null (embedded engine), http(s)://host:port or a list of them, got {url!r}"
        )
    lr = cfg.algorithm.optim.lr
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise JobError(f"algorithm.optim.lr must be a number > 0, got {lr!r}")
    if cfg.model.path is None and cfg.model.family is None:
        raise JobError("model.path (a Hugging Face checkpoint) or model.family (a tiny model) must be set")
    # before a checkpoint is loaded: Lightning would only find out when building the Trainer
    if cfg.trainer.get("accelerator") == "gpu" and not _gpu_available():
        raise JobError(
            f"trainer.accelerator=gpu but no GPU is visible here; use trainer=cpu, or trainer=cpu_fsdp "
            f"for FSDP2 on CPU processes (got trainer.devices={cfg.trainer.get('devices')!r})"
        )
    # the callback reads it only at the first training batch, far from the command line
    pad = _callback_settings(cfg).get("pad_to_multiple", 1)
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 1:
        raise JobError(f"callbacks.router_replay.pad_to_multiple must be an integer >= 1, got {pad!r}")


def _gpu_available() -> bool:
    return torch.cuda.is_available() or torch.backends.mps.is_available()


def _callback_settings(cfg: DictConfig) -> DictConfig:
    """The router replay callback's settings: conf/callbacks holds either ``{router_replay: {...}}``
    or the callback's own keys at the top level."""
    callbacks = cfg.callbacks
    return callbacks if "_target_" in callbacks else callbacks.get("router_replay", OmegaConf.create({}))


def replay_settings(cfg: DictConfig, mode: str) -> DictConfig:
    """``cfg`` with the ``replay`` group swapped for ``conf/replay/<mode>.yaml``."""
    path = CONF_DIR / "replay" / f"{mode}.yaml"
    if not path.exists():
        raise JobError(f"no replay config for mode {mode!r} ({path})")
    out = OmegaConf.merge(cfg, {"replay": OmegaConf.load(path)})
    assert isinstance(out, DictConfig)
    return out


# ---------------------------------------------------------------------------- model


def build_model(model_cfg: DictConfig, *, trainer: bool = False) -> torch.nn.Module:
    """The policy in fp32: the tiny MoE (``family`` + ``overrides``) or a checkpoint (``path``).

    ``trainer=True`` with ``sharded_weights`` set: the checkpoint's model with parameters on the
    meta device, for FSDP2 ranks that read only their shards (an embedded engine needs weights)."""
    if model_cfg.path is not None:
        from transformers import AutoModelForCausalLM

        path = Path(str(model_cfg.path)).expanduser()
        if not path.exists():
            raise JobError(f"model.path does not exist: {path}")
        if trainer and model_cfg.get("sharded_weights") is not None:
            from ..models.sharded import meta_model

            # parameters on the meta device: each FSDP2 rank reads only its shards after sharding
            return meta_model(path)
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
    from hydra.errors import InstantiationException
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from ..data.buffer import ReplayBuffer
    from ..data.datamodule import R3DataModule
    from ..replay.callback import RouterReplayCallback
    from ..replay.hf import HFRouterReplay
    from ..rollout.client_protocol import RouteSchema
    from .grpo import GRPOConfig
    from .module import GRPOModule, OptimConfig
    from .rollout_loop import on_policy_loop
    from .task import TokenClassTask, TokenClassTaskConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    model = build_model(cfg.model, trainer=True)
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
        mismatch_every_n_steps=int(algo.get("mismatch_every_n_steps", 1)),
    )
    optim = OptimConfig(
        lr=float(algo.optim.lr),
        weight_decay=float(algo.optim.weight_decay),
        betas=tuple(algo.optim.betas),  # type: ignore[arg-type]
        grad_clip=algo.optim.grad_clip,
    )
    buffer = ReplayBuffer(vocab_size=vocab_size, num_experts=schema.num_experts)
    data_kwargs = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k != "_target_"}  # type: ignore[union-attr]
    try:
        datamodule = R3DataModule(buffer, **data_kwargs)
    except (TypeError, ValueError) as exc:
        raise JobError(f"data: {exc}") from None

    callback_kwargs = dict(OmegaConf.to_container(_callback_settings(cfg), resolve=True) or {})  # type: ignore[arg-type]
    for key in ("_target_", "backend", "mode"):  # the backend is built here, the mode is replay.mode
        callback_kwargs.pop(key, None)
    replay_strict = cfg.replay.get("strict")
    if replay_strict is not None:
        callback_kwargs["strict"] = bool(replay_strict)
    elif cfg.rollout.url is not None and mode == "r3":
        # an external engine that returns no routes is misconfigured: fail instead of training natively
        callback_kwargs["strict"] = True
    try:
        replay_callback = RouterReplayCallback(backend=backend, mode=mode, **callback_kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise JobError(f"callbacks.router_replay: {exc}") from None
    loop = on_policy_loop(
        cfg,
        engine,
        task,
        schema,
        buffer,
        normalize_std=grpo.normalize_std,
        metrics_path=out_dir / "metrics.csv",
    )
    sharded_weights = cfg.model.get("sharded_weights")
    module = GRPOModule(
        model,
        grpo,
        optim,
        recompute_old_logprobs=mode == "r2",
        sharded_weights=None if sharded_weights is None else str(sharded_weights),
    )
    checkpoint = ModelCheckpoint(
        dirpath=out_dir / "checkpoints",
        filename="last",
        save_top_k=1,
        every_n_epochs=1,
        enable_version_counter=False,
    )
    try:
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
    except (MisconfigurationException, InstantiationException, TypeError, ValueError) as exc:
        raise JobError(f"trainer: {exc}") from None
    last = out_dir / "checkpoints" / "last.ckpt"
    ckpt_path = str(last) if cfg.resume and last.exists() else None
    if ckpt_path is not None and is_global_zero():
        print(f"resuming {out_dir.name} from {last}")
    with warnings.catch_warnings():
        # Lightning's own deprecated pytree call, and the expected note when resuming into
        # the same checkpoint directory
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        # the GRPO module measures its paired mismatch in on_after_batch_transfer (intended)
        warnings.filterwarnings("ignore", message=r".*overridden `on_after_batch_transfer`.*")
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return loop.history
