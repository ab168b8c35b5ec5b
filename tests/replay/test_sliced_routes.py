"""Routes kept on the layers a Hugging Face model holds, replayed by absolute layer id: a model whose
dense layers have no router and a partial model (the layers of a later pipeline stage), fed by an
R3DataModule with ``DataOptions(layers=backend.moe_layers)`` in micro-batches; r2 records only the
held layers; routes on other layers are clear errors."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from replay_policy import MemoryLogger, position_ids
from trainers import cpu_trainer

from r3lightning.app.models.tiny import build_tiny_moe, tiny_moe_config
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.datamodule import DataOptions, R3DataModule
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.rollout.trajectory import Trajectory

L, K, E = 4, 2, 8
LENGTHS = [5, 9, 4, 7, 6]


class Skip(torch.nn.Module):
    """A decoder layer another rank holds: the hidden states pass through."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def dense_layers_model():
    """Routers on layers 1 and 3 only (0 and 2 are dense)."""
    return build_tiny_moe(tiny_moe_config(mlp_only_layers=[0, 2]), seed=0)


def partial_model():
    """A later pipeline stage: decoder layers 2 and 3 (both MoE); 0 and 1 live elsewhere."""
    model = build_tiny_moe(seed=0)
    model.model.layers[0], model.model.layers[1] = Skip(), Skip()
    return model


def engine_routes(rows: int, seed: int) -> torch.Tensor:
    """[rows, L, K] uint8, distinct experts per row on every layer (as an engine sends them)."""
    scores = torch.rand(rows, L, E, generator=torch.Generator().manual_seed(seed))
    return scores.topk(K, dim=-1).indices.to(torch.uint8)


def rollouts(with_routes: bool = True) -> list[Trajectory]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate(LENGTHS):
        tokens = torch.randint(3, 96, (n,), generator=g).tolist()
        routes = engine_routes(n - 1, i) if with_routes else None  # r2: an engine without routes
        out.append(Trajectory(tokens[:2], tokens[2:], routed_experts=routes))
    return out


class Policy(pl.LightningModule):
    """Micro-batches of 2 rows, each replayed in its own block; r2: an old-policy forward first."""

    def __init__(self, model, old_policy=False):
        super().__init__()
        self.model, self.old_policy, self.automatic_optimization = model, old_policy, False
        self.batches, self.passes = [], []

    def forward(self, batch):
        mask = batch.attention_mask
        return self.model(
            input_ids=batch.input_ids, attention_mask=mask.long(), position_ids=position_ids(mask)
        ).logits

    def training_step(self, batch, batch_idx):
        callback = RouterReplayCallback.find(self.trainer)
        if self.old_policy:
            with callback.old_policy_forward(batch), torch.no_grad():
                self(batch)
        self.batches.append(batch)
        for mb in batch.split(2):
            with callback.micro_batch(mb), record_routes(self.model) as used:
                self.manual_backward(self(mb).float().logsumexp(-1).mean())
            self.passes.append((mb, used.routes))
        self.optimizers().step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def train(model, layers, mode="r3", buffer_layers=None):
    buffer = ReplayBuffer(num_experts=E, layers=buffer_layers)
    buffer.extend(rollouts(with_routes=mode != "r2"))
    data = R3DataModule(
        buffer, len(LENGTHS), shuffle=False, collate_threads=1, options=DataOptions(layers=layers)
    )
    module, logger = Policy(model, old_policy=mode == "r2"), MemoryLogger()
    trainer = cpu_trainer(
        max_steps=1,
        logger=logger,
        callbacks=[RouterReplayCallback(mode=mode, strict=True)],
    )
    trainer.fit(module, datamodule=data)
    return module, logger


@pytest.mark.parametrize("build", [dense_layers_model, partial_model])
def test_routes_on_the_held_layers_replay_by_absolute_layer_with_full_agreement(build):
    model = build()
    held = HFRouterReplay.for_model(model).moe_layers
    assert held == ((1, 3) if build is dense_layers_model else (2, 3))
    module, logger = train(model, held)
    (batch,) = module.batches
    assert batch.route_layers == held and batch.routed_experts.row_shape == (2, K)
    full = rollouts()
    assert batch.routed_experts.values.nbytes * L == sum(t.routed_experts.nbytes for t in full) * len(held)
    checked = 0
    for mb, used in module.passes:  # every captured row of every held layer used the engine's experts
        for i, row in enumerate(mb.rows_in(batch).tolist()):
            n, captured = int(mb.sequence_lengths[i]), full[row].route_rows
            start = mb.width - n
            for layer in held:
                assert torch.equal(
                    used[i, start : start + captured, layer], full[row].routed_experts[:, layer].int()
                )
                checked += captured
            assert not used[i, :, [x for x in range(L) if x not in held]].any()  # no router there
    assert checked == sum(n - 1 for n in LENGTHS) * len(held)
    assert logger.series("router_replay/used_agreement") == [1.0]
    assert logger.series("router_replay/replayed_fraction") == [1.0]
    per_layer = {k for row in logger.rows for k in row if "native_agreement/layer_" in k}
    assert per_layer == {f"router_replay/native_agreement/layer_{x:02d}" for x in held}


def test_r2_records_only_the_layers_a_partial_model_holds():
    module, logger = train(partial_model(), None, mode="r2")
    (batch,) = module.batches
    recorded = batch.routed_experts  # the old-policy forward's, set on the batch
    assert batch.route_layers == (2, 3) and recorded.row_shape == (2, K)
    assert recorded.lengths.tolist() == LENGTHS  # every real token
    for mb, used in module.passes:  # later passes (the policy moved) replay the recorded experts
        for i, row in enumerate(mb.rows_in(batch).tolist()):
            n = int(mb.sequence_lengths[i])
            assert torch.equal(used[i, mb.width - n :, 2:], recorded[row].int())
    assert logger.series("router_replay/used_agreement") == [1.0]


def test_routes_without_a_layer_the_model_routes_are_refused():
    with pytest.raises(ValueError, match=r"routes on layers \[1, 2\] lack MoE layers \[3\] of the model"):
        train(partial_model(), (1, 2))
    with pytest.raises(
        ValueError, match=r"trajectory 0 of the batch: route_layers \[1, 3\], expected route_layers \[2, 3\]"
    ):
        train(partial_model(), (2, 3), buffer_layers=(1, 3))


def test_a_route_layer_beyond_the_model_is_a_value_error_naming_the_model_layer_count():
    from r3lightning.align.layout import TokenMetadataLayout
    from r3lightning.packed import PackedTensor
    from r3lightning.replay.modes import align_routes

    backend = HFRouterReplay.for_model(partial_model())  # routers on layers 2 and 3 of 4
    layout = TokenMetadataLayout.padded(torch.ones(1, 5, dtype=torch.bool))

    def routes(columns):  # one trajectory, 4 rows of distinct experts
        return PackedTensor.from_segments([engine_routes(4, 0)[:, :columns]])

    dense, mask = align_routes(routes(2), layout, backend, (2, 3))  # the last layer id: 3 = L - 1
    assert dense.shape == (1, 5, 2, K) and mask.tolist() == [[True] * 4 + [False]]  # sliced: 2 columns
    with pytest.raises(
        ValueError, match=r"^routes on layers \[2, 3, 4\] name layer 4, but the model has 4 decoder layers"
    ):
        align_routes(routes(3), layout, backend, (2, 3, 4))  # raised before torch's IndexError
    with pytest.raises(
        ValueError, match=r"^route rows must be \[4 layers \(the model's num_layers=4\), top_k=2\]"
    ):
        align_routes(routes(3), layout, backend)
    with pytest.raises(ValueError, match=r"^route rows must be \[2 layers \(one per route layer \[2, 3\]\)"):
        align_routes(routes(3), layout, backend, (2, 3))


def test_the_backend_is_given_the_held_columns_only(monkeypatch):
    """Sliced routes stay sliced on device: the router backend gets [*, 2, K] uint8 with their layer
    ids, never a widened [*, L, K] copy."""
    installs = []
    install = HFRouterReplay.install

    def spy(self, routes, replay_mask=None, *, layers=None):
        installs.append((tuple(routes.shape[-2:]), routes.dtype, layers))
        return install(self, routes, replay_mask, layers=layers)

    monkeypatch.setattr(HFRouterReplay, "install", spy)
    train(partial_model(), (2, 3))
    assert installs and set(installs) == {((2, K), torch.uint8, (2, 3))}


def test_native_agreement_of_sliced_routes_equals_that_of_the_same_routes_on_every_layer():
    """mode="off" compares each MoE layer with its own column: the sliced run measures what the run
    with routes on all four layers measures (the same model, the same native routing)."""
    _, sliced = train(partial_model(), (2, 3), mode="off")
    _, full = train(partial_model(), None, mode="off")
    keys = sorted(k for row in full.rows for k in row if k.startswith("router_replay/native_agreement"))
    assert keys == [
        "router_replay/native_agreement",
        "router_replay/native_agreement/layer_02",
        "router_replay/native_agreement/layer_03",
    ]
    for key in keys:
        assert sliced.series(key) == full.series(key)
        assert 0.0 < full.series(key)[0] < 1.0  # the premise: native routing differs from the engine's


def test_a_backend_without_layers_gets_the_sliced_routes_widened():
    """A backend of one's own whose install takes no ``layers``: zeros on the layers not held."""
    from r3lightning.replay.backend import install_routes

    class OldBackend:
        num_layers, top_k, num_experts, moe_layers = L, K, E, (2, 3)

        def install(self, routes, replay_mask=None):
            self.routes = routes

    class NewBackend(OldBackend):
        def install(self, routes, replay_mask=None, *, layers=None):
            self.routes, self.layers = routes, layers

    sliced = engine_routes(6, 0)[:, 2:].reshape(2, 3, 2, K)  # [B, S, 2 held layers, K]
    old, new = OldBackend(), NewBackend()
    install_routes(old, sliced, None, (2, 3))
    install_routes(new, sliced, None, [2, 3])
    assert old.routes.shape == (2, 3, L, K) and old.routes.dtype == torch.uint8
    assert torch.equal(old.routes[..., 2:, :], sliced) and not old.routes[..., :2, :].any()
    assert new.routes is sliced and new.layers == (2, 3)
