"""Two-process tensor-parallel check of MegatronRouterReplay (gloo, CPU); run by test_megatron_replay.

Each rank builds the same megatron ``MoELayer`` with TP = 2 and sequence parallelism, takes its
share of the hidden states with megatron's own ``scatter_to_sequence_parallel_region`` (what the
embedding does), installs the *full* ``[1, S, L, K]`` routes and runs forward + backward. Writes
``<out_dir>/rank<r>.json`` per rank: the experts the router used per token, whether the routes
recorded (all-gathered over TP) equal the installed ones, and the router weight's gradient norm;
then, for a router with expert bias, its token counts per expert after a forward given the
layout's padding mask scattered as ``GPTModel`` does it.
Configs and CPU shims come from megatron_cpu, as in test_megatron_replay.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from gloo_ranks import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SEQ, MOE_LAYER = 8, 2
PADDING = [3, 6, 7]  # padding positions of the [1, SEQ] sequence: some on each TP rank


def worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron_cpu import cpu_shims

    with cpu_shims():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        report = run_rank(rank)
        parallel_state.destroy_model_parallel()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def run_rank(rank: int) -> dict:
    from megatron.core import tensor_parallel
    from megatron_cpu import EXPERTS, HIDDEN, LAYERS, TOP_K, make_config, make_moe_layer

    from r3lightning.replay.megatron.replay import MegatronRouterReplay

    # every layer MoE (megatron's default); only decoder layer MOE_LAYER is built here
    config = make_config(moe_layer_freq=1, tensor_model_parallel_size=2, sequence_parallel=True)
    torch.manual_seed(0)
    layer = make_moe_layer(config, MOE_LAYER + 1)
    backend = MegatronRouterReplay(layer)  # TP size / rank from parallel_state
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(SEQ, 1, HIDDEN, generator=generator)  # [s, b, h], same on both ranks
    routes = torch.rand(1, SEQ, LAYERS, EXPERTS, generator=generator).topk(TOP_K, dim=-1).indices
    used = {}

    def keep_routing_map(module, args, output) -> None:
        used["map"] = output[1].clone()  # [tokens, experts] bool

    layer.router.register_forward_hook(keep_routing_map)
    backend.install(routes)
    backend.start_recording()
    out, _ = layer(tensor_parallel.scatter_to_sequence_parallel_region(hidden))
    out.square().sum().backward()
    recorded = backend.stop_recording()
    backend.clear()
    backend.remove()

    # the router padding mask, [b, s] for the whole sequence, split over TP as GPTModel does
    biased = make_moe_layer(
        make_config(
            moe_layer_freq=1,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
        ),
        MOE_LAYER + 1,
    )
    padding = torch.zeros(1, SEQ, dtype=torch.bool)
    padding[0, PADDING] = True
    local_padding = tensor_parallel.scatter_to_sequence_parallel_region(padding.transpose(0, 1).contiguous())
    biased_backend = MegatronRouterReplay(biased)
    biased_backend.install(routes)
    biased(
        tensor_parallel.scatter_to_sequence_parallel_region(hidden),
        padding_mask=local_padding.transpose(0, 1),
    )
    biased_backend.clear()
    return {
        "rank": rank,
        "parallelism": [backend.parallelism.tp_size, backend.parallelism.tp_rank],
        "used": [torch.nonzero(row).reshape(-1).tolist() for row in used["map"]],
        "routes": routes[0, :, MOE_LAYER].sort(-1).values.tolist(),
        "recorded_equal": bool(torch.equal(recorded[:, :, MOE_LAYER].long(), routes[:, :, MOE_LAYER])),
        "other_layers_zero": not bool(recorded[:, :, [0, 1, 3]].any()),
        "router_grad": float(layer.router.weight.grad.abs().sum()),
        "expert_counts": biased.router.local_tokens_per_expert.tolist(),
    }


if __name__ == "__main__":
    run_ranks(worker, sys.argv[1])
