"""The job config's schema, registered in Hydra's ConfigStore as ``r3lightning_job``.

``conf/config.yaml`` starts its defaults list with it, so every group option and command-line
override is merged onto typed nodes: Hydra refuses a wrong type or an unknown key while it
composes. The typed nodes are made by `structured` from the settings
dataclasses; the ``_target_`` nodes (model, task, reward, module, callbacks, loggers, trainer)
stay open, since users put their own classes and keywords there. ``algorithm`` is ``GRPOConfig``
with ``GRPOAdvantages.std_eps`` and ``optim`` (``OptimConfig``); ``rollout`` holds
``AheadConfig.max_staleness``. Also where the YAML files live (`CONF_DIR`) and the resolver they use.

Nothing here, nor in the modules it imports, imports torch, Lightning, transformers or
megatron-core: a refused value is reported without them (tests/job/test_config_torch_free.py).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Optional, cast

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from r3lightning.app.job.algorithm import GRPOAdvantages, GRPOConfig
from r3lightning.app.job.schema import structured
from r3lightning.app.job.settings import (
    DataModuleSettings,
    OptimConfig,
    ReplaySettings,
    RolloutSettings,
    RunSettings,
    ServerAddress,
    WeightSyncSettings,
)
from r3lightning.app.serve.config import EngineConfig, ServerLimits
from r3lightning.app.vllm.settings import VllmSettings
from r3lightning.data.options import DataOptions
from r3lightning.rollout.config import AheadConfig, CollectorConfig, RetryPolicy
from r3lightning.rollout.prompts import SamplingConfig

__all__ = ["CONF_DIR", "SCHEMA_NAME", "job_schema", "register", "replay_settings"]

SCHEMA_NAME = "r3lightning_job"
DATA_OPTIONS_TARGET = "r3lightning.data.datamodule.DataOptions"

# A wheel carries the configs inside the package (setup.py copies them at build time); a source
# checkout or an editable install reads the repository's top-level conf/.
_PACKAGED_CONF = Path(__file__).resolve().parents[2] / "conf"
CONF_DIR = _PACKAGED_CONF if _PACKAGED_CONF.is_dir() else Path(__file__).resolve().parents[3] / "conf"
# ${product:a,b} in conf/config.yaml (e.g. the batch size of one whole RL step)
OmegaConf.register_new_resolver("product", lambda a, b: int(a) * int(b), replace=True)


def replay_settings(cfg: DictConfig, mode: str) -> DictConfig:
    """``cfg`` with its ``replay`` group swapped for another option of the group.

    Args:
        cfg: The job's config.
        mode: The option: ``conf/replay/<mode>.yaml`` (``r3``, ``r2``, ``off``).

    Returns:
        A new config; ``cfg`` is unchanged.
    """
    replay = OmegaConf.load(CONF_DIR / "replay" / f"{mode}.yaml")
    # merging into a DictConfig gives a DictConfig; OmegaConf's annotation also allows a ListConfig
    return cast(DictConfig, OmegaConf.merge(cfg, {"replay": replay}))


def _flat(cls: type) -> list[tuple]:
    """``cls``'s fields as ``make_dataclass`` fields of another node (their types resolved)."""
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name], dataclasses.field(default=f.default)) for f in dataclasses.fields(cls)]


def _node(schema: type) -> dataclasses.Field:
    """A typed node whose default is ``schema``'s own defaults."""
    return dataclasses.field(default_factory=schema)


def _open(default: Any = dict) -> dataclasses.Field:
    """An open node (any keys), empty by default: a ``_target_`` piece users fill."""
    return dataclasses.field(default_factory=default)


def job_schema() -> type:
    """The whole job config's structured schema.

    Cost: imports the settings dataclasses' modules only (no torch); each `structured` class is
    made once per process and cached.

    Returns:
        One dataclass (named ``JobConfig`` in Hydra's messages) with the top-level keys of
        ``RunSettings``, a typed node per settings group and an open node per ``_target_`` piece.
    """
    address = _flat(ServerAddress)
    server = structured(EngineConfig, extra=address, name="EngineConfig")
    launch = structured(VllmSettings, exclude=("model",), name="VllmSettings")  # the job sets model
    rollout = structured(
        RolloutSettings,
        name="RolloutSettings",
        extra=[
            ("sampling", structured(SamplingConfig), _node(structured(SamplingConfig))),
            ("collector", structured(CollectorConfig), _node(structured(CollectorConfig))),
            ("retry", structured(RetryPolicy), _node(structured(RetryPolicy))),
            ("server", server, _node(server)),
            ("limits", structured(ServerLimits), _node(structured(ServerLimits))),
            ("launch", Optional[launch], dataclasses.field(default=None)),  # noqa: UP045
            *_flat(AheadConfig),
            *_flat(WeightSyncSettings),
        ],
    )
    optim = structured(OptimConfig)
    std_eps = next(f for f in dataclasses.fields(GRPOAdvantages) if f.name == "std_eps")
    algorithm = structured(
        GRPOConfig,
        extra=[
            ("std_eps", float, dataclasses.field(default=std_eps.default)),
            ("optim", optim, _node(optim)),
        ],
        name="GRPOConfig",
    )
    options = structured(DataOptions, target=DATA_OPTIONS_TARGET, exclude=("eval_buffer",))
    data = structured(DataModuleSettings, extra=[("options", options, _node(options))], name="R3DataModule")
    job = [
        ("compare", list[Any], _open(list)),
        ("model", dict[str, Any], _open()),
        ("task", dict[str, Any], _open()),
        ("reward", dict[str, Any], _open()),
        ("module", dict[str, Any], _open()),
        ("callbacks", dict[str, Any], _open()),
        ("loggers", Optional[list[Any]], _open(list)),  # noqa: UP045 (OmegaConf reads typing.Optional)
        ("trainer", dict[str, Any], _open()),
        ("data", data, _node(data)),
        ("rollout", rollout, _node(rollout)),
        ("algorithm", algorithm, _node(algorithm)),
        ("replay", structured(ReplaySettings), _node(structured(ReplaySettings))),
    ]
    return structured(RunSettings, extra=job, name="JobConfig")


def register() -> None:
    """Store `job_schema` in Hydra's ConfigStore as ``r3lightning_job``, the name
    ``conf/config.yaml``'s defaults list starts with. Idempotent: storing again replaces it."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=job_schema())
