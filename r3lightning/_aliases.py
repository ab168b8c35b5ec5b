"""Old import paths of the names and modules that moved in 0.2 (kept until 0.3) and since 0.2.0
(kept until 0.4), with a ``DeprecationWarning`` naming the new path and the release that removes
the old one: moved modules through one meta-path finder, names through their package's
``__getattr__`` (`moved_attribute`). The CHANGELOG's migration tables list the same moves (a test
keeps them equal)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

REMOVED_IN = "0.3"  # the paths that moved in 0.2
REMOVED_IN_SINCE_0_2 = "0.4"  # the paths that moved after 0.2.0: a release of warnings first


def _table(groups: dict[str, str]) -> dict[str, str]:
    """``{"old.package": "old:new ..."}`` (``old`` alone: the same name) as old path -> new path."""
    return {
        f"r3lightning.{old}": f"{package}.{new or old}"
        for package, pairs in groups.items()
        for old, _, new in (pair.partition(":") for pair in pairs.split())
    }


# moved modules, by the package holding them now: "old:new" paths (old below r3lightning). A moved
# package's modules move with it: ``r3lightning.serve.server`` is ``r3lightning.app.serve.server``.
_MOVED_MODULES = {
    "r3lightning": "expert_load:replay.expert_load replay.hf_routers:replay.hf.routers "
    "replay.megatron_layout:replay.megatron.layout replay.megatron_router:replay.megatron.router "
    "replay.replay_metrics:replay.metrics trace:rollout.trace",
    "r3lightning.app": "serve job testing:models models:models models.tiny:models.tiny "
    "models.tiny_tokenizer:models.tiny_tokenizer models.sharded:job.sharded job.megatron:models.tiny_megatron "
    "replay.megatron_cpu:models.megatron_cpu correction.grpo:job.grpo job.grpo:job.grpo "
    "job.prompts_file:tasks.prompts_file rollout.prompts_file:tasks.prompts_file "
    "job.rewards:tasks.rewards rollout.rewards:tasks.rewards job.task:tasks.token_class "
    "rollout.tasks:tasks.token_class rollout.calculator:tasks.calculator",
    "r3lightning.app.serve": "rollout.cli:cli rollout.engine:engine rollout.invariance:invariance "
    "rollout.perturb:perturb rollout.sampling:sampling rollout.server:server "
    "rollout.server_protocol:protocol rollout.weights:weights",
    "r3lightning.wire": "rollout.client_protocol:request rollout.client_response:response "
    "rollout.errors:errors rollout.json_body:json_body rollout.route_check:route_check rollout.wire:codec",
}
# since 0.2.0: no layer imports a later one (the trajectory a rollout makes sits in rollout/, the
# worker that feeds the streaming buffer in data/)
_MOVED_MODULES_SINCE_0_2 = {
    "r3lightning.rollout": "data.trajectory:trajectory",
    "r3lightning.data": "rollout.ahead:ahead",
}
_SINCE_0_2 = _table(_MOVED_MODULES_SINCE_0_2)
MODULES = {**_table(_MOVED_MODULES), **_SINCE_0_2}

# flat modules that became packages: the package serves the old names from the module they are in now
FLAT_MODULES: dict[str, str] = {
    "r3lightning.replay.hf": "r3lightning.replay.hf.replay",
    "r3lightning.replay.megatron": "r3lightning.replay.megatron.replay",
}

# names that left the top level, by the module holding them now ("old:new" where renamed)
_MOVED_NAMES = {
    "r3lightning.rollout.trace": "TokenMetadataTrace",
    "r3lightning.routes": "compact_route_dtype",
    "r3lightning.wire.codec": "encode_routes decode_routes",
    "r3lightning.wire.errors": "RetryableGenerateError GenerateRequestError RetriesExhaustedError",
    "r3lightning.align.layout": "split_for_sequence_parallel position_ids_from_mask",
    "r3lightning.align.align": "scatter_to_padded_batch",
    "r3lightning.data.collate": "RolloutCollator",
    "r3lightning.data.cpus": "usable_cpu_count collate_pool_size",
    "r3lightning.rollout.prompts": "sampling_seed text_reward TextReward",
    "r3lightning.rollout.stats": "RolloutStats",
    "r3lightning.replay.hf.routers": "register_router RouterAdapter registered_router_types "
    "mixtral_weights ernie_weights softmax_then_topk_weights:qwen3_moe_weights "
    "softmax_renormalised_weights:qwen3_5_moe_weights sigmoid_scaled_weights:deepseek_v3_weights "
    "softmax_scaled_weights:deepseek_v2_weights softmax_over_topk_weights:gpt_oss_weights",
    "r3lightning.replay.megatron.layout": "megatron_token_layout megatron_padding_mask",
    "r3lightning.replay.expert_load": "ExpertLoadMonitor expert_load_stats",
    "r3lightning.app.models.tiny": "tiny_moe_config build_tiny_moe",
    "r3lightning.app.job.sharded": "meta_model load_sharded_weights convert_checkpoint",
}
NAMES = _table(_MOVED_NAMES)


def removed_in(old: str) -> str:
    """The release that removes the old path ``old`` (a moved module, a module of a moved package,
    or a moved name).

    Args:
        old: A dotted path the tables above list, or a module below one of their packages.

    Returns:
        `REMOVED_IN_SINCE_0_2` for the moves made after 0.2.0, else `REMOVED_IN`.
    """
    package = old
    while package:
        if package in _SINCE_0_2:
            return REMOVED_IN_SINCE_0_2
        package = package.rpartition(".")[0]
    return REMOVED_IN


def _message(old: str, new: str) -> str:
    return f"{old} moved to {new}; the old path is removed in {removed_in(old)}"


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(_message(old, new), DeprecationWarning, stacklevel=stacklevel + 1)


def moved_attribute(package: str, name: str) -> Any:
    """``package.name`` from its new place, with the warning; ``AttributeError`` if it never moved."""
    new = NAMES.get(f"{package}.{name}")
    if new is None and package in FLAT_MODULES and not name.startswith("_"):
        module = importlib.import_module(FLAT_MODULES[package])
        if hasattr(module, name):
            value = getattr(module, name)
            new = f"{getattr(value, '__module__', module.__name__)}.{name}"
    if new is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module_name, _, attribute = new.rpartition(".")
    value = getattr(importlib.import_module(module_name), attribute)
    _warn(f"{package}.{name}", new, stacklevel=3)  # the user's line, past the package's __getattr__
    vars(sys.modules[package])[name] = value  # once: ``from package import name`` looks twice
    return value


def new_module_path(old: str) -> str | None:
    """The path a moved module has now: its own entry, else its moved package's path with the same
    tail (the longest such package); None if it never moved."""
    if old in MODULES:
        return MODULES[old]
    package = old
    while "." in package:
        package, _, _ = package.rpartition(".")
        if package in MODULES:
            return MODULES[package] + old[len(package) :]
    return None


class _MovedModules:
    """Finder and loader of an old module path: the module at the new path, the same object.

    ``python -m <old path>`` works too: runpy asks the loader for the new module's code.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = new_module_path(fullname)
        if new is None:
            return None
        found = importlib.util.find_spec(new)
        if found is None:  # a moved package never had this module: the usual ModuleNotFoundError
            return None
        # the new file as the origin: what ``python -m`` puts in sys.argv[0]
        return importlib.machinery.ModuleSpec(fullname, self, origin=found.origin)

    def create_module(self, spec: Any) -> None:
        return None  # a placeholder that exec_module replaces in sys.modules

    def exec_module(self, module: ModuleType) -> None:
        new = new_module_path(module.__name__)
        assert new is not None  # find_spec answered only for moved paths
        _warn(module.__name__, new, stacklevel=2)  # the import line: warnings skips importlib's frames
        sys.modules[module.__name__] = importlib.import_module(new)

    def get_code(self, fullname: str) -> Any:
        """The new module's code object, which ``python -m`` runs as ``__main__``."""
        new = new_module_path(fullname)
        spec = None if new is None else importlib.util.find_spec(new)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
            raise ImportError(f"no code for {fullname}", name=fullname)
        message = _message(fullname, new)
        # shown by the default filters, which show a DeprecationWarning only in __main__
        warnings.warn_explicit(message, DeprecationWarning, fullname, 0, module="__main__")
        return spec.loader.get_code(new)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): an old path never loads a second copy."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())
