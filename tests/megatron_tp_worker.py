"""Two-process tensor-parallel check of MegatronRouterReplay (gloo, CPU); run by test_megatron_replay.

Each rank builds the same megatron ``MoELayer`` with TP = 2 and sequence parallelism, takes its
share of the hidden states with megatron's own ``scatter_to_sequence_parallel_region`` (what the
embedding does), installs the *full* ``[1, S, L, K]`` routes and runs forward + backward. Writes
``<out_dir>/rank<r>.json`` per rank: the experts the router used per token, whether the routes
recorded (all-gathered over TP) equal the installed ones, and the router weight's gradient norm. Shims as in test_megatron_replay (CPU-only megatron).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ, HIDDEN, LAYERS, EXPERTS, TOP_K, MOE_LAYER = 8, 16, 4, 8, 2, 2


def worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from r3lightning.replay.megatron import MegatronRouterReplay

    moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        ffn_hidden_size=16,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K,
        moe_enable_routing_replay=True,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    torch.manual_seed(0)
    layer = build_module(get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp, config=config)
    layer.set_layer_number(MOE_LAYER + 1)
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
    rows = [torch.nonzero(row).reshape(-1).tolist() for row in used["map"]]
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "parallelism": [backend.parallelism.tp_size, backend.parallelism.tp_rank],
                "used": rows,
                "routes": routes[0, :, MOE_LAYER].sort(-1).values.tolist(),
                "recorded_equal": bool(
                    torch.equal(recorded[:, :, MOE_LAYER].long(), routes[:, :, MOE_LAYER])
                ),
                "other_layers_zero": not bool(recorded[:, :, [0, 1, 3]].any()),
                "router_grad": float(layer.router.weight.grad.abs().sum()),
            }
        )
    )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    mp.spawn(worker, args=(free_port, sys.argv[1]), nprocs=2)
