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
    "PackedTensor": "r3lightning.packed",
    "TokenMetadataTrace": "r3lightning.trace",
    "RoutedExpertTrace": "r3lightning.trace",
    "TokenMetadataLayout": "r3lightning.align.layout",
    "split_for_sequence_parallel": "r3lightning.align.layout",
    "position_ids_from_mask": "r3lightning.align.layout",
    "align_packed_token_metadata": "r3lightning.align.align",
    "build_replay_mask": "r3lightning.align.align",
    "scatter_to_padded_batch": "r3lightning.align.align",
    "dummy_routes": "r3lightning.align.dummy",
    "compact_route_dtype": "r3lightning.routes",
    "encode_routes": "r3lightning.wire.codec",
    "decode_routes": "r3lightning.wire.codec",
    "RemoteGenerateClient": "r3lightning.rollout.client",
    "RemoteGenerateResult": "r3lightning.rollout.client",
    "engine_sampling_params": "r3lightning.wire.request",
    "RemoteGenerateError": "r3lightning.wire.errors",
    "RetryableGenerateError": "r3lightning.wire.errors",
    "GenerateRequestError": "r3lightning.wire.errors",
    "MalformedResponseError": "r3lightning.wire.errors",
    "RetriesExhaustedError": "r3lightning.wire.errors",
    "RolloutServer": "r3lightning.serve.server",
    "RolloutCollector": "r3lightning.rollout.collector",
    "CollectedRollouts": "r3lightning.rollout.collector",
    "EnginesUnavailableError": "r3lightning.rollout.collector",
    "RolloutPrompt": "r3lightning.rollout.prompts",
    "SamplingConfig": "r3lightning.rollout.prompts",
    "sampling_seed": "r3lightning.rollout.prompts",
    "text_reward": "r3lightning.rollout.prompts",
    "TextReward": "r3lightning.rollout.prompts",
    "RolloutStats": "r3lightning.rollout.stats",
    "Trajectory": "r3lightning.data.trajectory",
    "ReplayBuffer": "r3lightning.data.buffer",
    "RolloutBatch": "r3lightning.data.batch",
    "RolloutCollator": "r3lightning.data.collate",
    "usable_cpu_count": "r3lightning.data.cpus",
    "collate_pool_size": "r3lightning.data.cpus",
    "R3DataModule": "r3lightning.data.datamodule",
    "HFRouterReplay": "r3lightning.replay.hf.replay",
    "register_router": "r3lightning.replay.hf.routers",
    "RouterAdapter": "r3lightning.replay.hf.routers",
    "registered_router_types": "r3lightning.replay.hf.routers",
    "softmax_then_topk_weights": "r3lightning.replay.hf.routers",
    "softmax_renormalised_weights": "r3lightning.replay.hf.routers",
    "mixtral_weights": "r3lightning.replay.hf.routers",
    "sigmoid_scaled_weights": "r3lightning.replay.hf.routers",
    "softmax_scaled_weights": "r3lightning.replay.hf.routers",
    "ernie_weights": "r3lightning.replay.hf.routers",
    "softmax_over_topk_weights": "r3lightning.replay.hf.routers",
    "MegatronRouterReplay": "r3lightning.replay.megatron.replay",
    "MegatronParallelism": "r3lightning.replay.megatron.replay",
    "megatron_token_layout": "r3lightning.replay.megatron.replay",
    "megatron_padding_mask": "r3lightning.replay.megatron.replay",
    "record_routes": "r3lightning.replay.context",
    "replay_routes": "r3lightning.replay.context",
    "RouterReplayCallback": "r3lightning.replay.callback",
    "ExpertLoadMonitor": "r3lightning.replay.expert_load",
    "expert_load_stats": "r3lightning.replay.expert_load",
    "tiny_moe_config": "r3lightning.testing.tiny",
    "build_tiny_moe": "r3lightning.testing.tiny",
    "meta_model": "r3lightning.job.sharded",
    "load_sharded_weights": "r3lightning.job.sharded",
    "convert_checkpoint": "r3lightning.job.sharded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'r3lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


# ruff: noqa: F401  (the names below are re-exported through __all__, built from _EXPORTS)
if TYPE_CHECKING:  # static type checkers and IDEs see the eager imports
    from r3lightning.align.align import (
        align_packed_token_metadata,
        build_replay_mask,
        scatter_to_padded_batch,
    )
    from r3lightning.align.dummy import dummy_routes
    from r3lightning.align.layout import (
        TokenMetadataLayout,
        position_ids_from_mask,
        split_for_sequence_parallel,
    )
    from r3lightning.data.batch import RolloutBatch
    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.data.collate import RolloutCollator
    from r3lightning.data.cpus import collate_pool_size, usable_cpu_count
    from r3lightning.data.datamodule import R3DataModule
    from r3lightning.data.trajectory import Trajectory
    from r3lightning.job.sharded import convert_checkpoint, load_sharded_weights, meta_model
    from r3lightning.packed import PackedTensor
    from r3lightning.replay.callback import RouterReplayCallback
    from r3lightning.replay.context import record_routes, replay_routes
    from r3lightning.replay.expert_load import ExpertLoadMonitor, expert_load_stats
    from r3lightning.replay.hf.replay import HFRouterReplay
    from r3lightning.replay.hf.routers import (
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
    from r3lightning.replay.megatron.replay import (
        MegatronParallelism,
        MegatronRouterReplay,
        megatron_padding_mask,
        megatron_token_layout,
    )
    from r3lightning.rollout.client import RemoteGenerateClient, RemoteGenerateResult
    from r3lightning.rollout.collector import CollectedRollouts, EnginesUnavailableError, RolloutCollector
    from r3lightning.rollout.prompts import (
        RolloutPrompt,
        SamplingConfig,
        TextReward,
        sampling_seed,
        text_reward,
    )
    from r3lightning.rollout.stats import RolloutStats
    from r3lightning.routes import compact_route_dtype
    from r3lightning.serve.server import RolloutServer
    from r3lightning.testing.tiny import build_tiny_moe, tiny_moe_config
    from r3lightning.trace import RoutedExpertTrace, TokenMetadataTrace
    from r3lightning.wire.codec import decode_routes, encode_routes
    from r3lightning.wire.errors import (
        GenerateRequestError,
        MalformedResponseError,
        RemoteGenerateError,
        RetriesExhaustedError,
        RetryableGenerateError,
    )
    from r3lightning.wire.request import engine_sampling_params
