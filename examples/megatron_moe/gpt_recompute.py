"""R3 on a real megatron-core ``GPTModel`` (attention, full activation recomputation), checked.

Run on one CUDA GPU (exit status 0 = every check passed)::

    python examples/megatron_moe/gpt_recompute.py

1. a bf16 copy of the model (the "engine", one small update behind) forwards right-padded trajectories and records the
   experts of every MoE layer (megatron ``RECORD``); the ``n - 1`` captured rows per trajectory are
   packed, compacted to uint8, pinned and moved to the GPU with ``non_blocking=True``;
2. the fp32 policy (``recompute_granularity="full"``: every layer is recomputed in backward)
   replays them through :class:`MegatronRouterReplay` on megatron's unpacked ``[B, S]`` layout;
3. checks: the experts used equal the engine's on every captured token and MoE layer, every
   recomputation consumed its queued routes (``REPLAY_BACKWARD``), the routers got gradients, and
   the trainer's native routing disagreed with the engine somewhere (what R3 corrects).
"""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from r3lightning import (
    MegatronRouterReplay,
    PackedTensor,
    align_packed_token_metadata,
    build_replay_mask,
    dummy_routes,
)
from r3lightning.app.models.megatron_cpu import megatron_device_shims

VOCAB, SEQ = 128, 48


def build(config: TransformerConfig, device: torch.device) -> GPTModel:
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    return model.to(device)


def check_gpt_replay(device: torch.device) -> dict[str, bool]:
    """Run steps 1-3 of the module docstring; ``{check: passed}``.

    Needs ``torch.distributed`` and megatron's ``parallel_state`` initialised (TP = CP = PP = 1).
    """
    common = dict(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_moe_experts=16,
        moe_router_topk=4,
        moe_layer_freq=[0, 1, 1, 1],
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
        params_dtype=torch.float32,
        use_cpu_initialization=device.type == "cpu",
    )
    policy = build(
        TransformerConfig(
            **common, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
        device,
    )
    engine = build(TransformerConfig(**common), device).bfloat16()
    engine.load_state_dict(policy.state_dict())
    with torch.no_grad():  # an engine one small update behind the trainer, on top of bf16 numerics
        for param in engine.parameters():
            param.add_(1e-3 * torch.randn_like(param))
    backend, engine_backend = MegatronRouterReplay(policy), MegatronRouterReplay(engine)

    lengths = torch.tensor([17, 48, 5, 30])
    mask = torch.arange(SEQ)[None, :] >= SEQ - lengths[:, None]  # canonical left-padded batch
    input_ids = (torch.randint(1, VOCAB, (len(lengths), SEQ)) * mask).to(device)
    layout = backend.build_layout(mask, packed=False)  # megatron's unpacked path: right-padded
    tokens = layout.from_batch(input_ids)  # [B, S]
    position_ids = layout.position_ids.to(device)

    with torch.no_grad():
        engine_backend.start_recording()
        engine(tokens, position_ids, None)
        recorded = engine_backend.stop_recording()  # [B, S, L, K] int32 on the GPU
    rows = PackedTensor.from_padded(recorded.cpu(), lengths - 1, side="right")  # n - 1 rows each
    rows = rows.to(dtype=torch.uint8)  # compact, as routes travel
    if device.type == "cuda":
        rows = rows.pin_memory()
    routes = rows.to(device=device, non_blocking=True)

    L, K, E = backend.num_layers, backend.top_k, backend.num_experts
    aligned = align_packed_token_metadata(
        routes, layout, pad=lambda n: dummy_routes(n, L, K, E, device=device)
    )
    replay_mask = build_replay_mask(routes, layout)
    labels = layout.from_batch(input_ids, next_token=True)
    has_label = layout.from_batch(mask.to(device), next_token=True, pad=False)
    backend.install(aligned, replay_mask)
    backend.start_recording()
    logits = policy(tokens, position_ids, None).float()  # [B, S, V]
    logprobs = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    (-(logprobs * has_label).sum() / has_label.sum()).backward()
    used = backend.stop_recording()
    stats = backend.routing_stats()
    queued = [len(router.router_replay.replay_backward_list) for router in backend.routers]
    grads = [float(router.weight.grad.abs().sum()) for router in backend.routers]
    backend.clear()

    moe = list(backend.moe_layers)
    real = replay_mask.to(device)
    same = bool((used[real][:, moe] == aligned[real][:, moe].to(used.dtype)).all())
    native = float(stats["agreeing_slots"].sum() / (stats["replayed_rows"].sum() * K))
    return {
        "replayed experts == engine experts on every captured token and MoE layer": same,
        "every recomputation consumed its routes (REPLAY_BACKWARD)": queued == [0] * len(moe),
        "routers got gradients": all(g > 0 for g in grads),
        f"native routing agreed with the engine on {100 * native:.2f}% < 100% of slots": native < 1.0,
    }


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    device = torch.device("cuda")
    with megatron_device_shims(device):
        return run(device)


def run(device: torch.device) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    checks = check_gpt_replay(device)
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
