"""Where rollouts come from (the embedded ``RolloutServer`` or ``rollout.url``), and weight pushes to them."""

from __future__ import annotations

import contextlib
import shutil
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
from r3lightning.app.job.rollout_settings import retry_policy, server_settings
from r3lightning.app.job.setup import build_model
from r3lightning.app.serve.server import RolloutServer


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
        body, headers = {"model_path": str(directory)}, bearer_headers(api_key)
        async with session.post(f"{url}/update_weights_from_disk", json=body, headers=headers) as response:
            answer = await response.json(content_type=None)
            if response.status != 200 or not (isinstance(answer, dict) and answer.get("success", False)):
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


def _external_engine(cfg: DictConfig) -> Engine:
    rollout, url = cfg.rollout, cfg.rollout.url
    urls = [str(u).rstrip("/") for u in (url if isinstance(url, ListConfig) else [url])]
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
    if rollout.protocol == "skyrl":
        return Engine(urls, _http_push(urls, rollout.api_key, timeout), gather=True)
    directory = Path(str(rollout.weight_sync_dir))
    push = _sglang_disk_push(urls, rollout.api_key, timeout, directory, cfg.model.get("path"))
    return Engine(urls, push, gather=True)


@contextlib.contextmanager
def embedded_server(cfg: DictConfig) -> Iterator[Engine]:
    """The engines at ``rollout.url``, or the embedded ``RolloutServer`` (rank 0; the others get its URL)."""
    rollout = cfg.rollout
    if rollout.url is not None:
        yield _external_engine(cfg)
        return
    if not is_global_zero():
        yield Engine(None, gather=bool(rollout.sync_weights))
        return
    engine, limits = server_settings(rollout)
    host, port = str(rollout.server.host), int(rollout.server.port)
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
        push = (
            (lambda state_dict, version: server.update_weights(state_dict, weight_version=version))
            if sync
            else None
        )
        yield Engine([server.url], push, gather=sync)
