"""Micro-batch policies and references for the RouterReplayCallback micro-batch tests.

``MicroPolicy`` runs, per step, PPO-style passes over unequal micro-batches (manual optimisation)
and records what every forward used; ``Whole`` runs one forward in the callback's layout.
"""

import lightning.pytorch as pl
import torch
from replay_policy import LAYERS, engine_dense, make_batch, position_ids, real_rows

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.packed import PackedTensor
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes, replay_routes


def seven_batch():
    """7 trajectories, 2 uncaptured rows each, one without any route (row 4)."""
    return with_routeless_row(make_batch(11, [5, 9, 4, 7, 6, 8, 3], dropped_rows=2), 4)


def with_routeless_row(batch, row):
    """The batch with trajectory ``row``'s routes dropped (an engine that returned none for it)."""
    segments = [seg if i != row else seg[:0] for i, seg in enumerate(batch.routed_experts)]
    batch.routed_experts = PackedTensor.from_segments(segments)
    return batch


def captured_mask(batch):
    """bool [B, S]: positions with a captured route row, built from the batch's own segments."""
    mask = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    for i, segment in enumerate(batch.routed_experts):
        n = int(batch.attention_mask[i].sum())
        start = batch.width - n
        mask[i, start : start + segment.shape[0]] = True
    return mask


def dense_engine_routes(batch):
    """[B, S, L, K]: the engine's rows where captured, any valid distinct experts elsewhere."""
    out = torch.tensor([0, 1]).expand(*batch.input_ids.shape, 4, 2).clone()
    mask = captured_mask(batch)
    out[mask] = batch.routed_experts.values.long()
    return out


class MicroPolicy(pl.LightningModule):
    """Manual optimisation: per step, ``passes`` PPO epochs over unequal micro-batches."""

    def __init__(self, plans, old_policy=False, checkpointing=False):
        super().__init__()
        self.model = build_tiny_moe(seed=0).train()
        if checkpointing:  # backward recomputes each decoder layer: it must replay the same routes
            self.model.activation_checkpointing_enable()
        self.automatic_optimization = False
        self.plans, self.old_policy = plans, old_policy
        self.forwards = []  # (sub-batch, experts used [b, s, L, K], weights before the forward)
        self.whole = []

    def forward(self, batch):
        return self.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask.long(),
            position_ids=position_ids(batch.attention_mask),
        ).logits

    def loss(self, batch, logits):
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        return -(logp * batch.loss_mask[:, 1:]).sum() / batch.loss_mask[:, 1:].sum().clamp(min=1)

    def training_step(self, batch, batch_idx):
        callback = RouterReplayCallback.find(self.trainer)
        opt = self.optimizers()
        if self.old_policy:
            for mb in batch.split([3, 2, 2]):
                with callback.old_policy_forward(mb), torch.no_grad():
                    self(mb)
        for plan in self.plans:
            for mb in plan(batch):
                snapshot = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                with callback.micro_batch(mb) as layout:
                    assert layout is not None and layout.token_shape == tuple(mb.input_ids.shape)
                    with record_routes(self.model) as rec:
                        logits = self(mb)
                    opt.zero_grad()
                    self.manual_backward(self.loss(mb, logits))
                self.forwards.append((mb, rec.routes, snapshot))
                opt.step()
        # after the blocks the step's routes are back: a whole-batch forward replays them
        assert callback.layout.token_shape == tuple(batch.input_ids.shape)
        with torch.no_grad(), record_routes(self.model) as rec:
            self(batch)
        self.whole.append((batch, rec.routes))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def shuffled_trimmed(batch):
    return [mb.trim() for mb in batch.select([6, 0, 3, 1, 5, 2, 4]).split([3, 2, 2])]


PLANS = [lambda b: b.split([3, 2, 2]), shuffled_trimmed]


def native_reference(mb, snapshot):
    """Experts a fresh model with the same weights uses for ``mb`` when the engine's rows are
    replayed on captured positions and every other position routes natively (mask False)."""
    model = build_tiny_moe(seed=0)
    model.load_state_dict(snapshot)
    with (
        torch.no_grad(),
        replay_routes(model, dense_engine_routes(mb), captured_mask(mb)),
        record_routes(model) as rec,
    ):
        model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask.long(),
            position_ids=position_ids(mb.attention_mask),
        )
    return rec.routes


class Whole(MicroPolicy):
    """Automatic optimisation, one forward of the tokens in the callback's layout."""

    def __init__(self):
        super().__init__([])
        self.automatic_optimization = True

    def training_step(self, batch, batch_idx):
        layout = RouterReplayCallback.find(self.trainer).layout
        ids = layout.from_batch(batch.input_ids)
        mask = layout.from_batch(batch.attention_mask, pad=False)
        with record_routes(self.model) as rec:
            logits = self.model(
                input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask)
            ).logits
        self.whole.append((layout, rec.routes))
        return logits.float().square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def replayed_in_layout(layout, used, batch):
    """The engine's rows land where the layout puts each trajectory's tokens."""
    engine = engine_dense(batch)[..., LAYERS, :]
    routed = used[..., LAYERS, :].long()
    checked = 0
    for i, j in real_rows(batch):
        offset = j - (batch.width - int(batch.attention_mask[i].sum()))
        (pos,) = ((layout.position_sequence == i) & (layout.position_offset == offset)).nonzero()[0]
        row, col = divmod(int(pos), layout.token_shape[-1])
        if not torch.equal(routed[row, col], engine[i, j]):
            return False
        checked += 1
    return checked == len(real_rows(batch))
