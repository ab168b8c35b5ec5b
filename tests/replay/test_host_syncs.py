"""No hidden device->host syncs in a training step, and compile-friendly idle router hooks.

The sync detector (tests/sync_detector.py) follows the batch and the parameters as if they lived
on a GPU and reports every operation of the package that would block the host there.
"""

import copy

import lightning.pytorch as pl
import pytest
import torch
from megatron_cpu import TokenMoE, distinct_routes, make_config, make_moe_layer, megatron_cpu  # noqa: F401
from replay_policy import MemoryLogger, loader, make_batch
from sync_detector import ArmDetector, DisarmDetector, SyncDetector
from trainers import cpu_trainer

from r3lightning.app.job.module import GRPOModule
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.data.batch import RolloutBatch
from r3lightning.packed import PackedTensor
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.replay.megatron.replay import MegatronRouterReplay

pytestmark = pytest.mark.usefixtures("megatron_cpu")


def fit_one_step(module, batch, callback):
    detector = SyncDetector()
    logger = MemoryLogger()
    trainer = cpu_trainer(
        max_steps=1,
        logger=logger,
        callbacks=[ArmDetector(detector), callback, DisarmDetector(detector)],
    )
    with detector:
        trainer.fit(module, loader([batch]))
    return detector, logger


@pytest.fixture(scope="module")
def batch():
    return make_batch(5, [7, 9, 5, 6], dropped_rows=2)


@pytest.mark.parametrize("mode", ["r3", "off", "r2"])
def test_a_grpo_step_on_the_hf_path_makes_no_host_sync(batch, mode):
    step_batch = copy.deepcopy(batch)
    if mode == "r2":
        step_batch.routed_experts = None
    module = GRPOModule(build_tiny_moe(seed=0), recompute_old_logprobs=mode == "r2")
    detector, logger = fit_one_step(module, step_batch, RouterReplayCallback(mode=mode))
    assert detector.syncs == []
    logged = {k: v for row in logger.rows for k, v in row.items()}
    assert logged["router_replay/native_agreement"] <= 1.0  # the metrics were computed and logged
    if mode != "r2":
        assert set(logged) >= {f"used_agreement/layer_{layer:02d}" for layer in (1, 2, 3)}


def test_the_detector_reports_package_syncs(batch):
    class Syncing(GRPOModule):
        def training_step(self, batch, batch_idx):
            batch.equal(batch)  # RolloutBatch.equal reads values back: a sync per field
            return super().training_step(batch, batch_idx)

    detector, _ = fit_one_step(Syncing(build_tiny_moe(seed=0)), copy.deepcopy(batch), RouterReplayCallback())
    assert detector.syncs and all("batch.py" in s or "packed.py" in s for s in detector.syncs), set(
        detector.syncs
    )


class MegatronPolicy(pl.LightningModule):
    """Feeds the megatron MoE the packed tokens of the callback's layout."""

    def __init__(self):
        super().__init__()
        self.model = TokenMoE()

    def training_step(self, batch, batch_idx):
        layout = RouterReplayCallback.find(self.trainer).layout
        tokens = layout.from_batch(batch.input_ids)
        labels = layout.from_batch(batch.input_ids, next_token=True)
        valid = layout.from_batch(batch.attention_mask, next_token=True, pad=False)
        logprobs = torch.log_softmax(self.model(tokens), -1).gather(-1, labels[..., None])[..., 0]
        return -(logprobs * valid).sum() / valid.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def megatron_batch(seed, lengths=(3, 6, 5)):
    """A left-padded RolloutBatch with random engine routes for every token but the last."""
    generator = torch.Generator().manual_seed(seed)
    lengths = list(lengths)
    width = max(lengths)
    mask = torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]
    zeros = torch.zeros(len(lengths), width)
    return RolloutBatch(
        input_ids=torch.randint(0, 32, (len(lengths), width), generator=generator) * mask,
        attention_mask=mask,
        loss_mask=zeros + mask,
        rollout_logprobs=zeros,
        advantages=torch.ones(len(lengths)),
        rewards=torch.zeros(len(lengths)),
        prompt_lengths=torch.ones(len(lengths), dtype=torch.long),
        sequence_lengths=torch.tensor(lengths),
        _host_lengths=(torch.tensor(lengths), torch.ones(len(lengths), dtype=torch.long)),
        routed_experts=PackedTensor.from_segments([distinct_routes(n - 1, generator) for n in lengths]),
    )


def test_a_step_on_the_megatron_path_makes_no_host_sync():
    batch = megatron_batch(3)
    module = MegatronPolicy()
    callback = RouterReplayCallback(
        backend=MegatronRouterReplay(module.model, validate=False), mode="r3", strict=True
    )
    detector, logger = fit_one_step(module, batch, callback)
    assert detector.syncs == [], sorted(set(detector.syncs))
    assert logger.rows[0]["router_replay/used_agreement"] == 1.0


def test_idle_router_hooks_add_no_graph_break():
    """torch.compile traces through the package's hooks when nothing is installed or recorded."""
    ids = torch.randint(3, 96, (2, 6))

    def breaks(model):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(ids)
        return [str(reason) for reason in explanation.break_reasons]

    plain = build_tiny_moe(seed=0)
    hooked = build_tiny_moe(seed=0)
    backend = HFRouterReplay.for_model(hooked)
    assert breaks(hooked) == breaks(plain)
    assert not [r for r in breaks(hooked) if "r3lightning" in r]
    # the package's hooks really are traced (a break inside them would show): with routes
    # recording, the hook runs its tensor code under the compiler and still replays exactly
    backend.clear()


class RecomputingMoE(TokenMoE):
    """TokenMoE whose MoE layers recompute in backward (megatron's selective "moe" recompute)."""

    def __init__(self):
        super().__init__()
        config = make_config(recompute_granularity="selective", recompute_modules=["moe"])
        self.moe = torch.nn.ModuleList([make_moe_layer(config, 2), make_moe_layer(config, 4)])


class MegatronMicroPolicy(MegatronPolicy):
    """Two passes over micro-batches of 2 and 1 rows, each replayed through the packed layout."""

    def __init__(self):
        super().__init__()
        self.model = RecomputingMoE()
        self.automatic_optimization = False
        self.used = []  # (micro-batch, layout, experts used, recompute entries left)

    def training_step(self, batch, batch_idx):
        callback = RouterReplayCallback.find(self.trainer)
        backend, opt = callback.backend, self.optimizers()
        for _ in range(2):
            for mb in batch.split([2, 1]):
                with callback.micro_batch(mb.trim()) as layout:
                    tokens = layout.from_batch(mb.trim().input_ids)
                    backend.start_recording()
                    logits = self.model(tokens)
                    used = backend.stop_recording()
                    opt.zero_grad()
                    self.manual_backward(logits.float().square().mean())
                    left = [len(r.router_replay.replay_backward_list) for r in backend.routers]
                self.used.append((mb, layout, used, left))
                opt.step()


def test_megatron_micro_batches_replay_through_the_packed_layout_with_recompute():
    batch = megatron_batch(4)
    module = MegatronMicroPolicy()
    backend = MegatronRouterReplay(module.model, validate=False)
    fit_one_step(module, batch, RouterReplayCallback(backend=backend, mode="r3", strict=True))
    assert len(module.used) == 4
    for mb, layout, used, left in module.used:
        assert left == [0, 0]  # each recompute popped its own micro-batch's entry
        assert layout.token_shape[0] == 1  # packed [1, T]
        checked = 0
        for position in range(layout.num_positions):
            i, j = int(layout.position_sequence[position]), int(layout.position_offset[position])
            if i < 0 or j >= len(mb.routed_experts[i]):
                continue
            for layer in backend.moe_layers:
                assert used[0, position, layer].tolist() == mb.routed_experts[i][j, layer].tolist()
                checked += 1
        assert checked == mb.routed_experts.num_rows * len(backend.moe_layers)
