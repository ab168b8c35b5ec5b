"""The YAML files in conf/ sit on the structured schema: every value they set for a typed key equals
the settings dataclass's default, or is one of the job's documented choices below."""

from __future__ import annotations

import dataclasses
import inspect

from omegaconf import OmegaConf

from r3lightning.app.job.setup import CONF_DIR
from r3lightning.app.job.store import job_schema

# (file, dotted key): why the job's default differs from the library's (docs/config-groups.md)
JOB_CHOICES = {
    ("config.yaml", "loggers"): "CSV (and TensorBoard when installed); the schema's default is none",
    ("algorithm/grpo.yaml", "algorithm.normalize_std"): "Dr. GRPO: std-normalised advantages blow up "
    "nearly uniform groups of the tiny demo model",
    ("algorithm/grpo.yaml", "algorithm.optim.lr"): "tuned for the tiny demo model",
    (
        "data/default.yaml",
        "data.options.shard",
    ): "the job collects each rank's own groups into its own buffer",
    ("rollout/embedded.yaml", "rollout.sampling.ignore_eos"): "the token-class task scores whole responses",
    ("rollout/embedded.yaml", "rollout.server.max_batch_size"): "one forward for a whole demo step",
    ("rollout/embedded.yaml", "rollout.server.copy_model"): "the job builds a model for the engine alone",
}


def _leaves(node, prefix: str = ""):
    """``(dotted key, value)`` of every leaf of a YAML mapping (lists are leaves)."""
    for key in node:
        if key in ("defaults", "hydra"):
            continue
        value = node._get_node(key)
        dotted = f"{prefix}{key}"
        if OmegaConf.is_dict(value):
            yield from _leaves(value, f"{dotted}.")
        else:
            yield dotted, value


def _typed_default(schema, dotted: str):
    """The schema's default for ``dotted`` if it is a typed key (an open node's keys are not)."""
    node = schema
    parts = dotted.split(".")
    for part in parts[:-1]:
        if not OmegaConf.is_dict(node) or OmegaConf.get_type(node) is dict or part not in node:
            return KeyError
        node = node[part]
    if OmegaConf.get_type(node) in (dict, None) or parts[-1] not in node:
        return KeyError
    return OmegaConf.to_container(node, resolve=False)[parts[-1]] if parts[-1] in node else KeyError


def _files():
    """config.yaml and the option its defaults list selects in each group (the job's defaults; other
    options and experiments are choices by design)."""
    yield "config.yaml", ""
    for entry in OmegaConf.load(CONF_DIR / "config.yaml").defaults:
        if not OmegaConf.is_dict(entry):
            continue
        group, option = next(iter(OmegaConf.to_container(entry, resolve=False).items()))
        path = CONF_DIR / group / f"{option}.yaml"
        if path.is_file():  # reward: ${task}, experiment: null
            yield str(path.relative_to(CONF_DIR)), f"{group}."


def test_every_conf_default_equals_its_dataclass_default_or_is_a_documented_choice():
    schema = OmegaConf.structured(job_schema())
    compared = 0
    differing = {}
    for name, prefix in _files():
        for dotted, node in _leaves(OmegaConf.load(CONF_DIR / name), prefix):
            if node._is_interpolation():
                continue
            default = _typed_default(schema, dotted)
            if default is KeyError:
                continue
            compared += 1
            value = OmegaConf.to_container(OmegaConf.create({"v": node}))["v"]
            if value != default:
                differing[(name, dotted)] = (value, default)
    assert compared > 50  # the settings groups' keys are all compared
    undocumented = {k: v for k, v in differing.items() if not JOB_CHOICES.get(k)}
    assert not undocumented, f"conf/ values that differ from the dataclass defaults: {undocumented}"
    stale = {k for k, why in JOB_CHOICES.items() if why and k not in differing}
    assert not stale, f"documented choices that no longer differ: {stale}"


def test_the_data_node_has_the_data_modules_keywords_and_defaults():
    from r3lightning.data.datamodule import R3DataModule

    schema = OmegaConf.structured(job_schema()).data
    parameters = inspect.signature(R3DataModule).parameters
    expected = {
        name: (None if p.default is inspect.Parameter.empty else p.default)
        for name, p in parameters.items()
        if name != "buffer"
    }
    got = {k: v for k, v in OmegaConf.to_container(schema).items() if k != "_target_"}
    got["options"] = None  # a DataOptions node (compared field by field below)
    expected["options"] = None
    got["batch_size"] = None if OmegaConf.is_missing(schema, "batch_size") else got["batch_size"]
    assert got == expected
    from r3lightning.data.options import DataOptions

    fields = {f.name: f.default for f in dataclasses.fields(DataOptions) if f.name != "eval_buffer"}
    assert {k: v for k, v in OmegaConf.to_container(schema.options).items() if k != "_target_"} == fields
