"""Corrupted checkpoint state: refused with a ValueError naming the field, and nothing lost.

Every corruption is applied to a real ``state_dict`` of a filled buffer (and of a data module);
the load must raise, and the target buffer must keep exactly what it held before.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from r3lightning.data.buffer import ReplayBuffer, pack_trajectories, unpack_trajectories
from r3lightning.data.datamodule import R3DataModule
from r3lightning.data.trajectory import Trajectory


def _routes(rows: int, layers: int = 2, top_k: int = 2) -> torch.Tensor:
    return (torch.arange(rows * layers * top_k) % 8).reshape(rows, layers, top_k)


def _trajectories() -> list[Trajectory]:
    return [
        Trajectory(
            [1, 2], [3, 4], loss_mask=[1, 0], rollout_logprobs=[-0.5, -1.5], routed_experts=_routes(3)
        ),
        Trajectory([5], [6], reward=1.0),
        Trajectory([7, 8, 9], [10], routed_experts=_routes(2)),
    ]


def _filled() -> ReplayBuffer:
    buffer = ReplayBuffer()
    buffer.extend(_trajectories())
    return buffer


def _contents(buffer: ReplayBuffer) -> tuple:
    return (buffer.start, buffer.stop, buffer.route_schema, [copy.deepcopy(t) for t in buffer])


def _same(buffer: ReplayBuffer, before: tuple) -> bool:
    start, stop, schema, items = before
    return (buffer.start, buffer.stop, buffer.route_schema) == (start, stop, schema) and all(
        a == b for a, b in zip(buffer, items, strict=True)
    )


def _set(field: str, index: int, value):
    def corrupt(packed: dict) -> None:
        tensor = packed[field].clone()
        tensor[index] = value
        packed[field] = tensor

    return corrupt


def _replace(field: str, value):
    def corrupt(packed: dict) -> None:
        packed[field] = value(packed[field]) if callable(value) else value

    return corrupt


def _drop(field: str):
    def corrupt(packed: dict) -> None:
        del packed[field]

    return corrupt


CORRUPTIONS = [
    (
        "negative token id",
        _set("prompt_ids", 1, -4),
        r"trajectory 0 rejected: .*prompt_ids must hold token ids >= 0",
    ),
    (
        "float token ids",
        _replace("response_ids", lambda t: t.double() + 0.5),
        r"trajectory 0 rejected: .*response_ids must hold integer token ids",
    ),
    (
        "nan logprob",
        _set("rollout_logprobs", 1, float("nan")),
        r"trajectory 0 rejected: .*rollout_logprobs must be finite",
    ),
    (
        "loss mask 2",
        _set("loss_mask", 0, 2.0),
        r"trajectory 0 rejected: .*loss_mask must hold values in \[0, 1\]",
    ),
    ("nan reward", _set("rewards", 1, float("nan")), r"trajectory 1 rejected: .*reward must be finite"),
    (
        "negative expert id",
        _replace("routes", lambda r: r.to(torch.int16) - 1),
        r"trajectory 0 rejected: .*expert ids >= 0",
    ),
    (
        "more route rows than tokens",
        lambda p: (p.update(route_rows=torch.tensor([5, -1, 0])), None),
        r"trajectory 0 rejected: .*routed_experts has 5 rows but the trajectory has only 4 tokens",
    ),
    (
        "route rows disagree with routes",
        _set("route_rows", 0, 2),
        r"routes must be a \[rows, num_layers, top_k\] tensor with the 4 rows route_rows counts",
    ),
    ("routes gone", _replace("routes", None), r"routes is None but route_rows counts 5 rows"),
    (
        "lengths disagree with ids",
        _set("prompt_lengths", 2, 4),
        r"prompt_ids must be a 1-D tensor of 7 entries, got shape \(6,\)",
    ),
    ("negative length", _set("response_lengths", 1, -1), r"response_lengths\[1\] must be >= 0, got -1"),
    ("zero prompt", _set("prompt_lengths", 1, 0), r"prompt_lengths\[1\] must be >= 1, got 0"),
    ("count", _replace("count", 4), r"prompt_lengths must be a 1-D tensor of 4 entries"),
    ("float count", _replace("count", 1.5), r"count must be an int >= 0, got 1.5"),
    ("missing key", _drop("loss_mask"), r" lacks \[.loss_mask.\]"),
    (
        "not a tensor",
        _replace("advantages", [0.0, 0.0, 0.0]),
        r"advantages must be a 1-D tensor of 3 entries, got list",
    ),
]


@pytest.mark.parametrize(("case", "corrupt", "message"), CORRUPTIONS, ids=[c for c, _, _ in CORRUPTIONS])
def test_corrupted_buffer_state_is_refused_and_the_buffer_keeps_its_contents(case, corrupt, message):
    state = _filled().state_dict()
    corrupt(state["trajectories"])
    target = ReplayBuffer()
    target.extend([Trajectory([11], [12, 13], routed_experts=_routes(2)), Trajectory([14], [15])])
    before = _contents(target)
    with pytest.raises(ValueError, match="ReplayBuffer state trajectories.*" + message):
        target.load_state_dict(state)
    assert _same(target, before)
    target.add(Trajectory([16], [17]))  # still usable
    assert len(target) == 3


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.pop("start"), r"ReplayBuffer state lacks \['start'\]"),
        (lambda s: s.pop("trajectories"), r"ReplayBuffer state lacks \['trajectories'\]"),
        (lambda s: s.update(route_schema=[2, "x"]), r"route_schema must be None or \[num_layers, top_k\]"),
        (lambda s: s.update(start=1.5), r"start must be an int >= 0, got 1.5"),
        (lambda s: s.update(route_schema=[3, 2]), r"\(num_layers, top_k\) = \(2, 2\), expected \(3, 2\)"),
    ],
)
def test_bad_buffer_state_keys_are_named(mutate, message):
    state = _filled().state_dict()
    mutate(state)
    target = _filled()
    before = _contents(target)
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert _same(target, before)
    with pytest.raises(ValueError, match=r"ReplayBuffer state must be a dict, got list"):
        target.load_state_dict([])


def test_restored_trajectories_equal_the_saved_ones_and_own_their_storage():
    saved = _trajectories()
    packed = pack_trajectories(saved)
    restored = unpack_trajectories(packed)
    assert restored == saved
    packed["prompt_ids"].fill_(0)  # the restored trajectories do not alias the packed block
    assert restored[0].prompt_ids.tolist() == [1, 2]


def test_data_module_snapshot_is_validated_before_the_buffer_changes():
    buffer = _filled()
    module = R3DataModule(buffer, batch_size=1, shuffle=False, collate_threads=1)
    state = module.state_dict()
    other = ReplayBuffer()
    other.extend([Trajectory([20], [21])])
    state["buffer"] = other.state_dict()
    snapshot = pack_trajectories(_trajectories())
    snapshot["rollout_logprobs"][0] = float("inf")
    state["snapshot"] = snapshot
    before = _contents(buffer)
    with pytest.raises(
        ValueError,
        match=r"R3DataModule state snapshot: trajectory 0 rejected: .*rollout_logprobs must be finite",
    ):
        module.load_state_dict(state)
    assert _same(buffer, before)  # the (valid) buffer state was not loaded either
    del state["cursor"]
    with pytest.raises(ValueError, match=r"R3DataModule state lacks \['cursor'\]"):
        module.load_state_dict(state)
    assert _same(buffer, before)


# ---------------------------------------------------------------------------- Trajectory fields


@pytest.mark.parametrize("mask", [[2.0, 1.0], [1.0, -0.5]])
def test_loss_mask_outside_unit_interval_is_refused(mask):
    with pytest.raises(
        ValueError, match=r"Trajectory.loss_mask must hold values in \[0, 1\], got loss_mask\[\d\]"
    ):
        Trajectory([1], [2, 3], loss_mask=mask)
    assert Trajectory([1], [2, 3], loss_mask=[0.25, 1.0]).loss_mask.tolist() == [0.25, 1.0]


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64])
def test_wide_unsigned_routes_are_supported_when_they_fit(dtype):
    raw = np.array([[[3, 300]], [[7, 1]]], dtype=dtype)
    t = Trajectory([1, 2], [3], routed_experts=raw)
    assert t.routed_experts.dtype == torch.int16
    assert t.routed_experts.tolist() == raw.astype(np.int64).tolist()
    assert Trajectory([1, 2], [3], routed_experts=torch.from_numpy(raw)) == t


@pytest.mark.parametrize(
    ("value", "dtype"), [(2**64 - 1, np.uint64), (2**63, np.uint64), (2**32 - 1, np.uint32)]
)
def test_expert_ids_beyond_int32_are_reported_as_themselves(value, dtype):
    raw = np.array([[[1, value]]], dtype=dtype)
    with pytest.raises(ValueError, match=rf"routed_experts holds expert id {value}, expected ids < 2\*\*31"):
        Trajectory([1, 2], [3], routed_experts=raw)


# ---------------------------------------------------------------------------- collator close


def test_collator_close_is_safe_while_other_threads_collate():
    import sys
    import threading

    from r3lightning.data.collate import RolloutCollator

    items = [
        Trajectory([1, 2, 3][: 1 + i % 3], [4, 5][: i % 2 + 1], routed_experts=_routes(2)) for i in range(8)
    ]
    expected = RolloutCollator(num_threads=1)(items)
    collator = RolloutCollator(num_threads=2)
    errors: list[BaseException] = []
    batches = []
    stop = threading.Event()

    def collate():
        try:
            while not stop.is_set():
                batches.append(collator(items))
        except BaseException as exc:  # any failure is the bug
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # many switches, so close() lands between taking the pool and using it
    threads = [threading.Thread(target=collate) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        while len(batches) < 60 and not errors:  # close again and again while they collate
            collator.close()
        stop.set()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert batches and all(torch.equal(b.input_ids, expected.input_ids) for b in batches)
    assert all(torch.equal(b.routed_experts.values, expected.routed_experts.values) for b in batches)
    collator.close()
    assert collator._executor is None and collator._executor_users == {}
