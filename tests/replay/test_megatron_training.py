"""MegatronRouterReplay in training: the Lightning callback on a packed layout, a real GPTModel with
full recompute, the megatron example script and two real tensor-parallel ranks (CPU, gloo)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.fusions import fused_softmax
from megatron.core.tensor_parallel import random as tp_random
from megatron_cpu import (
    EXPERTS,
    LAYERS,
    TOP_K,
    TokenMoE,
    distinct_routes,
    megatron_cpu,  # noqa: F401 (the module's fixture)
)

from r3lightning.packed import PackedTensor
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.megatron.replay import (
    MegatronRouterReplay,
)

pytestmark = pytest.mark.usefixtures("megatron_cpu")


ROOT = Path(__file__).resolve().parents[2]


def run_script(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh single-threaded interpreter importing this checkout; it must succeed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=180, cwd=cwd, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


class PackedPolicy(pl.LightningModule):
    """Feeds the model the packed [1, T] tokens of the callback's megatron layout."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TokenMoE()
        self.used: list[tuple[torch.Tensor, object]] = []

    def logprob_loss(self, batch, layout) -> torch.Tensor:
        tokens = layout.from_batch(batch["input_ids"])
        labels = layout.from_batch(batch["input_ids"], next_token=True)
        valid = layout.from_batch(batch["attention_mask"], next_token=True, pad=False)
        logprobs = torch.log_softmax(self.model(tokens), -1).gather(-1, labels[..., None])[..., 0]
        return -(logprobs * valid).sum() / valid.sum()

    def training_step(self, batch, batch_idx):
        callback = RouterReplayCallback.find(self.trainer)
        if callback.mode == "r2":
            with callback.old_policy_forward(batch), torch.no_grad():
                self.logprob_loss(batch, callback.build_layout(batch["attention_mask"]))
            with torch.no_grad():  # the policy drifts before the update pass: native routing changes
                for layer in self.model.moe:
                    layer.router.weight.add_(torch.randn_like(layer.router.weight))
        backend = callback.backend
        backend.start_recording()
        loss = self.logprob_loss(batch, callback.layout)
        replayed = (batch.get("routed_experts"), batch.get("route_layers"))
        self.used.append((backend.stop_recording(), callback.layout, replayed))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("mode", ["r3", "r2"])
def test_lightning_callback_replays_rollout_routes(mode, tmp_path):
    """RouterReplayCallback + MegatronRouterReplay in a real Trainer fit: every captured token of
    every MoE layer uses the rollout's experts (r3) or the old-policy forward's (r2)."""
    torch.manual_seed(8)
    generator = torch.Generator().manual_seed(8)
    lengths = [3, 6, 5]
    width = max(lengths)
    attention_mask = torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]
    input_ids = torch.randint(0, 32, (len(lengths), width), generator=generator) * attention_mask
    rollout = [distinct_routes(n - 1, generator) for n in lengths]  # last token: no route
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if mode == "r3":
        batch["routed_experts"] = PackedTensor.from_segments(rollout)
    module = PackedPolicy()
    backend = MegatronRouterReplay(module.model)
    assert backend.moe_layers == (1, 3)
    callback = RouterReplayCallback(backend=backend, mode=mode, strict=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    loader = torch.utils.data.DataLoader([batch], batch_size=None)
    trainer.fit(module, loader)
    assert len(module.used) == 2
    for used, layout, (replayed_routes, route_layers) in module.used:
        assert used.shape == (*layout.token_shape, LAYERS, TOP_K)
        expected = rollout if mode == "r3" else [replayed_routes[i] for i in range(len(lengths))]
        # r2 records only the layers the model routes (layer 0 is dense), each column by its layer
        assert route_layers == (None if mode == "r3" else (1, 3))
        column = {
            layer: layer if route_layers is None else route_layers.index(layer)
            for layer in backend.moe_layers
        }
        checked = 0
        for position in range(layout.num_positions):
            i, j = int(layout.position_sequence[position]), int(layout.position_offset[position])
            if i < 0 or j >= len(expected[i]):
                continue
            for layer in backend.moe_layers:
                assert used[0, position, layer].tolist() == expected[i][j, column[layer]].tolist()
                checked += 1
        assert checked == sum(len(e) for e in expected) * len(backend.moe_layers)
    replayed = trainer.callback_metrics["router_replay/replayed_fraction"]
    assert float(replayed) == 1.0  # every slot with a route row was replayed
    assert float(trainer.callback_metrics["router_replay/used_agreement"]) == 1.0
    assert "router_replay/native_agreement/layer_03" in trainer.callback_metrics
    assert backend.routers[0].router_replay.target_topk_idx is None  # cleared after the step


def test_gpt_model_with_full_recompute_replays_engine_routes(monkeypatch):
    """examples/megatron_moe/gpt_recompute.py (written for a GPU) on CPU: a real GPTModel with
    attention, a dense first layer and full activation recomputation replays a bf16 engine's routes.

    Extra CPU shims: megatron's CUDA RNG tracker (dropout RNG forks) becomes a no-op, and the
    default causal attention mask, built on "cuda", is built on the CPU.
    """
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "megatron_moe"))
    gpt_recompute = pytest.importorskip("gpt_recompute")
    tracker = tp_random.get_cuda_rng_tracker()
    monkeypatch.setattr(tracker, "fork", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(tracker, "get_states", lambda: {})
    monkeypatch.setattr(tracker, "set_states", lambda states: None)
    monkeypatch.setattr(
        fused_softmax, "get_default_causal_mask", lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    )
    torch.manual_seed(9)
    checks = gpt_recompute.check_gpt_replay(torch.device("cpu"))
    assert all(checks.values()), checks


@pytest.mark.slow
def test_example_trains_with_full_agreement(tmp_path):
    """The example's R3 loop: every replayed token/layer uses the rollout's experts, although the
    trainer's native routing disagrees with the (bf16, lagging) engine on some of them."""
    result = run_script(
        ROOT / "examples" / "megatron_moe" / "train_r3.py", "--steps", "3", "--device", "cpu", cwd=tmp_path
    )
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3
    assert all(line.endswith("replayed agreement with rollout routes: 100.00%") for line in steps)
    native = [float(re.search(r"native top-k agreement with rollout ([\d.]+)%", line)[1]) for line in steps]
    assert min(native) < 100.0, native


@pytest.mark.slow
def test_two_tensor_parallel_ranks_route_their_sequence_halves(tmp_path):
    """Real TP = 2 with sequence parallelism: megatron's own scatter gives rank r the contiguous
    r-th half of the sequence, and its router uses exactly the installed routes of those tokens."""
    run_script(ROOT / "tests" / "support" / "megatron_tp_worker.py", str(tmp_path), cwd=tmp_path)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["parallelism"] for r in reports] == [[2, 0], [2, 1]]
    for report in reports:
        half = len(report["routes"]) // 2
        mine = report["routes"][report["rank"] * half : (report["rank"] + 1) * half]
        assert report["used"] == mine
        assert report["recorded_equal"] and report["other_layers_zero"]
        assert report["router_grad"] > 0
        # the rank's half of megatron's padding mask left its padding out of the expert-bias counts
        expected = [0.0] * EXPERTS
        start = report["rank"] * half
        for position, experts in enumerate(mine, start=start):
            if position not in (3, 6, 7):
                for expert in experts:
                    expected[expert] += 1
        assert report["expert_counts"] == expected
