"""Replay is exact against a real engine: a bf16 vLLM samples, an fp32 trainer recomputes. Natively
the trainer picks other experts on some slots; replaying the engine's routes, the experts the
trainer's MoE blocks are handed (seen by a hook on the experts module, not by r3lightning's
counters) are the engine's on every slot."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch
from route_reference import random_tokens
from vllm_reference import MOE_LAYERS, K, L, raw_choice

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.vllm import tiny_vllm_moe_config
from r3lightning.replay.context import replay_routes

pytestmark = pytest.mark.vllm

# 24 prompts x (20 + 8 - 1) tokens x 3 MoE layers = 1944 slots: at the ~2% of slots where bf16
# and fp32 routers part, none differing would be a 1e-17 event, whatever the CPU's kernels.
PROMPTS = [random_tokens(200 + i, 20) for i in range(24)]
NEW_TOKENS = 8


def engine_routes(server, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    body = {"model": server.settings.model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 1.0}
    body |= {"seed": 7, "ignore_eos": True, "return_token_ids": True, "return_routed_experts": True}
    request = urllib.request.Request(
        f"{server.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        ids, routes, _ = raw_choice(response.read())
    return ids, routes  # routes [P + G - 1, L, K]


def used_experts(model: torch.nn.Module, tokens: list[int], routes: np.ndarray | None) -> np.ndarray:
    """The experts each MoE block of the trainer hands its tokens ``[T, L, K]`` (sorted; dense layer 0
    zero), natively or replaying ``routes``: read from the experts modules' inputs."""
    used = np.zeros((len(tokens), L, K), dtype=np.int64)
    hooks = []
    for layer in MOE_LAYERS:

        def seen(module, args, layer=layer) -> None:
            used[:, layer] = np.sort(args[1].numpy(), axis=-1)  # (hidden, top_k_index, top_k_weights)

        hooks.append(model.model.layers[layer].mlp.experts.register_forward_pre_hook(seen))
    try:
        with torch.no_grad():
            if routes is None:
                model(torch.tensor([tokens]))
            else:
                with replay_routes(model, torch.from_numpy(routes)[None]):  # [1, T, L, K]
                    model(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return used


def test_replay_makes_used_agreement_exact_where_native_is_not(vllm_bf16):
    model = build_tiny_moe(tiny_vllm_moe_config(), seed=0, dtype=torch.float32)  # the engine's weights
    native_same = replay_same = slots = 0
    for prompt in PROMPTS:
        ids, routes = engine_routes(vllm_bf16, prompt)
        tokens = prompt + ids[:-1]
        assert routes.shape == (len(tokens), L, K)
        engine = np.sort(routes, axis=-1)[:, 1:]  # [T, MoE layers, K]
        native = used_experts(model, tokens, None)[:, 1:]
        replayed = used_experts(model, tokens, routes)[:, 1:]
        native_same += int((native == engine).all(-1).sum())
        replay_same += int((replayed == engine).all(-1).sum())
        slots += engine.shape[0] * engine.shape[1]
    print(
        f"bf16 engine vs fp32 trainer over {slots} slots: native {native_same / slots:.2%}, replay {replay_same / slots:.2%}"
    )
    assert replay_same == slots  # used agreement: exactly 100%
    assert native_same < slots  # the premise: bf16 and fp32 routers part somewhere
