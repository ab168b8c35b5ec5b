"""Every public class of r3lightning takes at most 8 constructor parameters (DESIGN: groups of
settings are frozen dataclasses), except the records below, which are results, not things a user
configures."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import r3lightning

MAX_PARAMETERS = 8
# records a package function or the collation builds and hands back, one field per parameter
RECORDS = {
    "r3lightning.data.batch.RolloutBatch",  # one training batch: its tensors
    "r3lightning.rollout.stats.RolloutStats",  # one step's rollout statistics
    "r3lightning.align.layout.TokenMetadataLayout",  # built by its padded() / packed() constructors
    "r3lightning.app.job.validate.Settings",
    "r3lightning.rollout.trajectory.Trajectory",  # one trajectory's tokens, routes, scores and weight version  # every settings object check_values built from one config
}


def public_classes() -> dict[str, type]:
    """``module.Class`` -> class, for every class defined in a public module of the package (a
    module whose optional dependency is not installed is left out)."""
    found = {}
    for info in pkgutil.walk_packages(r3lightning.__path__, "r3lightning."):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        for name, value in vars(module).items():
            if inspect.isclass(value) and not name.startswith("_") and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return found


CLASSES = public_classes()


def test_the_walk_finds_the_configurable_classes_and_every_record():
    for name in ("R3DataModule", "RouterReplayCallback", "RolloutCollector", "ReplayBuffer", "Trajectory"):
        assert any(path.endswith(f".{name}") for path in CLASSES), name
    assert set(CLASSES) >= RECORDS


@pytest.mark.parametrize("path", sorted(set(CLASSES) - RECORDS))
def test_public_classes_take_at_most_8_parameters(path):
    try:
        parameters = inspect.signature(CLASSES[path]).parameters
    except (TypeError, ValueError):  # no Python signature (a C type): nothing a user configures here
        return
    assert len(parameters) <= MAX_PARAMETERS, f"{path}{inspect.signature(CLASSES[path])}"
