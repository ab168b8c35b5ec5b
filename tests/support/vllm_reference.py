"""References for the tests against a real vLLM engine, computed without the package's parsers:
a raw decode of vLLM's response bodies (``np.load`` of the base64 ``.npy``) and transformers'
native fp32 routes of the same weights."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import torch

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.vllm import tiny_vllm_moe_config

L, K, E = 4, 2, 8  # the tiny vLLM model: 4 decoder layers (layer 0 dense), top-2 of 8 experts
MOE_LAYERS = (1, 2, 3)


def raw_choice(raw_response: bytes) -> tuple[list[int], np.ndarray | None, np.dtype | None]:
    """(sampled token ids, routes ``[rows, L, K]`` as int64, wire dtype) of vLLM's first choice,
    from either endpoint's body."""
    choice = json.loads(raw_response)["choices"][0]
    payload = choice.get("routed_experts")
    if payload is None:
        return choice["token_ids"], None, None
    routes = np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    return choice["token_ids"], routes.astype(np.int64), routes.dtype


def model_routes(model: torch.nn.Module, tokens: list[int]) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """``model``'s fp32 top-k experts of every MoE layer for ``tokens`` (positions 0..T-1):
    ``routes [T, L, K]`` (dense layer 0 all zero, ids sorted per row), ``margin [T, L]``, the gap
    between the k-th and (k+1)-th router logit (a near tie may flip between fp32 kernels), and the
    log-softmax ``[T, V]`` of the logits."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    routes = np.zeros((len(tokens), L, K), dtype=np.int64)
    margin = np.full((len(tokens), L), np.inf)
    for layer, logits in zip(MOE_LAYERS, out.router_logits, strict=True):
        top = logits.float().topk(K + 1, dim=-1)  # [T, K + 1]
        routes[:, layer] = np.sort(top.indices[:, :K].numpy(), axis=-1)
        margin[:, layer] = (top.values[:, K - 1] - top.values[:, K]).numpy()
    return routes, margin, out.logits[0].float().log_softmax(-1)


def native_routes(tokens: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``model_routes`` of the served tiny vLLM model (fp32, ``seed``): ``routes [T, L, K]`` and
    ``margin [T, L]``."""
    model = build_tiny_moe(tiny_vllm_moe_config(), seed=seed, dtype=torch.float32)
    routes, margin, _ = model_routes(model, tokens)
    return routes, margin
