"""Weights reach a real vLLM engine every step: after each sync its routes equal the trainer's
native fp32 routes (transformers' own top-k, no r3lightning parser) on every slot, its logprobs
follow, the prefix cache forgets the old weights, and a failed update is one error with the engine
left paused, never a stale engine that keeps sampling."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch
from route_reference import random_tokens
from vllm_reference import K, L, model_routes, raw_choice

import r3lightning.app.vllm.weight_sync as weight_sync
from r3lightning.app.job.common import JobError
from r3lightning.app.job.vllm_sync import vllm_disk_push
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.app.vllm import tiny_vllm_moe_config

pytestmark = pytest.mark.vllm

PROMPTS = [random_tokens(100 + i, 12) for i in range(6)]
NEW_TOKENS = 4
VLLM_SEED = 0  # the weights the session's engines start with (conftest.py)
NEAR_TIE = 1e-5  # router logit gap below which two fp32 kernels may order experts differently


def _post(url: str, path: str, body: dict | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(f"{url}{path}", timeout=30) as response:
        return json.loads(response.read())


def engine_rollout(server, prompt: list[int]) -> tuple[list[int], np.ndarray, list[float]]:
    """(sampled ids, routes ``[P + G - 1, L, K]`` decoded from the raw body, sampled logprobs)."""
    body = {"model": server.settings.model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    body |= {"ignore_eos": True, "logprobs": 0, "return_token_ids": True, "return_routed_experts": True}
    raw = _post(server.url, "/v1/completions", body)
    ids, routes, _ = raw_choice(raw)
    logprobs = json.loads(raw)["choices"][0]["logprobs"]["token_logprobs"]
    return ids, routes, logprobs


def train_towards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, expert: int) -> None:
    """One optimizer step that raises ``expert``'s router probability on every MoE layer: after it,
    the routes must differ (by construction, not by a float's luck)."""
    tokens = torch.tensor(PROMPTS)
    logits = model(tokens, output_router_logits=True).router_logits  # per MoE layer [B * T, E]
    loss = -sum(layer.log_softmax(-1)[:, expert].mean() for layer in logits)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_routes_follow_the_weights_through_every_sync(vllm_fp32, tmp_path):
    config = tiny_vllm_moe_config()
    model = build_tiny_moe(config, seed=VLLM_SEED)  # the weights the engine started with
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    push = vllm_disk_push([vllm_fp32.url], None, 120.0, tmp_path / "weights", config, torch.float32)
    previous, slots, near_ties = None, 0, 0
    try:
        for step in range(4):  # step 0: the initial weights; then 3 optimizer steps, each synced
            if step:
                train_towards(model, optimizer, expert=(2 * step + 1) % 8)
                push(model.state_dict(), step)
                assert _get(vllm_fp32.url, "/weight_info") == {"weight_version": str(step)}
            routes_now = []
            for prompt in PROMPTS:  # the same prompts every step: a stale prefix cache would show
                ids, routes, logprobs = engine_rollout(vllm_fp32, prompt)
                tokens = prompt + ids[:-1]
                expected, margin, logsoftmax = model_routes(model, tokens)
                assert routes.shape == (len(tokens), L, K)
                clear = np.broadcast_to((margin > NEAR_TIE)[..., None], expected.shape)
                same = np.sort(routes, axis=-1) == expected
                assert same[clear].all(), f"step {step}: {int((~same & clear).sum())} routes differ"
                slots, near_ties = slots + same[:, 1:].size, near_ties + int((~clear[:, 1:]).sum())
                trainer = logsoftmax[len(prompt) - 1 + torch.arange(len(ids)), torch.tensor(ids)]
                assert np.allclose(logprobs, trainer.numpy(), atol=1e-3), f"step {step}: logprobs"
                routes_now.append(expected[:, 1:])
            if previous is not None:  # each step moved the routes
                moved = np.mean([(a != b).any(-1).mean() for a, b in zip(routes_now, previous, strict=True)])
                assert moved > 0.2, f"step {step}: only {moved:.0%} of rows changed experts"
            previous = routes_now
        assert near_ties <= slots // 100  # the tie exemption is a rare float case, not the test
    finally:  # the session's engine serves its initial weights again
        push(build_tiny_moe(config, seed=VLLM_SEED).state_dict(), 0)


def test_a_failed_update_is_one_error_and_the_engine_stays_paused(vllm_fp32, tmp_path, monkeypatch):
    """A checkpoint the engine cannot load (a truncated file; a tensor of the wrong shape, which
    vLLM alone would copy into part of a parameter) raises JobError naming the engine and leaves it
    paused; the next good sync resumes it on the new weights."""
    config = tiny_vllm_moe_config()
    push = vllm_disk_push([vllm_fp32.url], None, 120.0, tmp_path / "weights", config, torch.float32)
    write = weight_sync.write_checkpoint

    def truncated(directory, tensors):
        path = write(directory, tensors)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return path

    good = build_tiny_moe(config, seed=VLLM_SEED).state_dict()
    narrow = dict(good)
    narrow["model.layers.2.mlp.experts.down_proj"] = good["model.layers.2.mlp.experts.down_proj"][..., :16]
    try:
        with monkeypatch.context() as patch:
            patch.setattr(weight_sync, "write_checkpoint", truncated)
            with pytest.raises(
                JobError, match=r"policy version 1 failed at .*r3_reload_weights.*HTTP 500.*stays paused"
            ):
                push(good, 1)
        assert _get(vllm_fp32.url, "/is_paused") == {"is_paused": True}
        with pytest.raises(
            JobError, match=r"down_proj.weight has shape \[64, 16\], the served model's is \[64, 32\]"
        ):
            push(narrow, 2)
        assert _get(vllm_fp32.url, "/is_paused") == {"is_paused": True}
        assert _get(vllm_fp32.url, "/weight_info")["weight_version"] not in ("1", "2")
    finally:
        push(good, 0)
    assert _get(vllm_fp32.url, "/is_paused") == {"is_paused": False}
    ids, routes, _ = engine_rollout(vllm_fp32, PROMPTS[0])
    expected, margin, _ = model_routes(build_tiny_moe(config, seed=VLLM_SEED), PROMPTS[0] + ids[:-1])
    clear = np.broadcast_to((margin > NEAR_TIE)[..., None], expected.shape)
    assert (np.sort(routes, axis=-1) == expected)[clear].all()
