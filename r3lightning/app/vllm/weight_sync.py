"""Weight sync for vLLM: the trainer writes an HF safetensors checkpoint in the engine's dtype, and
every engine loads it through its development endpoints (``VLLM_SERVER_DEV_MODE=1``):

    POST /pause?mode=wait           requests in flight finish on the old weights, new ones wait
    POST /collective_rpc            r3_reload_weights(weights_path) on every worker
    POST /reset_prefix_cache        cached KV and routes belong to the old weights
    POST /update_weight_version     the policy version the engine now serves
    POST /resume

A failed step raises :class:`JobError` and leaves that engine paused: it never samples from weights
that are half loaded or stale. ``r3_reload_weights`` is vLLM's ``reload_weights`` plus the repair
the CPU backend needs (``engine_side/r3lightning_worker.py``); the engine gains it with
``--worker-extension-cls r3lightning_worker.WeightReload`` and that folder on its ``PYTHONPATH``,
which :class:`~r3lightning.app.vllm.VllmServer` sets up with ``dev_mode``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import torch
from safetensors.torch import save_file
from torch import Tensor

from r3lightning.app.vllm.settings import ENGINE_SIDE_DIR, WORKER_EXTENSION
from r3lightning.job.common import JobError

__all__ = [
    "RELOAD_METHOD",
    "checkpoint_tensors",
    "vllm_disk_push",
    "write_checkpoint",
]

RELOAD_METHOD = "r3_reload_weights"
_FILE = "model.safetensors"


def _skeleton(config: Any) -> torch.nn.Module:
    """The model of ``config`` on the meta device: it names the checkpoint layout, holds no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def checkpoint_tensors(
    state_dict: Mapping[str, Tensor], config: Any, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The trainer's weights as an HF checkpoint holds them (the names and layout ``save_pretrained``
    writes, e.g. one tensor per expert, tied copies dropped), contiguous on the host in ``dtype``.

    Args:
        state_dict: the model's full state dict (``full_state_dict``), HF module names.
        config: the model's HF config (its ``model_type`` picks the layout).
        dtype: the engine's dtype.

    Returns:
        ``{checkpoint name: tensor}``.
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    skeleton = _skeleton(config)
    untied = remove_tied_weights_from_state_dict(dict(state_dict), skeleton)  # before a cast unshares them
    host = {k: v.detach().to("cpu", dtype) for k, v in untied.items()}
    out = revert_weight_conversion(skeleton, host)
    return {k: v.contiguous() for k, v in out.items()}


def write_checkpoint(directory: Path, tensors: Mapping[str, Tensor]) -> Path:
    """``tensors`` as ``directory/model.safetensors``, replaced atomically (an engine never reads a
    half-written file); ``JobError`` if the directory holds other ``*.safetensors`` (vLLM loads every one)."""
    directory.mkdir(parents=True, exist_ok=True)
    others = sorted(p.name for p in directory.glob("*.safetensors") if p.name != _FILE)
    if others:
        raise JobError(
            f"the weight directory {directory} holds other safetensors files {others[:3]}; the engine "
            "would load them too: give the weight sync a directory of its own"
        )
    target = directory / _FILE
    partial = directory / f"{_FILE}.partial"  # outside vLLM's *.safetensors pattern
    save_file(dict(tensors), str(partial), metadata={"format": "pt"})
    os.replace(partial, target)
    return target


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
):
    """The weight sync of vLLM engines: ``push(state_dict, version)`` writes the checkpoint once, then
    every engine loads it (concurrently) as the module docstring lists.

    Args:
        urls: the engines' base URLs.
        api_key: bearer token of the engines (None: none).
        timeout_s: limit of each HTTP call (the pause waits for the requests in flight).
        directory: where the checkpoint goes; every engine must read it at the same path.
        config: the model's HF config.
        dtype: the engines' dtype (``--dtype``): fp32 engines get fp32 weights.

    Returns:
        The ``WeightSync``.
    """
    from r3lightning.job.engine import _auth, _post_all

    headers = _auth(api_key)

    def push(state_dict: Mapping[str, Tensor], version: int) -> None:
        write_checkpoint(directory, checkpoint_tensors(state_dict, config, dtype))

        async def call(session, url: str, path: str, what: str, body: Any = None) -> Any:
            try:
                async with session.post(f"{url}{path}", json=body, headers=headers) as response:
                    answer = await _answer(response)
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, answer = None, f"{type(exc).__name__}: {exc}"
            endpoint = path.partition("?")[0]
            if status == 404:
                raise JobError(
                    f"the vLLM engine at {url} has no {endpoint} endpoint: start it with VLLM_SERVER_DEV_MODE=1 "
                    "(weights cannot reach it otherwise)"
                )
            hint = ""
            if RELOAD_METHOD in str(answer) and "no attribute" in str(answer):
                hint = (
                    f" (start vLLM with --worker-extension-cls {WORKER_EXTENSION} and {ENGINE_SIDE_DIR} "
                    "on its PYTHONPATH)"
                )
            if status != 200 or (isinstance(answer, dict) and answer.get("success") is False):
                paused = "" if path == "/pause" else "; the engine stays paused"
                got = f"HTTP {status}" if status is not None else "no answer"
                raise JobError(
                    f"weight sync to policy version {version} failed at {url}: {what} ({endpoint}) gave "
                    f"{got}: {str(answer)[:300]}{hint}{paused}"
                )
            return answer

        async def load(session, url: str) -> None:
            await call(session, url, "/pause?mode=wait", "pausing generation")
            body = {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(directory.resolve())}}
            answer = await call(session, url, "/collective_rpc", f"{RELOAD_METHOD} of {directory}", body)
            results = answer.get("results") if isinstance(answer, dict) else None
            if not (isinstance(results, list) and results and all(isinstance(r, dict) for r in results)):
                raise JobError(
                    f"weight sync to policy version {version} failed at {url}: {RELOAD_METHOD} answered "
                    f"{str(answer)[:200]}, not one result per worker; the engine stays paused"
                )
            await call(session, url, "/reset_prefix_cache", "resetting the prefix cache")
            await call(
                session,
                url,
                "/update_weight_version",
                "setting the weight version",
                {"new_version": str(version)},
            )
            await call(session, url, "/resume", "resuming generation")

        _post_all(urls, timeout_s, load)

    return push
