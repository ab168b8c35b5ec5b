"""Boundaries of the data layer tried on both sides: layer-id sets, batches that mix route layer
sets, and a mid-epoch resume whose epoch-deciding settings changed."""

from __future__ import annotations

import pytest
import torch
from datamodule_support import Recorder, filled, trainer

from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.collate import RolloutCollator, collate_trajectories
from r3lightning.data.datamodule import DataOptions, R3DataModule
from r3lightning.rollout.trajectory import Trajectory
from r3lightning.wire.request import RouteSchema

LAYERS_MESSAGE = r"layers must be None or sorted, unique decoder-layer ids >= 0, got "


@pytest.mark.parametrize("layers", [(1, 1), [0, 2, 2], {1: "a", 3: "b"}, {}, (2, 1), (-1, 0), "13", (1.0,)])
@pytest.mark.parametrize("where", ["options", "buffer", "schema", "collator"])
def test_layer_sets_that_do_not_name_each_column_once_are_refused(layers, where):
    build = {
        "options": lambda: DataOptions(layers=layers),
        "buffer": lambda: ReplayBuffer(layers=layers),
        "schema": lambda: RouteSchema(num_layers=4, top_k=2, layers=layers),
        "collator": lambda: RolloutCollator(num_threads=1, layers=layers),
    }[where]
    with pytest.raises(ValueError, match=LAYERS_MESSAGE):
        build()


@pytest.mark.parametrize("layers", [(1, 2), [0, 3], range(1, 4), (3,)])
def test_sorted_distinct_layer_ids_are_kept_as_a_tuple(layers):
    assert DataOptions(layers=layers).layers == tuple(layers)
    assert ReplayBuffer(layers=layers).layers == tuple(layers)
    assert RouteSchema(num_layers=4, top_k=2, layers=layers).layers == tuple(layers)


def _on_layers(tag: int, layers: tuple[int, ...]) -> Trajectory:
    routes = (torch.arange(2 * len(layers) * 2).reshape(2, len(layers), 2) + tag) % 8
    return Trajectory([tag, 5], [6], routed_experts=routes, route_layers=layers)


def test_a_batch_that_mixes_route_layer_sets_is_refused():
    """Two trajectories with the same route schema (2 columns of top-2) on different layers: their
    columns would replay on each other's layers."""
    same = collate_trajectories([_on_layers(1, (1, 3)), _on_layers(2, (1, 3))])
    assert same.route_layers == (1, 3)
    mixed = [_on_layers(1, (1, 3)), _on_layers(2, (2, 3))]
    with pytest.raises(
        ValueError, match=r"trajectories in one batch have different route schemas .* route_layers"
    ):
        collate_trajectories(mixed)
    with pytest.raises(ValueError, match=r"route_layers"):
        RolloutCollator(num_threads=1)(mixed)


@pytest.fixture(scope="module")
def mid_epoch_state():
    """The state of a data module one batch (of 3) into an epoch of 10 trajectories."""
    datamodule = R3DataModule(filled(10), 3, seed=4, collate_threads=1)
    trainer(max_steps=1).fit(Recorder(), datamodule=datamodule)
    return datamodule.state_dict()


SAME = {"batch_size": 3, "shuffle": True, "seed": 4, "drop_last": False}


@pytest.mark.parametrize(
    ("change", "saved_now"),
    [
        ({"seed": 5}, "'seed': (4, 5)"),
        ({"shuffle": False}, "'shuffle': (True, False)"),
        ({"drop_last": True}, "'drop_last': (False, True)"),
        ({"batch_size": 4}, "'batch_size': (3, 4)"),
        ({"world": 2}, "'num_replicas': (1, 2)"),
    ],
)
def test_a_mid_epoch_resume_refuses_every_changed_epoch_setting(mid_epoch_state, change, saved_now):
    settings = {**SAME, **change}
    world = settings.pop("world", 1)
    batch_size = settings.pop("batch_size")
    resumed = R3DataModule(ReplayBuffer(num_experts=8), batch_size, collate_threads=1, **settings)
    resumed._data_parallel = lambda: (world, 0)  # as a strategy of `world` ranks reports it
    resumed.load_state_dict(mid_epoch_state)
    with pytest.raises(ValueError, match=r"cannot continue epoch 0 mid-way with changed settings") as info:
        resumed.train_dataloader()
    assert saved_now in str(info.value) and str(info.value).count("(") == 2  # only that setting


def test_a_mid_epoch_resume_with_the_same_settings_continues(mid_epoch_state):
    resumed = R3DataModule(ReplayBuffer(num_experts=8), SAME["batch_size"], collate_threads=1, seed=4)
    resumed.load_state_dict(mid_epoch_state)
    assert len(list(resumed.train_dataloader())) == 4 - 1  # the epoch's 4 batches, one already trained
