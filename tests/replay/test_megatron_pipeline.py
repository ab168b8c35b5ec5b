"""MegatronRouterReplay with virtual pipeline chunks in megatron's interleaved order, fused routers,
the router padding mask and the fp8 packed layout, against real megatron-core modules on CPU."""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.pipeline_parallel.schedules import get_schedule_table
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron_cpu import (
    EXPERTS,
    HIDDEN,
    LAYERS,
    TOP_K,
    UsedExperts,
    make_config,
    make_moe_layer,
    megatron_cpu,  # noqa: F401 (the module's fixture)
    sorted_rows,
    stage_routes,
)

from r3lightning.align.dummy import dummy_routes
from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.replay.megatron.replay import (
    MegatronParallelism,
    MegatronRouterReplay,
    megatron_padding_mask,
    megatron_token_layout,
)

pytestmark = pytest.mark.usefixtures("megatron_cpu")


def test_virtual_pipeline_chunks_replay_each_micro_batch_in_megatrons_interleaved_order(monkeypatch):
    """Two model chunks (virtual stages) of a PP = 2 stage, run in the order megatron's interleaved
    schedule gives (its own schedule table) with MoE recompute: each chunk's layers use the routes
    of the micro-batch megatron runs there, in forwards and recomputes; installing on every chunk
    at once would hand chunk 1 micro-batches it has not reached."""
    num_layers, chunks, micro_batches, tokens = 8, 2, 4, 5
    config = make_config(
        num_layers=num_layers,
        moe_layer_freq=[0] + [1] * (num_layers - 1),
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=chunks,
        pipeline_dtype=torch.float32,
        recompute_granularity="selective",
        recompute_modules=["moe"],
    )
    tracker = tp_random.get_cuda_rng_tracker()  # attention dropout forks a CUDA RNG: a no-op here
    monkeypatch.setattr(tracker, "fork", lambda *args, **kwargs: contextlib.nullcontext())
    torch.manual_seed(13)
    model = [
        TransformerBlock(
            config, get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp), vp_stage=vp
        )
        for vp in range(chunks)
    ]
    backend = MegatronRouterReplay(model)
    # pipeline rank 0 of 2 holds decoder layers 0-1 (chunk 0) and 4-5 (chunk 1); layer 0 is dense
    assert backend.moe_layers == (1, 4, 5) and backend.vp_stages == (0, 1, 1)
    wrapped = torch.nn.ModuleDict({"module": model[1]})  # a DDP / Float16Module-like wrapper
    assert [backend.vp_stage_of(model[0]), backend.vp_stage_of(wrapped)] == [0, 1]
    with pytest.raises(ValueError, match=r"routers of virtual stages \[0, 1\]"):
        backend.vp_stage_of(torch.nn.ModuleList(model))
    routes = [stage_routes(tokens, num_layers, seed=40 + m) for m in range(micro_batches)]
    hidden = [torch.randn(tokens, 1, HIDDEN, requires_grad=True) for _ in range(micro_batches)]
    causal = torch.ones(1, 1, tokens, tokens, dtype=torch.bool).triu(1)
    used = UsedExperts(backend.routers)
    # [(micro-batch, chunk)] with megatron's default group size (the pipeline size)
    schedule = get_schedule_table(micro_batches, chunks, config.pipeline_model_parallel_size)
    assert schedule[:4] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    outputs = {}
    for micro_batch, chunk in schedule:  # forward_step_func per (micro-batch, chunk)
        backend.install(routes[micro_batch], vp_stage=backend.vp_stage_of(model[chunk]))
        outputs[micro_batch, chunk] = model[chunk](hidden[micro_batch], attention_mask=causal)
    forwards = list(used.calls)
    used.calls.clear()
    for micro_batch, chunk in schedule:  # backward: chunks in reverse, micro-batches in order
        outputs[micro_batch, chunks - 1 - chunk].pow(2).sum().backward()
    backend.clear()
    used.remove()
    expected_forwards = [
        (layer, sorted_rows(routes[m], layer))
        for m, chunk in schedule
        for layer, stage in zip(backend.moe_layers, backend.vp_stages, strict=True)
        if stage == chunk
    ]
    assert forwards == expected_forwards
    expected_recomputes = [
        (layer, sorted_rows(routes[m], layer))
        for m, chunk in schedule
        for layer, stage in reversed(list(zip(backend.moe_layers, backend.vp_stages, strict=True)))
        if stage == chunks - 1 - chunk
    ]
    assert used.calls == expected_recomputes


def test_fused_router_replays_through_the_unfused_top_k_and_keeps_the_fused_kernel_otherwise():
    config = make_config()
    config.moe_router_fusion = True  # set after construction: megatron's check wants TE installed
    torch.manual_seed(14)
    layer = make_moe_layer(config, 2)
    hidden = torch.randn(4, 1, HIDDEN)
    backend = MegatronRouterReplay(layer)
    # nothing installed: megatron's fused Transformer Engine top-k runs (absent on this machine)
    with pytest.raises(ValueError, match="fused_topk_with_score_function is not available"):
        layer(hidden)
    routes = stage_routes(4, LAYERS, seed=5)
    backend.install(routes)
    used = UsedExperts(backend.routers)
    out = layer(hidden)[0]
    used.remove()
    assert used.calls == [(1, sorted_rows(routes, 1))]
    out.pow(2).sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert config.moe_router_fusion  # the shared config is never changed
    backend.clear()
    with pytest.raises(ValueError, match="fused_topk_with_score_function is not available"):
        layer(hidden)
    backend.start_recording()  # recording also needs megatron's RouterReplay, so the unfused path
    layer(hidden)
    assert backend.stop_recording().shape == (1, 4, LAYERS, TOP_K)
    backend.remove()
    assert layer.router.config is config


def test_padding_mask_keeps_padding_out_of_expert_bias_and_aux_loss():
    """The packed layout's padding, handed to megatron as its padding_mask, is left out of the
    expert-bias token counts and the aux loss: both equal a forward over the real tokens alone."""
    config = make_config(
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1.0,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    )
    torch.manual_seed(15)
    layer = make_moe_layer(config, 2).train()
    attention_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    layout = megatron_token_layout(attention_mask, parallelism=MegatronParallelism(tp_size=2))
    padding = megatron_padding_mask(layout)
    assert padding.tolist() == [[False, False, False, True, False, False, False, False]]  # [seq0, pad, seq1]
    real = ~padding[0]
    tokens = layout.num_positions
    hidden = torch.randn(tokens, 1, HIDDEN)
    routes = dummy_routes(tokens, LAYERS, TOP_K, EXPERTS).reshape(1, tokens, LAYERS, TOP_K)
    backend = MegatronRouterReplay(layer)
    counts, aux_losses = [], []
    # the padded row with megatron's padding mask; the real tokens alone, no mask
    for x, rows, padding_mask in ((hidden, routes, padding), (hidden[real], routes[:, real], None)):
        layer.router.local_tokens_per_expert.zero_()
        moe_utils.clear_aux_losses_tracker()
        backend.install(rows)
        layer(x, padding_mask=padding_mask)
        backend.clear()
        counts.append(layer.router.local_tokens_per_expert.clone())
        aux_losses.append(
            moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"][1].item()
        )
    expected = torch.zeros(EXPERTS)
    for row in routes[0, real, 1].long():
        expected[row] += 1
    assert counts[0].tolist() == expected.tolist() == counts[1].tolist()
    assert aux_losses[0] == pytest.approx(aux_losses[1], rel=1e-6) and aux_losses[0] > 0
    # without the mask the padding row counts in both: the checks above are not vacuous
    layer.router.local_tokens_per_expert.zero_()
    moe_utils.clear_aux_losses_tracker()
    backend.install(routes)
    layer(hidden)
    backend.clear()
    assert layer.router.local_tokens_per_expert.sum().item() == tokens * TOP_K
    unmasked = moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"][1].item()
    assert unmasked != pytest.approx(aux_losses[1], rel=1e-6)


def fp8_reference(lengths, tp, cp, cp_rank):
    """Per position of this CP rank: (sequence, offset) or None, and the padded offsets, by loops:
    sequences padded to lcm(16, align), the row to 128 * align by the last sequence."""
    align = 2 * tp * cp if cp > 1 else tp
    per_sequence = align
    while per_sequence % 16:
        per_sequence += align
    spans = []
    for n in lengths:
        padded = n
        while padded % per_sequence:
            padded += 1
        spans.append(padded)
    while sum(spans) % (128 * align):
        spans[-1] += 1
    positions, offsets = [], [0]
    for i, (n, span) in enumerate(zip(lengths, spans, strict=True)):
        cells = [(i, j) if j < n else None for j in range(span)]
        chunk = span // (2 * cp)
        kept = cells[cp_rank * chunk : (cp_rank + 1) * chunk] if cp > 1 else cells
        if cp > 1:
            second = 2 * cp - 1 - cp_rank
            kept = kept + cells[second * chunk : (second + 1) * chunk]
        positions += kept
        offsets.append(offsets[-1] + span)
    return positions, offsets


@pytest.mark.parametrize(("tp", "cp"), [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (4, 1)])
def test_fp8_packed_layout_matches_a_loop_reference_on_every_rank(tp, cp):
    lengths = [5, 17, 1, 40]
    width = max(lengths)
    mask = torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]
    covered = 0
    for cp_rank in range(cp):
        par = MegatronParallelism(tp_size=tp, cp_size=cp, cp_rank=cp_rank, sequence_parallel=tp > 1)
        layout = megatron_token_layout(mask, parallelism=par, fp8=True)
        positions, offsets = fp8_reference(lengths, tp, cp, cp_rank)
        got = [
            None if s < 0 else (s, o)
            for s, o in zip(layout.position_sequence.tolist(), layout.position_offset.tolist(), strict=True)
        ]
        assert got == positions
        assert layout.cu_seqlens_padded.tolist() == offsets
        assert offsets[-1] % (128 * par.pad_to_multiple) == 0
        assert all(
            b - a >= 0 and (b - a) % math.lcm(16, par.pad_to_multiple) == 0
            for a, b in itertools.pairwise(offsets)
        )
        covered += sum(p is not None for p in got)
    assert covered == sum(lengths)  # every real token on exactly one CP rank
    plain = megatron_token_layout(mask, parallelism=MegatronParallelism(tp_size=tp, cp_size=cp))
    assert plain.num_positions < layout.num_positions  # the option really pads more


def test_fp8_layout_option_and_backend_default():
    with pytest.raises(
        ValueError, match=r"pad_total_to_multiple \(6\) must be a multiple of pad_to_multiple \(4\)"
    ):
        TokenMetadataLayout.packed([3], pad_to_multiple=4, pad_total_to_multiple=6)
    layout = TokenMetadataLayout.packed([3, 2], pad_to_multiple=2, pad_total_to_multiple=10)
    assert layout.cu_seqlens_padded.tolist() == [0, 4, 10] and layout.position_ids[0, 4:].tolist() == list(
        range(6)
    )
    with pytest.raises(ValueError, match="fp8 padding applies to the packed layout"):
        megatron_token_layout(torch.ones(1, 3, dtype=torch.bool), packed=False, fp8=True)
    layer = make_moe_layer(make_config(), 2)
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert MegatronRouterReplay(layer).build_layout(mask).num_positions == 3
    fp8_layer = make_moe_layer(make_config(), 2)
    fp8_config = make_config()
    fp8_config.fp8 = "e4m3"  # what the backend reads (no fp8 kernel runs here)
    fp8_layer.router.config = fp8_config
    assert MegatronRouterReplay(fp8_layer).build_layout(mask).num_positions == 128
    assert MegatronRouterReplay(fp8_layer).build_layout(mask, fp8=False).num_positions == 3
