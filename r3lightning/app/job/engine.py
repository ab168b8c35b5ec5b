"""Where rollouts come from (the embedded ``RolloutServer``, ``rollout.url``, or a vLLM engine the job
launches), and weight pushes to them."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig
from safetensors.torch import save, save_file
from torch import Tensor

from r3lightning.app.job.common import JobError, is_global_zero
from r3lightning.app.job.engine_http import bearer_headers, post_all
from r3lightning.app.job.rollout_loop import Engine, WeightSync
from r3lightning.app.job.rollout_settings import launch_settings, launched, retry_policy, server_settings
from r3lightning.app.job.setup import build_model
from r3lightning.app.serve.server import RolloutServer

__all__ = ["embedded_server"]

logger = logging.getLogger(__name__)


def _bf16_host(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """What an engine serves: contiguous bf16 CPU copies (half the bytes of fp32 on the wire)."""
    return {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in state_dict.items()}


def _http_push(urls: list[str], api_key: str | None, timeout_s: float) -> WeightSync:
    """Weight sync for ``r3lightning-serve`` / SkyRL engines: one safetensors body, ``POST``ed to each
    with its policy version, between ``/pause`` and ``/resume`` where the engine has them."""

    def push(state_dict: Mapping[str, Tensor], version: int) -> None:
        body = save(_bf16_host(state_dict))
        headers = {"Content-Type": "application/octet-stream", **bearer_headers(api_key)}

        async def post(session, url: str) -> None:
            async with session.post(f"{url}/pause", headers=bearer_headers(api_key)) as response:
                paused = response.status == 200  # 404: an engine without pause (SkyRL's)
            try:
                await upload(session, url)
            finally:
                if paused:
                    async with session.post(f"{url}/resume", headers=bearer_headers(api_key)):
                        pass

        async def upload(session, url: str) -> None:
            where = f"{url}/update_weights?weight_version={version}"
            async with session.post(where, data=body, headers=headers) as response:
                if response.status == 404:
                    raise JobError(
                        f"the engine at {url} has no /update_weights endpoint; set "
                        "rollout.sync_weights=false and sync weights through the deployment"
                    )
                if response.status != 200:
                    text = (await response.text())[:200]
                    raise JobError(f"weight update at {url} failed: HTTP {response.status}: {text}")

        post_all(urls, timeout_s, post)

    return push


def _sglang_disk_push(
    urls: list[str], api_key: str | None, timeout_s: float, directory: Path, model_path: str | None
) -> WeightSync:
    """Weight sync for SGLang: one safetensors checkpoint in ``directory``, loaded by every engine."""

    async def post(session, url: str) -> None:
        body = {"model_path": str(directory)}
        headers = bearer_headers(api_key)
        async with session.post(f"{url}/update_weights_from_disk", json=body, headers=headers) as response:
            answer = await response.json(content_type=None)
            succeeded = isinstance(answer, dict) and answer.get("success", False)
            if response.status != 200 or not succeeded:
                raise JobError(
                    f"update_weights_from_disk at {url} failed: HTTP {response.status}: {str(answer)[:200]}"
                )

    def push(state_dict: Mapping[str, Tensor], version: int) -> None:  # SGLang keeps its own versions
        directory.mkdir(parents=True, exist_ok=True)
        save_file(_bf16_host(state_dict), str(directory / "model.safetensors"))
        # SGLang loads a checkpoint directory: it needs the architecture next to the weights
        if model_path is not None and (Path(model_path) / "config.json").exists():
            shutil.copy(Path(model_path) / "config.json", directory / "config.json")
        post_all(urls, timeout_s, post)

    return push


def _vllm_push(cfg: DictConfig, urls: list[str], timeout_s: float, directory: Path | None) -> WeightSync:
    """vLLM's sync: the checkpoint in ``directory`` (default ``rollout.weight_sync_dir``), written in
    ``rollout.weight_sync_dtype``, laid out as the job's model config names it."""
    from r3lightning.app.job.models import torch_dtype
    from r3lightning.app.job.vllm_sync import vllm_disk_push

    rollout = cfg.rollout
    if directory is None and not rollout.get("weight_sync_dir"):
        raise JobError(
            "rollout.weight_sync_dir is not set: the vLLM engine reloads the trainer's weights from a "
            "directory it reads; set it, or rollout.sync_weights=false (rollouts then drift off-policy)"
        )
    directory = Path(str(rollout.weight_sync_dir)) if directory is None else directory
    try:
        dtype = torch_dtype(rollout.get("weight_sync_dtype", "bfloat16"), "rollout.weight_sync_dtype")
    except ValueError as exc:
        raise JobError(str(exc)) from None
    return vllm_disk_push(urls, rollout.api_key, timeout_s, directory, _model_config(cfg), dtype)


def _model_config(cfg: DictConfig):
    """The HF config of the job's model: ``model.path``'s, else the built model's."""
    if cfg.model.get("path") is not None:
        from transformers import AutoConfig

        path = Path(str(cfg.model.path)).expanduser()
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    return build_model(cfg.model).config


def _external_engine(cfg: DictConfig, urls: list[str], weights_dir: Path | None = None) -> Engine:
    """Engines this job did not start in-process: the weight sync their ``rollout.protocol``
    speaks, pushed from rank 0 (every rank joins the full-weight gather)."""
    rollout = cfg.rollout
    if not rollout.sync_weights:
        return Engine(urls)
    if rollout.protocol == "sglang" and not rollout.get("weight_sync_dir"):
        if is_global_zero():
            warnings.warn(
                "rollout.weight_sync_dir is not set: the SGLang engine keeps its weights, so rollouts "
                "drift off-policy; set it to a directory the engine can read",
                stacklevel=4,  # the caller of embedded_server, not contextlib
            )
        return Engine(urls)
    if not is_global_zero():
        return Engine(urls, gather=True)
    timeout = retry_policy(rollout).timeout_s
    if rollout.protocol == "vllm":
        return Engine(urls, _vllm_push(cfg, urls, timeout, weights_dir), gather=True)
    if rollout.protocol == "skyrl":
        return Engine(urls, _http_push(urls, rollout.api_key, timeout), gather=True)
    directory = Path(str(rollout.weight_sync_dir))
    push = _sglang_disk_push(urls, rollout.api_key, timeout, directory, cfg.model.get("path"))
    return Engine(urls, push, gather=True)


@contextlib.contextmanager
def embedded_server(cfg: DictConfig) -> Iterator[Engine]:
    """The rollout engines of the job, for as long as the ``with`` block runs.

    In order of precedence: the engines at ``rollout.url``, a vLLM engine launched here
    (``rollout.launch``), or the embedded ``RolloutServer`` on the job's model. The last two run
    on rank 0 only (started on entry, stopped on exit however the block ends); the other ranks
    get their URL from rank 0 when the fit starts.

    Args:
        cfg: The job's config (``rollout``, ``model``).

    Yields:
        The `Engine`: its URLs and its weight sync.

    Raises:
        JobError: A bad ``rollout.server`` setting, a port the embedded server cannot bind, a
            vLLM engine that does not start, or a weight sync that cannot be set up.
    """
    rollout = cfg.rollout
    if rollout.url is not None:
        url = rollout.url
        urls = list(url) if isinstance(url, ListConfig) else [url]
        yield _external_engine(cfg, [str(u).rstrip("/") for u in urls])
        return
    if launched(rollout):
        with _launched_vllm(cfg) as engine:
            yield engine
        return
    if not is_global_zero():
        yield Engine(None, gather=bool(rollout.sync_weights))
        return
    engine, limits = server_settings(rollout)
    host = str(rollout.server.host)
    port = int(rollout.server.port)
    options = {"engine": engine, "limits": limits, "host": host, "port": port, "api_key": rollout.api_key}
    try:
        server = RolloutServer(build_model(cfg.model), **options)
    except (TypeError, ValueError) as exc:  # e.g. a non-loopback host without rollout.api_key
        raise JobError(f"rollout.server: {exc}") from None
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(server)  # serves from a daemon thread until the runs end
        except OSError as exc:
            raise JobError(f"cannot start the embedded rollout server on {host}:{port}: {exc}") from None
        sync = bool(rollout.sync_weights)
        push = None
        if sync:

            def push(state_dict: Mapping[str, Tensor], version: int) -> None:
                server.update_weights(state_dict, weight_version=version)

        yield Engine([server.url], push, gather=sync)


def _save_served_model(cfg: DictConfig, directory: Path) -> str:
    """The directory vLLM serves: ``model.path`` itself for a checkpoint, else the job's built model
    (the trainer's initial weights, same seed) saved there with the tiny tokenizer."""
    from r3lightning.app.models.tiny_tokenizer import build_tiny_tokenizer

    if cfg.model.get("path") is not None:
        return str(Path(str(cfg.model.path)).expanduser())
    build_model(cfg.model).save_pretrained(directory, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(directory)  # /v1/completions needs one, even for token ids
    return str(directory)


@contextlib.contextmanager
def _launched_vllm(cfg: DictConfig) -> Iterator[Engine]:
    """``rollout=vllm_local``: rank 0 starts ``vllm serve`` on the job's model and stops it (its whole
    process group) however the job ends; weights then reach it as they reach an external vLLM."""
    from r3lightning.app.vllm.launcher import VllmServer, VllmStartError

    rollout = cfg.rollout
    if not is_global_zero():
        yield Engine(None, gather=bool(rollout.sync_weights))
        return
    with tempfile.TemporaryDirectory(prefix="r3-vllm-model-") as directory:
        settings = launch_settings(rollout, model=_save_served_model(cfg, Path(directory)))
        server = VllmServer(settings)
        try:
            server.start()
        except (VllmStartError, FileNotFoundError) as exc:
            raise JobError(f"rollout.launch: {exc}") from None
        try:
            logger.info("vLLM engine at %s (log: %s)", server.url, server.log_path)
            # the weight sync's checkpoint: beside the served model, gone with it
            yield _external_engine(cfg, [server.url], Path(directory) / "weights")
        finally:
            server.stop()
