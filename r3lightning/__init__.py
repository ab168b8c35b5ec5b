"""r3lightning: Rollout Routing Replay (R3) for Mixture-of-Experts RL in PyTorch Lightning.

The package follows the data flow of a route, from the rollout engine to the router:

    rollout/  HTTP client, wire codec, rollout collection over many engines and ranks, and an
              embedded rollout server
    packed    PackedTensor: the ragged container every token-aligned field travels in
    routes    compact integer dtypes of expert ids, shared by every stage
    trace     routes accumulated across the turns of one trajectory
    data/     trajectories, replay buffer, threaded packed collation, the Lightning DataModule
    align/    token layouts (padded, packed, context/tensor parallel) and route alignment
    replay/   router replay backends (Hugging Face, megatron-core) and the Lightning callback
    models/   a tiny MoE for tests and demos; meta-device init and per-rank shard loading

Public names are imported lazily so that ``import r3lightning`` stays cheap and optional
dependencies (transformers, megatron-core) are only imported by the code that needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> defining module (relative to this package)
_EXPORTS: dict[str, str] = {
    "PackedTensor": ".packed",
    "TokenMetadataTrace": ".trace",
    "RoutedExpertTrace": ".trace",
    "TokenMetadataLayout": ".align.layout",
    "split_for_sequence_parallel": ".align.layout",
    "position_ids_from_mask": ".align.layout",
    "align_packed_token_metadata": ".align.align",
    "build_replay_mask": ".align.align",
    "scatter_to_padded_batch": ".align.align",
    "dummy_routes": ".align.dummy",
    "compact_route_dtype": ".routes",
    "encode_routes": ".rollout.wire",
    "decode_routes": ".rollout.wire",
    "RemoteGenerateClient": ".rollout.client",
    "RemoteGenerateResult": ".rollout.client",
    "engine_sampling_params": ".rollout.client_protocol",
    "RemoteGenerateError": ".rollout.errors",
    "RetryableGenerateError": ".rollout.errors",
    "GenerateRequestError": ".rollout.errors",
    "MalformedResponseError": ".rollout.errors",
    "RetriesExhaustedError": ".rollout.errors",
    "RolloutServer": ".rollout.server",
    "RolloutCollector": ".rollout.collector",
    "CollectedRollouts": ".rollout.collector",
    "EnginesUnavailableError": ".rollout.collector",
    "RolloutPrompt": ".rollout.prompts",
    "SamplingConfig": ".rollout.prompts",
    "sampling_seed": ".rollout.prompts",
    "text_reward": ".rollout.prompts",
    "TextReward": ".rollout.prompts",
    "RolloutStats": ".rollout.stats",
    "Trajectory": ".data.trajectory",
    "ReplayBuffer": ".data.buffer",
    "RolloutBatch": ".data.batch",
    "RolloutCollator": ".data.collate",
    "usable_cpu_count": ".data.cpus",
    "collate_pool_size": ".data.cpus",
    "R3DataModule": ".data.datamodule",
    "HFRouterReplay": ".replay.hf",
    "register_router": ".replay.hf_routers",
    "RouterAdapter": ".replay.hf_routers",
    "registered_router_types": ".replay.hf_routers",
    "softmax_then_topk_weights": ".replay.hf_routers",
    "softmax_renormalised_weights": ".replay.hf_routers",
    "mixtral_weights": ".replay.hf_routers",
    "sigmoid_scaled_weights": ".replay.hf_routers",
    "softmax_scaled_weights": ".replay.hf_routers",
    "ernie_weights": ".replay.hf_routers",
    "softmax_over_topk_weights": ".replay.hf_routers",
    "MegatronRouterReplay": ".replay.megatron",
    "MegatronParallelism": ".replay.megatron",
    "megatron_token_layout": ".replay.megatron",
    "megatron_padding_mask": ".replay.megatron",
    "record_routes": ".replay.context",
    "replay_routes": ".replay.context",
    "RouterReplayCallback": ".replay.callback",
    "ExpertLoadMonitor": ".expert_load",
    "expert_load_stats": ".expert_load",
    "tiny_moe_config": ".models.tiny",
    "build_tiny_moe": ".models.tiny",
    "meta_model": ".models.sharded",
    "load_sharded_weights": ".models.sharded",
    "convert_checkpoint": ".models.sharded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'r3lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


# ruff: noqa: F401  (the names below are re-exported through __all__, built from _EXPORTS)
if TYPE_CHECKING:  # static type checkers and IDEs see the eager imports
    from .align.align import align_packed_token_metadata, build_replay_mask, scatter_to_padded_batch
    from .align.dummy import dummy_routes
    from .align.layout import TokenMetadataLayout, position_ids_from_mask, split_for_sequence_parallel
    from .data.batch import RolloutBatch
    from .data.buffer import ReplayBuffer
    from .data.collate import RolloutCollator
    from .data.cpus import collate_pool_size, usable_cpu_count
    from .data.datamodule import R3DataModule
    from .data.trajectory import Trajectory
    from .expert_load import ExpertLoadMonitor, expert_load_stats
    from .models.sharded import convert_checkpoint, load_sharded_weights, meta_model
    from .models.tiny import build_tiny_moe, tiny_moe_config
    from .packed import PackedTensor
    from .replay.callback import RouterReplayCallback
    from .replay.context import record_routes, replay_routes
    from .replay.hf import HFRouterReplay
    from .replay.hf_routers import (
        RouterAdapter,
        ernie_weights,
        mixtral_weights,
        register_router,
        registered_router_types,
        sigmoid_scaled_weights,
        softmax_over_topk_weights,
        softmax_renormalised_weights,
        softmax_scaled_weights,
        softmax_then_topk_weights,
    )
    from .replay.megatron import (
        MegatronParallelism,
        MegatronRouterReplay,
        megatron_padding_mask,
        megatron_token_layout,
    )
    from .rollout.client import RemoteGenerateClient, RemoteGenerateResult
    from .rollout.client_protocol import engine_sampling_params
    from .rollout.collector import CollectedRollouts, EnginesUnavailableError, RolloutCollector
    from .rollout.errors import (
        GenerateRequestError,
        MalformedResponseError,
        RemoteGenerateError,
        RetriesExhaustedError,
        RetryableGenerateError,
    )
    from .rollout.prompts import RolloutPrompt, SamplingConfig, TextReward, sampling_seed, text_reward
    from .rollout.server import RolloutServer
    from .rollout.stats import RolloutStats
    from .rollout.wire import decode_routes, encode_routes
    from .routes import compact_route_dtype
    from .trace import RoutedExpertTrace, TokenMetadataTrace
