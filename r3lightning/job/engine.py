"""Where the main job's rollouts come from, and how the engines get the trainer's new weights.

Either the embedded ``RolloutServer`` (rank 0 serves a bf16 copy of the policy, loopback by
default, takes weights in process, and every rank sends its own requests to it) or external
engines at ``rollout.url`` (one URL or a list; the collector fails over between them): an
``r3lightning-serve`` / SkyRL-compatible server (weights ``POST``ed as safetensors to each) or
SGLang (weights saved to a directory all sides see, then ``POST /update_weights_from_disk`` to
each).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig
from torch import Tensor

from r3lightning.job.common import JobError, is_global_zero
from r3lightning.job.rollout_loop import Engine, WeightSync
from r3lightning.job.rollout_settings import retry_policy, server_settings
from r3lightning.job.setup import build_model


def _bf16_host(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """What an engine serves: contiguous bf16 CPU copies (half the bytes of fp32 on the wire)."""
    return {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in state_dict.items()}


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _http_push(urls: list[str], api_key: str | None, timeout_s: float) -> WeightSync:
    """Weight sync for external ``r3lightning-serve`` engines: ``POST /update_weights``
    (safetensors, serialised once) to every engine concurrently."""
    import aiohttp
    from safetensors.torch import save

    async def post(session: aiohttp.ClientSession, url: str, body: bytes) -> None:
        headers = {"Content-Type": "application/octet-stream", **_auth(api_key)}
        async with session.post(f"{url}/update_weights", data=body, headers=headers) as response:
            if response.status == 404:
                raise JobError(
                    f"the engine at {url} has no /update_weights endpoint; set rollout.sync_weights=false "
                    "and sync weights through the deployment"
                )
            if response.status != 200:
                raise JobError(
                    f"weight update at {url} failed: HTTP {response.status}: {(await response.text())[:200]}"
                )

    async def post_all(body: bytes) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            await asyncio.gather(*(post(session, url, body) for url in urls))

    def push(state_dict: Mapping[str, Tensor]) -> None:
        asyncio.run(post_all(save(_bf16_host(state_dict))))

    return push


def _sglang_disk_push(
    urls: list[str], api_key: str | None, timeout_s: float, directory: Path, model_path: str | None
) -> WeightSync:
    """Weight sync for SGLang: save a safetensors checkpoint into ``directory`` (shared with the
    engines) once and ask every engine to load it with ``POST /update_weights_from_disk``."""
    import aiohttp
    from safetensors.torch import save_file

    async def post(session: aiohttp.ClientSession, url: str) -> None:
        async with session.post(
            f"{url}/update_weights_from_disk", json={"model_path": str(directory)}, headers=_auth(api_key)
        ) as response:
            body = await response.json(content_type=None)
            if response.status != 200 or not (isinstance(body, dict) and body.get("success", False)):
                raise JobError(
                    f"update_weights_from_disk at {url} failed: HTTP {response.status}: {str(body)[:200]}"
                )

    async def post_all() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            await asyncio.gather(*(post(session, url) for url in urls))

    def push(state_dict: Mapping[str, Tensor]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(_bf16_host(state_dict), str(directory / "model.safetensors"))
        # SGLang loads a checkpoint directory: it needs the architecture next to the weights
        if model_path is not None and (Path(model_path) / "config.json").exists():
            shutil.copy(Path(model_path) / "config.json", directory / "config.json")
        asyncio.run(post_all())

    return push


def engine_urls(rollout: DictConfig) -> list[str] | None:
    """``rollout.url`` (one URL or a list, checked by ``check_config``) as a list of base URLs;
    None: the embedded engine."""
    url = rollout.url
    if url is None:
        return None
    urls = list(url) if isinstance(url, ListConfig) else [url]
    return [str(u).rstrip("/") for u in urls]


def _external_engine(cfg: DictConfig, urls: list[str]) -> Engine:
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
    if rollout.protocol == "skyrl":
        return Engine(urls, _http_push(urls, rollout.api_key, timeout), gather=True)
    directory = Path(str(rollout.weight_sync_dir))
    push = _sglang_disk_push(urls, rollout.api_key, timeout, directory, cfg.model.get("path"))
    return Engine(urls, push, gather=True)


@contextlib.contextmanager
def embedded_server(cfg: DictConfig) -> Iterator[Engine]:
    """The embedded ``RolloutServer`` (rank 0 only; the other ranks learn its URL at fit start)
    unless ``rollout.url`` names external engines."""
    rollout = cfg.rollout
    urls = engine_urls(rollout)
    if urls is not None:
        yield _external_engine(cfg, urls)
        return
    if not is_global_zero():
        yield Engine(None, gather=bool(rollout.sync_weights))
        return
    from r3lightning.serve.server import RolloutServer

    engine, limits = server_settings(rollout)
    model = build_model(cfg.model)
    try:
        server = RolloutServer(
            model,
            engine=engine,
            limits=limits,
            host=str(rollout.server.host),
            port=int(rollout.server.port),
            api_key=rollout.api_key,
        )
    except (TypeError, ValueError) as exc:  # e.g. a non-loopback host without rollout.api_key
        raise JobError(f"rollout.server: {exc}") from None
    try:
        server.__enter__()  # serves from a daemon thread until __exit__
    except OSError as exc:
        raise JobError(
            f"cannot start the embedded rollout server on {rollout.server.host}:{rollout.server.port}: {exc}"
        ) from None
    try:
        sync = bool(rollout.sync_weights)
        yield Engine([server.url], server.update_weights if sync else None, gather=sync)
    finally:
        server.__exit__(None, None, None)
