"""Rollout MoE load metrics: the pure function against plain loops, and the callback in a real Trainer."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from replay_policy import MemoryLogger, TinyPolicy, loader, make_batch
from trainers import cpu_trainer

from r3lightning import ExpertLoadMonitor, PackedTensor, RouterReplayCallback, expert_load_stats

CONF = Path(__file__).resolve().parents[2] / "conf" / "callbacks"


class StepLogger(MemoryLogger):
    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def fit(module, batches, callbacks, log_every_n_steps=1):
    logger = StepLogger()
    trainer = cpu_trainer(
        max_epochs=1,
        logger=logger,
        log_every_n_steps=log_every_n_steps,
        callbacks=callbacks,
    )
    trainer.fit(module, loader(batches))
    return trainer, logger


def reference(routes, num_experts, moe_layers):
    """{layer: (counts list, max/mean, normalised entropy)} by plain Python loops."""
    out = {}
    rows = routes.tolist()
    for layer in moe_layers:
        counts = [0] * num_experts
        for row in rows:
            experts = row[layer]
            if not any(experts):
                continue  # a dense layer's all-zero row
            for e in experts:
                if 0 <= e < num_experts:
                    counts[e] += 1
        total = sum(counts)
        if total == 0:
            out[layer] = (counts, math.nan, math.nan)
            continue
        mean = total / num_experts
        entropy = -sum(c / total * math.log(c / total) for c in counts if c) / math.log(num_experts)
        out[layer] = (counts, max(counts) / mean, entropy)
    return out


def distinct_routes(rows, layers, top_k, num_experts, seed):
    g = torch.Generator().manual_seed(seed)
    skew = torch.linspace(0, 3, num_experts)  # uneven load: high ids more likely
    scores = torch.rand(rows, layers, num_experts, generator=g) + skew
    return scores.topk(top_k, dim=-1).indices.to(torch.uint8)


@pytest.mark.parametrize("moe_layers", [None, (1, 3)])
def test_stats_match_plain_loops(moe_layers):
    routes = distinct_routes(50, 4, 3, 12, seed=1)
    routes[:, 0] = 0  # dense layer
    routes[7, 2] = 0  # a zero row elsewhere is skipped too
    packed = PackedTensor.from_lengths(routes, [20, 30])
    stats = expert_load_stats(packed, 12, moe_layers=moe_layers)
    layers = list(moe_layers) if moe_layers is not None else [0, 1, 2, 3]
    assert stats["layers"].tolist() == layers
    expected = reference(routes, 12, layers)
    for i, layer in enumerate(layers):
        counts, max_over_mean, entropy = expected[layer]
        assert stats["counts"][i].tolist() == counts
        torch.testing.assert_close(stats["max_over_mean"][i].item(), max_over_mean, equal_nan=True)
        torch.testing.assert_close(stats["entropy"][i].item(), entropy, equal_nan=True)
        assert stats["tokens"][i].item() == sum(counts) / 3
    if moe_layers is None:
        assert math.isnan(stats["entropy"][0]) and stats["tokens"][0] == 0  # the dense layer
    # the same routes kept on layers 1 and 3 only: the same figures under the same absolute layers
    kept = PackedTensor.from_lengths(routes[:, [1, 3]], [20, 30])
    sliced = expert_load_stats(kept, 12, moe_layers=moe_layers, route_layers=(1, 3))
    assert sliced["layers"].tolist() == [1, 3]
    rows = [layers.index(layer) for layer in (1, 3)]
    assert torch.equal(sliced["counts"], stats["counts"][rows])


def test_balanced_and_collapsed_extremes():
    num_experts, top_k = 8, 2
    balanced = torch.arange(16).remainder(num_experts).view(8, 1, 2)  # every expert twice
    stats = expert_load_stats(balanced, num_experts)
    assert stats["max_over_mean"].item() == pytest.approx(1.0) and stats["entropy"].item() == pytest.approx(
        1.0
    )
    collapsed = torch.tensor([[[3, 5]]] * 10)
    stats = expert_load_stats(collapsed, num_experts)
    assert stats["max_over_mean"].item() == pytest.approx(num_experts / top_k)
    assert stats["entropy"].item() == pytest.approx(math.log(2) / math.log(num_experts))


def test_out_of_range_ids_never_count_for_another_layer():
    routes = torch.tensor([[[1, 2], [3, 4]], [[5, 9], [1, 2]]])  # 9 >= num_experts=8
    stats = expert_load_stats(routes, 8)
    assert stats["counts"][0].tolist() == [0, 1, 1, 0, 0, 1, 0, 0]
    assert stats["counts"][1].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"integer \[rows, num_layers, top_k\]"):
        expert_load_stats(torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match="num_experts must be an int >= 1, got 0"):
        expert_load_stats(torch.zeros(3, 2, 2, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="out of range for 2 layers"):
        expert_load_stats(torch.zeros(3, 2, 2, dtype=torch.long), 4, moe_layers=[2])
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        ExpertLoadMonitor(8, every_n_steps=0)


def test_monitor_logs_every_n_steps_in_a_trainer_with_the_backends_schema():
    batches = [make_batch(seed, [6, 9, 4]) for seed in range(5)]
    monitor = ExpertLoadMonitor(every_n_steps=2, log_per_layer=True)  # schema from the replay backend
    _, logger = fit(TinyPolicy(), batches, [RouterReplayCallback(backend="hf"), monitor])
    logged = [(step, row) for step, row in logger.rows if "expert_load/entropy" in row]
    # steps 0, 2, 4 only, each once: never a stale value on the steps between
    assert [step for step, _ in logged] == [0, 2, 4]
    for (_, row), batch in zip(logged, batches[::2], strict=True):
        expected = reference(batch.routed_experts.values, 8, [1, 2, 3])  # tiny model: 8 experts
        assert "expert_load/layer_00/entropy" not in row  # the dense layer is not an MoE layer
        for layer in (1, 2, 3):
            _, max_over_mean, entropy = expected[layer]
            assert row[f"expert_load/layer_{layer:02d}/max_over_mean"] == pytest.approx(
                max_over_mean, rel=1e-6
            )
            assert row[f"expert_load/layer_{layer:02d}/entropy"] == pytest.approx(entropy, rel=1e-6)
        assert row["expert_load/max_over_mean"] == pytest.approx(
            sum(expected[layer][1] for layer in (1, 2, 3)) / 3, rel=1e-6
        )
        assert row["expert_load/max_over_mean_worst"] == pytest.approx(
            max(expected[layer][1] for layer in (1, 2, 3)), rel=1e-6
        )
        assert row["expert_load/entropy_min"] == pytest.approx(min(expected[layer][2] for layer in (1, 2, 3)))


def test_monitor_needs_a_schema_and_skips_batches_without_routes():
    batches = [make_batch(0, [5, 4], with_routes=False), make_batch(1, [5, 4])]
    _, logger = fit(TinyPolicy(), batches, [ExpertLoadMonitor(8, every_n_steps=1, prefix="load")])
    rows = [(step, sorted(k for k in row if k.startswith("load/"))) for step, row in logger.rows]
    assert [r for r in rows if r[1]] == [
        (1, ["load/entropy", "load/entropy_min", "load/max_over_mean", "load/max_over_mean_worst"])
    ]
    with pytest.raises(ValueError, match="ExpertLoadMonitor needs num_experts"):
        fit(TinyPolicy(), batches[1:], [ExpertLoadMonitor(every_n_steps=1)])


def test_the_callbacks_config_entry_instantiates():
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="expert_load")
    monitor = instantiate(cfg.expert_load)
    assert (
        isinstance(monitor, ExpertLoadMonitor) and monitor.every_n_steps == 10 and monitor.num_experts is None
    )


class _Linear(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))

    def training_step(self, batch, batch_idx):
        return (self.weight * batch["x"]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _rank_routes(rank):
    return distinct_routes(30, 3, 2, 8, seed=10 + rank)


def _ddp_fit(rank, out):
    import json
    import os

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    logger = StepLogger()
    trainer = cpu_trainer(
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=logger,
        use_distributed_sampler=False,
        callbacks=[ExpertLoadMonitor(8, every_n_steps=1, sync_dist=True)],
    )
    batch = {"x": torch.ones(2), "routed_experts": PackedTensor.from_lengths(_rank_routes(rank), [30])}
    trainer.fit(_Linear(), loader([batch]))
    if rank == 0:
        rows = [row for _, row in logger.rows if "expert_load/entropy" in row]
        Path(out).write_text(json.dumps(rows))


@pytest.mark.slow
def test_sync_dist_averages_the_ranks_values(tmp_path):
    import json

    from gloo_ranks import run_ranks

    out = tmp_path / "rows.json"
    run_ranks(_ddp_fit, str(out))
    (row,) = json.loads(out.read_text())
    per_rank = [expert_load_stats(_rank_routes(rank), 8) for rank in range(2)]
    mean = sum(stats["entropy"].mean() for stats in per_rank) / 2
    worst = sum(stats["max_over_mean"].amax() for stats in per_rank) / 2
    assert row["expert_load/entropy"] == pytest.approx(float(mean), rel=1e-6)
    assert row["expert_load/max_over_mean_worst"] == pytest.approx(float(worst), rel=1e-6)
    mine = expert_load_stats(_rank_routes(0), 8)["entropy"].mean()
    assert row["expert_load/entropy"] != pytest.approx(float(mine), rel=1e-6)  # not rank 0's alone
