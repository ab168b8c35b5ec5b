"""Where rollouts come from (the embedded ``RolloutServer`` or ``rollout.url``), and weight pushes to them."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import warnings
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import torch
from omegaconf import DictConfig, ListConfig
from safetensors.torch import save, save_file
from torch import Tensor

from r3lightning.app.job.build import one_line
from r3lightning.app.job.common import JobError, is_global_zero
from r3lightning.app.job.rollout_loop import Engine, WeightSync
from r3lightning.app.job.rollout_settings import retry_policy, server_settings
from r3lightning.app.job.setup import build_model
from r3lightning.app.serve.server import RolloutServer
from r3lightning.wire.errors import RemoteGenerateError


def _bf16_host(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """What an engine serves: contiguous bf16 CPU copies (half the bytes of fp32 on the wire)."""
    return {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in state_dict.items()}


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _post_all(urls: list[str], timeout_s: float, post: Callable[[Any, str], Awaitable[None]]) -> None:
    """``post(session, url)`` to every engine concurrently, in one ``aiohttp`` session."""

    async def guarded(session: aiohttp.ClientSession, url: str) -> None:
        try:
            await post(session, url)
        except (aiohttp.ClientError, TimeoutError) as exc:  # an engine gone since its health check
            reason = one_line(exc) or f"no answer within {timeout_s:g}s"
            raise RemoteGenerateError(
                f"weight update at {url} failed: {type(exc).__name__}: {reason}; is the engine still running?"
            ) from None

    async def post_all() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            await asyncio.gather(*(guarded(session, url) for url in urls))

    asyncio.run(post_all())


def _http_push(urls: list[str], api_key: str | None, timeout_s: float) -> WeightSync:
    """Weight sync for ``r3lightning-serve`` / SkyRL engines: one safetensors body, ``POST``ed to each."""

    def push(state_dict: Mapping[str, Tensor]) -> None:
        body = save(_bf16_host(state_dict))
        headers = {"Content-Type": "application/octet-stream", **_auth(api_key)}

        async def post(session, url: str) -> None:
            async with session.post(f"{url}/update_weights", data=body, headers=headers) as response:
                if response.status == 404:
                    raise JobError(
                        f"the engine at {url} has no /update_weights endpoint; set "
                        "rollout.sync_weights=false and sync weights through the deployment"
                    )
                if response.status != 200:
                    text = (await response.text())[:200]
                    raise JobError(f"weight update at {url} failed: HTTP {response.status}: {text}")

        _post_all(urls, timeout_s, post)

    return push


def _sglang_disk_push(
    urls: list[str], api_key: str | None, timeout_s: float, directory: Path, model_path: str | None
) -> WeightSync:
    """Weight sync for SGLang: one safetensors checkpoint in ``directory``, loaded by every engine."""

    async def post(session, url: str) -> None:
        body, headers = {"model_path": str(directory)}, _auth(api_key)
        async with session.post(f"{url}/update_weights_from_disk", json=body, headers=headers) as response:
            answer = await response.json(content_type=None)
            if response.status != 200 or not (isinstance(answer, dict) and answer.get("success", False)):
                raise JobError(
                    f"update_weights_from_disk at {url} failed: HTTP {response.status}: {str(answer)[:200]}"
                )

    def push(state_dict: Mapping[str, Tensor]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(_bf16_host(state_dict), str(directory / "model.safetensors"))
        # SGLang loads a checkpoint directory: it needs the architecture next to the weights
        if model_path is not None and (Path(model_path) / "config.json").exists():
            shutil.copy(Path(model_path) / "config.json", directory / "config.json")
        _post_all(urls, timeout_s, post)

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
        yield Engine([server.url], server.update_weights if sync else None, gather=sync)
