"""Micro-batches, several passes per rollout batch, exact metrics and missing routes, through a
real Lightning Trainer and the Hugging Face tiny MoE model."""

import copy
import math

import lightning.pytorch as pl
import pytest
import torch
from gloo_ranks import run_ranks
from test_callback import LAYERS, MemoryLogger, engine_dense, fit, loader, make_batch, position_ids, real_rows

from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.packed import PackedTensor
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.testing.tiny import build_tiny_moe


def with_routeless_row(batch, row):
    """The batch with trajectory ``row``'s routes dropped (an engine that returned none for it)."""
    segments = [seg if i != row else seg[:0] for i, seg in enumerate(batch.routed_experts)]
    batch.routed_experts = PackedTensor.from_segments(segments)
    return batch


@pytest.fixture(scope="module")
def seven():
    """7 trajectories, 2 uncaptured rows each, one without any route (row 4)."""
    return with_routeless_row(make_batch(11, [5, 9, 4, 7, 6, 8, 3], dropped_rows=2), 4)


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


@pytest.fixture(scope="module")
def trained_without_checkpointing(seven):
    module = MicroPolicy(PLANS)
    fit(module, [copy.deepcopy(seven)], RouterReplayCallback(mode="r3"))
    return module.model.state_dict()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_unequal_micro_batches_over_two_passes_replay_exactly(
    seven, checkpointing, trained_without_checkpointing
):
    module = MicroPolicy(PLANS, checkpointing=checkpointing)
    callback = RouterReplayCallback(mode="r3")
    _, logger = fit(module, [copy.deepcopy(seven)], callback)
    # recompute inside backward replayed each micro-batch's routes: the same updates
    for name, value in trained_without_checkpointing.items():
        torch.testing.assert_close(module.model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert len(module.forwards) == 6
    assert [tuple(mb.input_ids.shape) for mb, _, _ in module.forwards][3:] == [(3, 7), (2, 9), (2, 6)]
    for mb, used, snapshot in module.forwards:
        # every captured token used the engine's experts on every MoE layer ...
        index = tuple(torch.tensor(real_rows(mb)).T)
        assert torch.equal(used[index][:, LAYERS].long(), engine_dense(mb)[index][:, LAYERS])
        # ... and every other position (uncaptured suffix, routeless row, padding) routed natively
        # inside the same forward: bit-equal to replay_routes with a False mask there
        assert torch.equal(used, native_reference(mb, snapshot))
    batch, used = module.whole[0]
    index = tuple(torch.tensor(real_rows(batch)).T)
    assert torch.equal(used[index][:, LAYERS].long(), engine_dense(batch)[index][:, LAYERS])
    assert logger.series("router_replay/replayed_fraction") == [1.0]
    assert logger.series("router_replay/used_agreement") == [1.0]


def test_off_mode_micro_batches_route_natively_and_measure_every_forward(seven):
    module = MicroPolicy(PLANS)
    _, logger = fit(module, [copy.deepcopy(seven)], RouterReplayCallback(mode="off"))
    hits = slots = 0
    for mb, used, snapshot in module.forwards:
        model = build_tiny_moe(seed=0)
        model.load_state_dict(snapshot)
        with torch.no_grad(), record_routes(model) as native:
            model(
                input_ids=mb.input_ids,
                attention_mask=mb.attention_mask.long(),
                position_ids=position_ids(mb.attention_mask),
            )
        assert torch.equal(used, native.routes)  # nothing replayed
        mask = captured_mask(mb)
        ours, engine = used[mask][:, LAYERS].long(), dense_engine_routes(mb)[mask][:, LAYERS]
        hits += int((engine.unsqueeze(-1) == ours.unsqueeze(-2)).any(-1).sum())
        slots += engine.numel()
    # the whole-batch forward after the blocks is compared too
    batch, used = module.whole[0]
    mask = captured_mask(batch)
    ours, engine = used[mask][:, LAYERS].long(), dense_engine_routes(batch)[mask][:, LAYERS]
    hits += int((engine.unsqueeze(-1) == ours.unsqueeze(-2)).any(-1).sum())
    slots += engine.numel()
    assert hits < slots
    assert logger.series("router_replay/native_agreement") == [pytest.approx(hits / slots, abs=1e-7)]
    assert logger.series("router_replay/used_agreement") == [pytest.approx(hits / slots, abs=1e-7)]
    assert logger.series("router_replay/replayed_fraction") == [0.0]


def test_r2_records_per_micro_batch_and_replays_in_later_passes():
    batch = make_batch(12, [5, 9, 4, 7, 6, 8, 3], with_routes=False)
    module = MicroPolicy(PLANS, old_policy=True)
    fit(module, [batch], RouterReplayCallback(mode="r2", strict=True))
    # the old-policy forward recorded every row: stored on the step's batch, in trajectory order
    recorded = batch.routed_experts
    assert recorded is not None and recorded.lengths.tolist() == [5, 9, 4, 7, 6, 8, 3]
    for mb, used, _ in module.forwards:  # re-cut, shuffled and trimmed sub-batches included
        rows = mb.rows_in(batch)
        for i, row in enumerate(rows.tolist()):
            n = int(mb.attention_mask[i].sum())
            assert torch.equal(used[i, mb.width - n :, LAYERS], recorded[row][:, LAYERS].int())
    # SGD with lr=1 moves the routers: natively, the last pass would route differently
    _, last_used, snapshot = module.forwards[-1]
    mb = module.forwards[-1][0]
    model = build_tiny_moe(seed=0)
    model.load_state_dict(snapshot)
    with torch.no_grad(), record_routes(model) as native:
        model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask.long(),
            position_ids=position_ids(mb.attention_mask),
        )
    real = mb.attention_mask
    assert not torch.equal(native.routes[real][:, LAYERS], last_used[real][:, LAYERS])


def test_r2_old_policy_forward_inside_a_micro_batch_block_replays_for_the_rest_of_it():
    class Inside(MicroPolicy):
        def training_step(self, batch, batch_idx):
            callback = RouterReplayCallback.find(self.trainer)
            for mb in batch.split([3, 2, 2]):
                with callback.micro_batch(mb) as layout:
                    assert layout is None  # nothing recorded for these rows yet
                    with callback.old_policy_forward(mb), torch.no_grad(), record_routes(self.model) as old:
                        self(mb)
                    self.model.model.layers[1].mlp.gate.weight.data.normal_()  # the policy moves
                    with record_routes(self.model) as rec:
                        self(mb)
                self.forwards.append((mb, old.routes, rec.routes))
            with callback.micro_batch(batch.select([6, 5, 4, 3, 2, 1, 0])) as layout:
                assert layout is not None  # every row recorded: a re-cut replays them
                with record_routes(self.model) as rec:
                    self(batch.select([6, 5, 4, 3, 2, 1, 0]))
            self.whole.append((batch, rec.routes))

    batch = make_batch(13, [5, 9, 4, 7, 6, 8, 3], with_routes=False)
    module = Inside([])
    fit(module, [batch], RouterReplayCallback(mode="r2", strict=True))
    for mb, old, used in module.forwards:
        real = mb.attention_mask
        assert torch.equal(used[real][:, LAYERS], old[real][:, LAYERS])
    _, used = module.whole[0]
    reversed_batch = batch.select([6, 5, 4, 3, 2, 1, 0])
    for i, row in enumerate([6, 5, 4, 3, 2, 1, 0]):
        n = int(batch.sequence_lengths[row])
        assert torch.equal(
            used[i, reversed_batch.width - n :, LAYERS], batch.routed_experts[row][:, LAYERS].int()
        )


def test_micro_batch_blocks_cannot_nest_or_overlap_or_run_outside_a_step(seven):
    errors = []

    class Nesting(MicroPolicy):
        def training_step(self, batch, batch_idx):
            callback = RouterReplayCallback.find(self.trainer)
            first, second = batch.chunk(2)
            with callback.micro_batch(first):
                with (
                    pytest.raises(RuntimeError, match="cannot nest or overlap") as info,
                    callback.micro_batch(second),
                ):
                    pass
                errors.append(str(info.value))
                self(first)  # the outer block is still installed
            with callback.micro_batch(batch[4:5]) as layout:  # the routeless trajectory alone
                assert layout is not None and callback.routing_counts() is not None
                with record_routes(self.model) as rec:
                    self(batch[4:5])
            self.whole.append((batch[4:5], rec.routes))
            self(batch)  # and the step's routes are back

    callback = RouterReplayCallback(mode="r3", strict=True)
    module = Nesting([])
    _, logger = fit(module, [copy.deepcopy(seven)], callback)
    assert len(errors) == 1
    # a micro-batch whose rows have no captured route routes natively, strict or not
    alone, used = module.whole[0]
    model = build_tiny_moe(seed=0)
    with torch.no_grad(), record_routes(model) as native:
        model(
            input_ids=alone.input_ids,
            attention_mask=alone.attention_mask.long(),
            position_ids=position_ids(alone.attention_mask),
        )
    assert torch.equal(used, native.routes)
    assert logger.series("router_replay/batches_without_routes") == [0.0]
    with pytest.raises(RuntimeError, match="only valid inside a training step"), callback.micro_batch(seven):
        pass


def test_missing_routes_warn_once_are_counted_and_raise_when_strict(seven):
    routeless = copy.deepcopy(seven)
    routeless.routed_experts = None
    batches = [routeless, copy.deepcopy(seven), copy.deepcopy(routeless)]

    class Whole(MicroPolicy):
        def training_step(self, batch, batch_idx):
            with record_routes(self.model) as rec:
                self(batch)
            self.whole.append((batch, rec.routes))

    with pytest.warns(UserWarning, match="--enable-return-routed-experts") as caught:
        _, logger = fit(Whole([]), batches, RouterReplayCallback(mode="r3"))
    assert sum("--enable-return-routed-experts" in str(w.message) for w in caught) == 1  # once per run
    assert logger.series("router_replay/batches_without_routes") == [1.0, 1.0, 2.0]
    assert logger.series("router_replay/replayed_fraction") == [0.0, 1.0, 0.0]
    assert [math.isnan(v) for v in logger.series("router_replay/native_agreement")] == [True, False, True]
    with pytest.raises(ValueError, match=r"strict=True.*no routed_experts.*--enable-return-routed-experts"):
        fit(Whole([]), [copy.deepcopy(routeless)], RouterReplayCallback(mode="r3", strict=True))


def test_routes_are_cleared_before_the_next_callback_and_before_validation(seven):
    callback = RouterReplayCallback(mode="r3")
    seen = []

    class After(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(callback.backend.installed)

    module = MicroPolicy([lambda b: b.split([3, 2, 2])])
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, After()],
    )
    trainer.fit(module, loader([copy.deepcopy(seven)]))
    assert seen == [False]
    # stale routes of another shape, as after a step that never ended: validation clears them
    callback.backend.install(dense_engine_routes(seven), captured_mask(seven))

    class Validating(MicroPolicy):
        def validation_step(self, batch, batch_idx):
            with record_routes(self.model) as rec:
                self(batch[:2])  # would fail on the stale [7, S] routes
            self.whole.append(rec.routes)

    validating = Validating([])
    validating.model = module.model
    trainer.validate(validating, loader([copy.deepcopy(seven)]), verbose=False)
    assert len(validating.whole) == 1 and not callback.backend.installed


# ------------------------------------------------------------------------------ options
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


def test_layout_fn_and_pad_to_multiple_change_the_layout_routes_follow(seven):
    right = RouterReplayCallback(layout_fn=lambda mask: TokenMetadataLayout.padded(mask, side="right"))
    module = Whole()
    fit(module, [copy.deepcopy(seven)], right)
    layout, used = module.whole[0]
    assert layout.side == "right" and replayed_in_layout(layout, used, seven)

    padded = RouterReplayCallback(pad_to_multiple=4)
    module = Whole()
    fit(module, [copy.deepcopy(seven)], padded)
    layout, used = module.whole[0]
    assert layout.token_shape == (7, 12) and replayed_in_layout(layout, used, seven)


def test_log_options_and_model_attr(seven):
    quiet = RouterReplayCallback(log_agreement=False)
    _, logger = fit(Whole(), [copy.deepcopy(seven)], quiet)
    assert not [k for row in logger.rows for k in row if k.startswith("router_replay/")]

    flat = RouterReplayCallback(log_per_layer=False)
    _, logger = fit(Whole(), [copy.deepcopy(seven)], flat)
    keys = {k for row in logger.rows for k in row if k.startswith("router_replay/")}
    assert "router_replay/native_agreement" in keys and not [k for k in keys if "/layer_" in k]

    class WithReference(Whole):
        def __init__(self):
            super().__init__()
            self.reference = build_tiny_moe(seed=0).eval()  # a second MoE model, routed natively

    with pytest.raises(ValueError, match="several routers of WithReference map to the same decoder layer"):
        fit(WithReference(), [copy.deepcopy(seven)], RouterReplayCallback())
    module = WithReference()
    fit(module, [copy.deepcopy(seven)], RouterReplayCallback(model_attr="model"))
    layout, used = module.whole[0]
    assert replayed_in_layout(layout, used, seven)


# ------------------------------------------------------------------- 3 ranks, unequal shards
SHARDS = [[5, 9, 4], [7], [6, 8]]


def expected_counts(batch):
    """(route rows, native hits) per MoE layer, from router outputs seen before the replay hook."""
    model = build_tiny_moe(seed=0)
    from r3lightning.replay.hf.replay import HFRouterReplay

    backend = HFRouterReplay.for_model(model)
    native, handles = {}, []
    for layer, router in zip(backend.moe_layers, backend.routers, strict=True):
        handles.append(
            router.register_forward_hook(
                lambda m, a, out, layer=layer: native.update({layer: out[2]}), prepend=True
            )
        )
    mask = captured_mask(batch)
    routes = dense_engine_routes(batch)
    with torch.no_grad(), replay_routes(model, routes, mask):
        model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask.long(),
            position_ids=position_ids(batch.attention_mask),
        )
    for h in handles:
        h.remove()
    hits = []
    for layer in backend.moe_layers:
        own = native[layer].reshape(*mask.shape, 2)[mask]
        ours = routes[mask][:, layer]
        hits.append(int((ours.unsqueeze(-1) == own.unsqueeze(-2)).any(-1).sum()))
    return int(mask.sum()), hits


def _ddp_fit(rank, shards, expected):
    import os

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    import torch.distributed as dist

    reduces = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        reduces.append(args[0].shape)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    callback_vector_shape = torch.Size([4 * 4 + 2])  # [4 counts, num_layers] + 2 scalars
    for sync_dist, log_agreement in ((True, True), (False, True), (True, False)):
        logger = MemoryLogger()
        callback = RouterReplayCallback(sync_dist=sync_dist, log_agreement=log_agreement)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=3,
            strategy="ddp",
            max_epochs=1,
            logger=logger,
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[callback],
            use_distributed_sampler=False,
        )
        before = len(reduces)
        trainer.fit(Whole(), loader([shards[rank]]))
        if not log_agreement:
            assert not [k for row in logger.rows for k in row if k.startswith("router_replay/")]
            assert all(shape != callback_vector_shape for shape in reduces[before:])
            continue
        row = logger.rows[0]
        values = {k: v for k, v in row.items() if "agreement" in k or "fraction" in k}
        assert values and all(v <= 1.0 for v in values.values()), values
        assert (callback_vector_shape in reduces[before:]) == sync_dist
        rows, hits = expected[rank] if not sync_dist else expected["global"]
        assert row["router_replay/native_agreement"] == pytest.approx(sum(hits) / (rows * 2 * 3), abs=1e-7)
        for i, layer in enumerate(LAYERS):
            assert row[f"router_replay/native_agreement/layer_{layer:02d}"] == pytest.approx(
                hits[i] / (rows * 2), abs=1e-7
            )
    dist.all_reduce = real_all_reduce


@pytest.mark.slow
def test_three_ranks_with_unequal_shards_log_the_exact_global_ratio():
    """sync_dist=True: the global ratio (sums of hits and slots), not a mean of the ranks' ratios;
    sync_dist=False: each rank's own; log_agreement=False: no metric and no reduction."""
    shards = [make_batch(20 + r, lengths, dropped_rows=1 + r) for r, lengths in enumerate(SHARDS)]
    expected = {r: expected_counts(b) for r, b in enumerate(shards)}
    rows = sum(expected[r][0] for r in range(3))
    hits = [sum(expected[r][1][i] for r in range(3)) for i in range(3)]
    expected["global"] = (rows, hits)
    global_ratio = sum(hits) / (rows * 6)
    mean_of_ratios = sum(sum(expected[r][1]) / (expected[r][0] * 6) for r in range(3)) / 3
    assert abs(global_ratio - mean_of_ratios) > 1e-4  # the shards are unequal enough to tell apart
    run_ranks(_ddp_fit, shards, expected, nprocs=3)


# ------------------------------------------------------------------ sub-batches of a RolloutBatch
def test_sub_batches_keep_their_routes_and_know_their_rows(seven):
    shuffled = seven.select([6, 0, 3, 1, 5, 2, 4])
    assert shuffled.rows_in(seven).tolist() == [6, 0, 3, 1, 5, 2, 4]
    assert seven.select(torch.tensor([True, False] * 3 + [True])).rows_in(seven).tolist() == [0, 2, 4, 6]
    parts = [mb.trim() for mb in shuffled.split([3, 2, 2])]
    assert [mb.rows_in(seven).tolist() for mb in parts] == [[6, 0, 3], [1, 5], [2, 4]]
    assert parts[1].rows_in(shuffled).tolist() == [3, 4]  # cut from a cut
    for mb in (*parts, *seven.chunk(3), seven[2:5].trim()):
        for i, row in enumerate(mb.rows_in(seven).tolist()):
            assert torch.equal(mb.routed_experts[i], seven.routed_experts[row])
            n = int(seven.sequence_lengths[row])
            assert torch.equal(mb.input_ids[i, mb.width - n :], seven.input_ids[row, seven.width - n :])
    assert seven.rows_in(seven).tolist() == list(range(7))
    assert seven.repeat(2).rows_in(seven) is None  # new rows, not a cut
    assert make_batch(11, [5, 9]).rows_in(seven) is None
    with pytest.raises(TypeError, match="select takes row positions or a bool mask"):
        seven.select(2)


def test_readme_micro_batch_example_replays_every_micro_batch(seven, tmp_path, monkeypatch):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    body = readme.split("\n## Micro-batches and several passes per rollout batch\n", 1)[1].split("\n## ", 1)[
        0
    ]
    (code,) = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    module = scope["PPOPolicy"](build_tiny_moe(seed=0))
    forwards = []
    backend = RouterReplayCallback()

    def spy(*args):  # every micro-batch forward, with the routes installed for it
        layout = backend.layout  # None: a micro-batch of only the routeless trajectory (native)
        forwards.append((tuple(args[1][0].shape[:2]), None if layout is None else layout.token_shape))

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)  # the example shuffles with torch.randperm
    hook = module.model.model.layers[1].register_forward_pre_hook(spy)
    _, logger = fit(module, [copy.deepcopy(seven)], backend)
    hook.remove()
    assert len(forwards) == 8  # 2 epochs x 4 micro-batches of 2, 2, 2, 1
    assert all(shape == installed for shape, installed in forwards if installed is not None)
    assert sum(installed is None for _, installed in forwards) <= 2  # row 4 alone, once per epoch
    assert logger.series("router_replay/used_agreement") == [1.0]
    assert logger.series("router_replay/replayed_fraction") == [1.0]


@pytest.mark.slow
def test_the_job_runs_strict_against_an_external_engine(tmp_path):
    """An external engine that returns no routes fails the main job (naming the engine flag)
    unless replay.strict=false, which trains natively, warns and counts the batches."""
    import csv

    from r3lightning.job.main import compose_config, run
    from r3lightning.serve.config import EngineConfig
    from r3lightning.serve.server import RolloutServer

    with RolloutServer(
        build_tiny_moe(seed=0), engine=EngineConfig(max_batch_size=64, copy_model=False)
    ) as server:
        base = [
            f"rollout.url={server.url}",
            "rollout.protocol=sglang",
            "replay.request_routes=false",  # as an engine started without routes would answer
            "steps=1",
            "prompts_per_step=2",
            "plot=false",
            "trainer.enable_progress_bar=false",
        ]
        with pytest.raises(
            ValueError, match=r"strict=True\): the batch has no routed_experts.*--enable-return"
        ):
            run(compose_config(base), tmp_path / "strict")
        with pytest.warns(UserWarning, match="--enable-return-routed-experts"):
            run(compose_config([*base, "replay.strict=false"]), tmp_path / "relaxed")
    with open(tmp_path / "relaxed" / "replay_r3" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        logged = [row for row in csv.DictReader(f) if row.get("router_replay/batches_without_routes")]
    assert [float(r["router_replay/batches_without_routes"]) for r in logged] == [1.0]
