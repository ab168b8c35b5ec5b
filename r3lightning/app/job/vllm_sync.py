"""Weight sync for vLLM: the trainer writes an HF safetensors checkpoint in the engine's dtype
(`r3lightning.app.vllm.weight_sync`), and every engine loads it through its development
endpoints (``VLLM_SERVER_DEV_MODE=1``):

    POST /pause?mode=wait           requests in flight finish on the old weights, new ones wait
    POST /collective_rpc            r3_reload_weights(weights_path) on every worker
    POST /reset_prefix_cache        cached KV and routes belong to the old weights
    POST /update_weight_version     the policy version the engine now serves
    POST /resume

A refused step raises `JobError` (an engine that does not answer: ``RemoteGenerateError``)
and leaves that engine paused: it never samples from weights that are half loaded or stale.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import torch
from torch import Tensor

from r3lightning.app.job.common import JobError
from r3lightning.app.job.engine_http import bearer_headers, post_all
from r3lightning.app.job.rollout_loop import WeightSync
from r3lightning.app.vllm import weight_sync
from r3lightning.app.vllm.settings import ENGINE_SIDE_DIR, WORKER_EXTENSION

__all__ = ["vllm_disk_push"]


async def _answer(response: aiohttp.ClientResponse) -> Any:
    """The JSON answer (vLLM's errors: their message only), else the text."""
    text = await response.text()
    with contextlib.suppress(ValueError):
        answer = json.loads(text) if text else None
        error = answer.get("error") if isinstance(answer, dict) else None
        return error["message"] if isinstance(error, dict) and "message" in error else answer
    return text


def vllm_disk_push(
    urls: list[str],
    api_key: str | None,
    timeout_s: float,
    directory: Path,
    config: Any,
    dtype: torch.dtype,
) -> WeightSync:
    """The weight sync of vLLM engines: ``push(state_dict, version)`` writes the checkpoint once, then
    every engine loads it (concurrently) as the module docstring lists.

    Args:
        urls: the engines' base URLs.
        api_key: bearer token of the engines (None: none).
        timeout_s: limit of each HTTP call (the pause waits for the requests in flight).
        directory: where the checkpoint goes; every engine must read it at the same path.
        config: the model's HF config (it names the checkpoint layout).
        dtype: the engines' dtype (``--dtype``): fp32 engines get fp32 weights.

    Returns:
        The ``WeightSync``. It raises ``JobError`` for a checkpoint it cannot write or a step an
        engine refuses (that engine stays paused), and ``RemoteGenerateError`` for an engine
        that does not answer.
    """
    headers = bearer_headers(api_key)
    method = weight_sync.RELOAD_METHOD

    def push(state_dict: Mapping[str, Tensor], version: int) -> None:
        try:
            weight_sync.write_checkpoint(directory, weight_sync.checkpoint_tensors(state_dict, config, dtype))
        except ValueError as exc:
            raise JobError(f"rollout.weight_sync_dir: {exc}") from None

        async def call(session, url: str, path: str, what: str, body: Any = None) -> Any:
            # no answer at all: post_all's RemoteGenerateError (the engine is gone)
            async with session.post(f"{url}{path}", json=body, headers=headers) as response:
                answer = await _answer(response)
                status = response.status
            endpoint = path.partition("?")[0]
            if status == 404:
                raise JobError(
                    f"the vLLM engine at {url} has no {endpoint} endpoint: start it with "
                    "VLLM_SERVER_DEV_MODE=1 (weights cannot reach it otherwise)"
                )
            if status != 200 or (isinstance(answer, dict) and answer.get("success") is False):
                hint = ""
                if method in str(answer) and "no attribute" in str(answer):
                    hint = (
                        f" (start vLLM with --worker-extension-cls {WORKER_EXTENSION} and "
                        f"{ENGINE_SIDE_DIR} on its PYTHONPATH)"
                    )
                paused = "" if endpoint == "/pause" else "; the engine stays paused"
                raise JobError(
                    f"weight sync to policy version {version} failed at {url}: {what} ({endpoint}) "
                    f"gave HTTP {status}: {str(answer)[:300]}{hint}{paused}"
                )
            return answer

        async def load(session, url: str) -> None:
            await call(session, url, "/pause?mode=wait", "pausing generation")
            body = {"method": method, "kwargs": {"weights_path": str(directory.resolve())}}
            answer = await call(session, url, "/collective_rpc", f"{method} of {directory}", body)
            results = answer.get("results") if isinstance(answer, dict) else None
            if not (isinstance(results, list) and results and all(isinstance(r, dict) for r in results)):
                raise JobError(
                    f"weight sync to policy version {version} failed at {url}: {method} answered "
                    f"{str(answer)[:200]}, not one result per worker; the engine stays paused"
                )
            await call(session, url, "/reset_prefix_cache", "resetting the prefix cache")
            version_body = {"new_version": str(version)}
            await call(session, url, "/update_weight_version", "setting the weight version", version_body)
            await call(session, url, "/resume", "resuming generation")

        post_all(urls, timeout_s, load)

    return push
