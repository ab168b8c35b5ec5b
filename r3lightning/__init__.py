"""r3lightning: Rollout Routing Replay (R3) for Mixture-of-Experts RL in PyTorch Lightning.

``__all__`` is what users of the data module, callback, client, collector and server need, with
every config object their constructors take; the rest is imported from its module. Names resolve
on first use: ``import r3lightning`` imports no Lightning, transformers or megatron-core."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from r3lightning import _aliases
from r3lightning._lazy import LazyExports

__version__ = "0.2.0"

# ruff: noqa: F401
if TYPE_CHECKING:  # the one list of public names: type checkers read it, LazyExports parses it
    from r3lightning.align.align import align_packed_token_metadata, build_replay_mask
    from r3lightning.align.layout import TokenMetadataLayout
    from r3lightning.app.job.algorithm import GRPOAdvantages
    from r3lightning.app.serve.config import EngineConfig, ServerLimits
    from r3lightning.app.serve.server import RolloutServer
    from r3lightning.data.batch import RolloutBatch
    from r3lightning.data.buffer import ReplayBuffer
    from r3lightning.data.datamodule import R3DataModule
    from r3lightning.data.options import DataOptions
    from r3lightning.packed import PackedTensor
    from r3lightning.replay.callback import RouterReplayCallback
    from r3lightning.replay.context import record_routes, replay_routes
    from r3lightning.replay.hf.replay import HFRouterReplay
    from r3lightning.replay.megatron.layout import MegatronParallelism
    from r3lightning.replay.megatron.replay import MegatronRouterReplay
    from r3lightning.rollout.client import RemoteGenerateClient
    from r3lightning.rollout.collector import RolloutCollector
    from r3lightning.rollout.config import CollectorConfig, RetryPolicy
    from r3lightning.rollout.environment import Environments
    from r3lightning.rollout.prompts import RolloutPrompt, SamplingConfig
    from r3lightning.rollout.stats import CollectedRollouts, EnginesUnavailableError
    from r3lightning.rollout.trace import RoutedExpertTrace
    from r3lightning.rollout.trajectory import Trajectory
    from r3lightning.routes import dummy_routes
    from r3lightning.wire.codec import RouteSchema
    from r3lightning.wire.errors import MalformedResponseError, RemoteGenerateError
    from r3lightning.wire.request import RemoteGenerateResult, engine_sampling_params


# a partial, not a lambda: the moved name's warning points at the user's line, a fixed frame count up
_EXPORTS = LazyExports(globals(), __file__, missing=functools.partial(_aliases.moved_attribute, __name__))
__all__ = _EXPORTS.names
__getattr__ = _EXPORTS.getattr
__dir__ = _EXPORTS.dir
_aliases.install()
