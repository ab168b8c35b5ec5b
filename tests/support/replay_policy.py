"""A tiny Lightning policy, engine routes and an in-memory logger for the replay callback tests.

``make_batch`` builds a left-padded ``RolloutBatch`` whose routes come from a perturbed bf16 copy
of the tiny MoE (an engine whose numerics differ from the trainer's); ``fit`` runs a real Lightning
``Trainer`` on CPU and returns the logged rows.
"""

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader
from trainers import cpu_trainer

from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.data.batch import RolloutBatch
from r3lightning.packed import PackedTensor
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes

LAYERS = [1, 2, 3]  # MoE layers of the tiny model (layer 0 is dense)


def engine_model():
    """bf16 copy with perturbed routers: a rollout engine whose numerics differ from the trainer's."""
    model = build_tiny_moe(seed=0, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(0.3 * p.float().std() * torch.randn(p.shape, generator=g).to(p.dtype))
    return model


def make_batch(seed, lengths, dropped_rows=1, with_routes=True):
    """A left-padded RolloutBatch whose routes come from the engine (rows for n - dropped_rows tokens)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    b = len(lengths)
    engine = engine_model()
    input_ids = torch.zeros(b, width, dtype=torch.long)
    attention_mask = torch.zeros(b, width, dtype=torch.bool)
    loss_mask = torch.zeros(b, width)
    segments = []
    for i, n in enumerate(lengths):
        tokens = torch.randint(3, 96, (n,), generator=g)
        input_ids[i, width - n :] = tokens
        attention_mask[i, width - n :] = True
        loss_mask[i, width - n + 2 :] = 1.0  # response = all but a 2-token prompt
        with record_routes(engine) as rec:
            engine(tokens[None])
        segments.append(rec.routes[0, : n - dropped_rows].to(torch.uint8))  # compact, as on the wire
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        rollout_logprobs=torch.zeros(b, width),
        advantages=torch.ones(b),
        rewards=torch.zeros(b),
        prompt_lengths=torch.full((b,), 2),
        sequence_lengths=torch.tensor(lengths),
        routed_experts=PackedTensor.from_segments(segments) if with_routes else None,
    )


def position_ids(attention_mask):
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class TinyPolicy(pl.LightningModule):
    """Token-level NLL on the loss mask; records the experts used by every training forward."""

    def __init__(self, lr=1e-2, checkpointing=False, fail_at=None, passes=1, old_policy=False):
        super().__init__()
        self.model = build_tiny_moe(seed=0).train()  # the engine serves the same weights
        if checkpointing:
            self.model.activation_checkpointing_enable()
        self.lr, self.fail_at, self.passes, self.old_policy = lr, fail_at, passes, old_policy
        self.automatic_optimization = passes == 1
        self.train_routes, self.old_routes, self.val_logits = [], [], []

    def forward(self, batch):
        mask = batch["attention_mask"] if isinstance(batch, dict) else batch.attention_mask
        ids = batch["input_ids"] if isinstance(batch, dict) else batch.input_ids
        return self.model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids(mask)).logits

    def loss(self, batch, logits):
        ids = batch["input_ids"] if isinstance(batch, dict) else batch.input_ids
        loss_mask = batch["loss_mask"] if isinstance(batch, dict) else batch.loss_mask
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        return -(logp * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise KeyError("boom")
        if self.old_policy:
            callback = RouterReplayCallback.find(self.trainer)
            with callback.old_policy_forward(batch), torch.no_grad(), record_routes(self.model) as rec:
                self(batch)
            self.old_routes.append(rec.routes)
        if self.automatic_optimization:
            with record_routes(self.model) as rec:
                logits = self(batch)
            self.train_routes.append(rec.routes)
            return self.loss(batch, logits)
        opt = self.optimizers()
        for _ in range(self.passes):
            with record_routes(self.model) as rec:
                logits = self(batch)
            self.train_routes.append(rec.routes)
            opt.zero_grad()
            self.manual_backward(self.loss(batch, logits))
            opt.step()
        return None

    def validation_step(self, batch, batch_idx):
        self.val_logits.append(self(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class MemoryLogger(Logger):
    """A real Lightning logger that keeps every logged metric in memory."""

    def __init__(self):
        super().__init__()
        self.rows = []

    name = "memory"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def series(self, key):
        return [row[key] for row in self.rows if key in row]


def loader(batches):
    return DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


def fit(module, batches, callback, val_batches=None, **trainer_kwargs):
    logger = MemoryLogger()
    trainer = cpu_trainer(
        devices=1,
        max_epochs=1,
        logger=logger,
        callbacks=[callback],
        **trainer_kwargs,
    )
    trainer.fit(module, loader(batches), loader(val_batches) if val_batches else None)
    return trainer, logger


def real_rows(batch):
    """(batch index, column) of every real token that has a captured route row."""
    rows = []
    for i, routes in enumerate(batch.routed_experts):
        n = int(batch.attention_mask[i].sum())
        start = batch.attention_mask.shape[1] - n
        rows += [(i, start + t) for t in range(routes.shape[0])]
    return rows


def engine_dense(batch):
    out = torch.full((*batch.input_ids.shape, 4, 2), -1, dtype=torch.long)
    for (i, col), row in zip(real_rows(batch), batch.routed_experts.values, strict=True):
        out[i, col] = row.long()
    return out


def set_agreement(a, b):
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).float().mean().item()
