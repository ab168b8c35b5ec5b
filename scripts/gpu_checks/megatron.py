"""``megatron``: a megatron-core MoELayer with MegatronRouterReplay against an independent reference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gpu_checks.common import (
    EXPERTS,
    LAYERS,
    TOP_K,
    Skip,
    ensure_process_group,
    expect,
    no_device_syncs,
    random_routes,
)


# ------------------------------------------------------------------------------- check 3: megatron
@contextmanager
def megatron_runtime(device: torch.device) -> Iterator[None]:
    """Process group, ``parallel_state`` and the few shims megatron-core 0.16 needs off its usual
    setup, all undone on exit: without Transformer Engine ``moe_utils.te_general_gemm`` is left
    undefined (``None`` selects megatron's torch path); on the CPU, router weights would be moved
    to ``torch.cuda.current_device()`` and activation recompute would save the CUDA RNG state."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from r3lightning.app.models.megatron_cpu import megatron_device_shims

    with megatron_device_shims(device):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ensure_process_group(device)
        started = not parallel_state.model_parallel_is_initialized()
        if started:
            parallel_state.initialize_model_parallel()
        try:
            if device.type == "cuda":
                tp_random.model_parallel_cuda_manual_seed(0)
            yield
        finally:
            if started:
                parallel_state.destroy_model_parallel()
            RouterReplay.clear_global_router_replay_instances()


def _moe_layer(device: torch.device, **overrides: Any):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=2,
        ffn_hidden_size=48,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K,
        moe_layer_freq=[0, 1, 1, 1],
        moe_enable_routing_replay=True,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **overrides,
    )
    layer = build_module(get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp, config=config)
    layer.set_layer_number(3)  # 1-based: decoder layer index 2
    return layer.to(device)


def check_megatron(device: torch.device) -> dict[str, Any]:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise Skip("megatron-core is not installed (see the docstring for its wheel)") from None
    with megatron_runtime(device):
        return _megatron_replay(device)


def _megatron_replay(device: torch.device) -> dict[str, Any]:
    from r3lightning.align.align import align_packed_token_metadata, build_replay_mask
    from r3lightning.align.dummy import dummy_routes
    from r3lightning.packed import PackedTensor
    from r3lightning.replay.megatron.replay import MegatronRouterReplay

    layer_index = 2
    torch.manual_seed(0)
    layer = _moe_layer(device)
    recomputing = _moe_layer(device, recompute_granularity="selective", recompute_modules=["moe"])
    recomputing.load_state_dict(layer.state_dict())
    expect(recomputing.moe_layer_recompute, "the recompute config did not enable MoE recompute")
    generator = torch.Generator().manual_seed(5)
    lengths = [7, 3, 9, 5]
    captured = [6, 3, 4, 0]  # uncaptured suffixes and one trajectory without routes
    width = max(lengths)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        attention_mask[i, width - n :] = True
    segments = [random_routes(rows, generator) for rows in captured]
    packed = PackedTensor.from_segments(segments)
    if device.type == "cuda":
        packed = packed.pin_memory()
        expect(packed.is_pinned(), "pin_memory() did not pin the routes")
    packed = packed.to(device, non_blocking=True)

    backend = MegatronRouterReplay(layer)
    expect(
        backend.moe_layers == (layer_index,), f"moe_layers {backend.moe_layers}, expected ({layer_index},)"
    )
    layout = backend.build_layout(attention_mask)  # packed [1, T]
    expect(layout.token_shape == (1, sum(lengths)), f"packed token shape {layout.token_shape}")
    with no_device_syncs(device):
        aligned = align_packed_token_metadata(
            packed, layout, pad=lambda n: dummy_routes(n, LAYERS, TOP_K, EXPERTS, device=device)
        )  # [1, T, L, K]
        replay_mask = build_replay_mask(packed, layout)  # [1, T]
    tokens = sum(lengths)
    hidden = torch.randn(tokens, 1, layer.config.hidden_size, generator=generator).to(device)  # [s, b, h]
    target = torch.randn(tokens, 1, layer.config.hidden_size, generator=generator).to(device)

    # independent reference, by plain loops over the packed sequences: installed experts where a
    # row was captured, native top-k of the live logits elsewhere
    weight = layer.router.weight.detach().clone().requires_grad_(True)
    logits = hidden.reshape(tokens, -1) @ weight.t()  # [T, E]
    native = logits.detach().topk(TOP_K, dim=-1).indices.cpu()
    expected = native.clone()
    position = 0
    for n, rows, segment in zip(lengths, captured, segments, strict=True):
        expected[position : position + rows] = segment[:, layer_index].long()
        position += n
    expected_dev = expected.to(device)
    probs = torch.softmax(logits.gather(1, expected_dev), dim=-1)  # softmax over the chosen logits
    with torch.no_grad():
        flat = hidden.reshape(tokens, -1)
        expert_out = torch.stack([layer.experts.local_experts[e](flat)[0] for e in range(EXPERTS)], dim=1)
    chosen = expert_out.gather(1, expected_dev[..., None].expand(-1, -1, expert_out.shape[-1]))  # [T, K, H]
    reference = (probs[..., None] * chosen).sum(1)  # [T, H]
    (reference * target.reshape(tokens, -1)).sum().backward()

    grads, outputs = [], []
    for module in (layer, recomputing):
        replay = MegatronRouterReplay(module)
        module.zero_grad(set_to_none=True)
        replay.install(aligned, replay_mask)
        replay.start_recording()
        out, _ = module(hidden.clone().requires_grad_(True))
        used = replay.stop_recording()  # [1, T, L, K]
        (out * target).sum().backward()
        stats = replay.routing_stats()
        queued = len(module.router.router_replay.replay_backward_list)
        replay.clear()
        if module is recomputing:  # every forward's entry is popped by its recomputation
            expect(queued == 0, f"{queued} recompute entries left queued after backward")
        expect(
            module.router.router_replay.target_topk_idx is None
            and module.router.router_replay.router_replay_action is None,
            "clear() left routes or a replay action on the router",
        )
        differs = (used[0, :, layer_index].long().cpu().sort(-1).values != expected.sort(-1).values).any(-1)
        expect(
            not differs.any(), f"router used other experts than the reference on {int(differs.sum())} tokens"
        )
        rows = sum(captured)
        expect(
            stats["replayed_rows"].tolist() == [rows],
            f"replayed rows {stats['replayed_rows'].tolist()} != [{rows}]",
        )
        outputs.append(out.detach().reshape(tokens, -1))
        grads.append(
            {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
        )
    torch.testing.assert_close(outputs[0], reference.detach(), rtol=1e-4, atol=1e-5)
    router_grad = grads[0]["router.weight"]
    expect(bool(router_grad.abs().sum() > 0), "the router weight got no gradient")
    torch.testing.assert_close(router_grad, weight.grad, rtol=1e-4, atol=1e-5)
    # CUDA's scatter-add in the unpermute is not bit-reproducible: equal up to fp32 rounding
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    expect(grads[0].keys() == grads[1].keys(), "recompute changed which parameters get gradients")
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)
    masked = replay_mask.reshape(-1).cpu()
    native_agreement = (expected[masked, :, None] == native[masked, None, :]).any(-1).float().mean()
    return {
        "tokens": tokens,
        "replayed_rows": int(masked.sum()),
        "native_agreement": float(native_agreement),
        "max_out_err": float((outputs[0] - reference.detach()).abs().max()),
        "max_router_grad_err": float((router_grad - weight.grad).abs().max()),
    }
