"""RouterReplayCallback options: the layout routes follow (``layout_fn``), what is logged
(``log_agreement``: per layer or not), ``model_attr``, and ``sync_dist`` over 3 ranks."""

import copy
import functools

import pytest
import torch
from gloo_ranks import run_ranks
from micro_policy import (
    Whole,
    captured_mask,
    dense_engine_routes,
    replayed_in_layout,
    seven_batch,
)
from replay_policy import LAYERS, MemoryLogger, fit, loader, make_batch, position_ids
from trainers import cpu_trainer

from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.app.models.tiny import build_tiny_moe
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import replay_routes
from r3lightning.replay.metrics import COUNTS


@pytest.fixture(scope="module")
def seven():
    return seven_batch()


def test_layout_fn_changes_the_layout_routes_follow(seven):
    right = RouterReplayCallback(layout_fn=lambda mask: TokenMetadataLayout.padded(mask, side="right"))
    module = Whole()
    fit(module, [copy.deepcopy(seven)], right)
    layout, used = module.whole[0]
    assert layout.side == "right" and replayed_in_layout(layout, used, seven)

    padded = RouterReplayCallback(layout_fn=functools.partial(TokenMetadataLayout.padded, pad_to_multiple=4))
    module = Whole()
    fit(module, [copy.deepcopy(seven)], padded)
    layout, used = module.whole[0]
    assert layout.token_shape == (7, 12) and replayed_in_layout(layout, used, seven)


def test_log_options_and_model_attr(seven):
    quiet = RouterReplayCallback(log_agreement=False)
    _, logger = fit(Whole(), [copy.deepcopy(seven)], quiet)
    assert not [k for row in logger.rows for k in row if k.startswith("router_replay/")]

    flat = RouterReplayCallback(log_agreement=True)
    _, logger = fit(Whole(), [copy.deepcopy(seven)], flat)
    keys = {k for row in logger.rows for k in row if k.startswith("router_replay/")}
    assert "router_replay/native_agreement" in keys and not [k for k in keys if "/layer_" in k]
    with pytest.raises(ValueError, match=r"log_agreement must be true, false or 'per_layer', got 'layers'"):
        RouterReplayCallback(log_agreement="layers")

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
    callback_vector_shape = torch.Size([COUNTS * 4 + 3])  # [COUNTS, num_layers] + 3 scalars
    for sync_dist, log_agreement in ((True, "per_layer"), (False, "per_layer"), (True, False)):
        logger = MemoryLogger()
        callback = RouterReplayCallback(sync_dist=sync_dist, log_agreement=log_agreement)
        trainer = cpu_trainer(
            devices=3,
            strategy="ddp",
            max_epochs=1,
            logger=logger,
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
