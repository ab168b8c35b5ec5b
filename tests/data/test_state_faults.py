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
from r3lightning.rollout.trajectory import Trajectory


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
        "inf logprob",  # NaN is allowed: it marks a token the engine gave no logprob for
        _set("rollout_logprobs", 1, float("-inf")),
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
        _replace("routes", lambda r: r.to(torch.int16) - 2),
        r"trajectory 0 rejected: Trajectory.routed_experts: expert id -2 is negative",
    ),
    (
        "repeated expert in a row",
        _set("routes", (1, 0), torch.tensor([3, 3], dtype=torch.uint8)),
        r"trajectory 0 rejected: Trajectory.routed_experts: row 1 layer 0 repeats an expert: \[3, 3\]",
    ),
    (
        "route rows shifted by one to the first",
        _replace("route_rows", lambda rows: rows + torch.tensor([1, 0, -1])),
        r"trajectory 0 rejected: its 4 route rows add up to 40, not to route_sums\[0\] = 34",
    ),
    (
        "route rows shifted by one to the last",
        _replace("route_rows", lambda rows: rows + torch.tensor([-1, 0, 1])),
        r"trajectory 0 rejected: its 2 route rows add up to 28, not to route_sums\[0\] = 34",
    ),
    (
        "one route id changed",
        _set("routes", (4, 1, 1), 2),  # 7 -> 2 in the last trajectory's second row
        r"trajectory 2 rejected: its 2 route rows add up to 23, not to route_sums\[2\] = 28",
    ),
    ("route sums not a tensor", _replace("route_sums", [34, 0, 28]), r"route_sums must be a 1-D tensor"),
    (
        "more route rows than tokens",
        lambda p: (p.update(route_rows=torch.tensor([5, -1, 0])), None),
        r"trajectory 0 rejected: Trajectory.routed_experts: 5 route rows, expected at most one per token, 4",
    ),
    (
        "route rows disagree with routes",
        _set("route_rows", 0, 2),
        r"routes must be a \[rows, num_layers, top_k\] tensor with the 4 rows route_rows counts",
    ),
    (
        "routes gone",
        _replace("routes", None),
        r"routes must be a \[rows, num_layers, top_k\] tensor with the 5 rows route_rows counts, got NoneType",
    ),
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
        (
            lambda s: s.update(route_schema=[3, 2]),
            r"shape \[3, 2, 2\] has 2 on axis 1, expected num_layers=3",
        ),
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
    # each trajectory's ids summed by hand: 0..7 + 0..3 for the first, none, 0..7 for the last
    assert packed["route_sums"].tolist() == [34, 0, 28] and packed["route_sums"].dtype == torch.int64
    restored = unpack_trajectories(packed)
    assert restored == saved
    packed["prompt_ids"].fill_(0)  # the restored trajectories do not alias the packed block
    assert restored[0].prompt_ids.tolist() == [1, 2]
    del packed["route_sums"]  # a state saved before the sums existed still loads
    assert unpack_trajectories(pack_trajectories(saved) | {"route_sums": None}) == saved


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


def _positioned(buffer: ReplayBuffer) -> R3DataModule:
    module = R3DataModule(buffer, batch_size=1, shuffle=False, collate_threads=1)
    module.train_dataloader()  # epoch 0 planned: one batch per trajectory, snapshot [start, stop)
    return module


POSITION_FAULTS = [
    ("epoch as a string", "cursor", {"epoch": "0"}, r"cursor\.epoch must be an int >= -1, got '0'"),
    ("epoch before the first", "cursor", {"epoch": -2}, r"cursor\.epoch must be an int >= -1, got -2"),
    (
        "consumed past the epoch",
        "cursor",
        {"consumed": 4},
        r"cursor\.consumed = 4 is past the epoch's cursor\.batches = 3",
    ),
    ("start after stop", "cursor", {"start": 4}, r"cursor\.start = 4 is after cursor\.stop = 3"),
    ("negative stop", "cursor", {"stop": -1}, r"cursor\.stop must be an int >= 0, got -1"),
    ("exhausted as an int", "cursor", {"exhausted": 0}, r"cursor\.exhausted must be a bool, got 0"),
    ("batches as a float", "cursor", {"batches": 3.0}, r"cursor\.batches must be an int >= 0, got 3\.0"),
    ("consumed as a bool", "cursor", {"consumed": True}, r"cursor\.consumed must be an int >= 0, got True"),
    ("unknown cursor key", "cursor", {"position": 1}, r"cursor must be a dict with the keys \[.*'position'"),
    ("batch size 0", "plan", {"batch_size": 0}, r"plan\.batch_size must be an int >= 1, got 0"),
    ("shuffle as a string", "plan", {"shuffle": "yes"}, r"plan\.shuffle must be a bool, got 'yes'"),
    ("no ranks", "plan", {"num_replicas": 0}, r"plan\.num_replicas must be an int >= 1, got 0"),
]


@pytest.mark.parametrize(
    ("case", "part", "change", "message"), POSITION_FAULTS, ids=[c[0] for c in POSITION_FAULTS]
)
def test_bad_data_module_position_is_refused_and_nothing_changes(case, part, change, message):
    state = _positioned(_filled()).state_dict()
    assert state["cursor"] == {
        "epoch": 0,
        "consumed": 0,
        "batches": 3,
        "exhausted": False,
        "start": 0,
        "stop": 3,
    }
    state[part].update(change)
    other = ReplayBuffer()
    other.extend([Trajectory([20], [21]), Trajectory([22], [23])])
    target = _positioned(other)
    before = (copy.deepcopy(target._cursor), target._plan, target._snapshot, _contents(other))
    with pytest.raises(ValueError, match="R3DataModule state " + message):
        target.load_state_dict(state)
    cursor, plan, snapshot, contents = before
    assert (target._cursor, target._plan, target._snapshot) == (cursor, plan, snapshot)
    assert _same(other, contents)
    state[part] = _positioned(_filled()).state_dict()[part]  # the same state, repaired, loads
    target.load_state_dict(state)
    assert (target.epoch, target.batches_consumed, len(other)) == (0, 0, 3)


def test_a_snapshot_that_does_not_fill_its_range_is_refused():
    module = _positioned(_filled())
    state = module.state_dict()
    state["snapshot"] = pack_trajectories(_trajectories())
    state["cursor"].update(consumed=1, stop=5)
    before = _contents(module.buffer)
    with pytest.raises(
        ValueError,
        match=r"R3DataModule state snapshot holds 3 trajectories, not the cursor.stop - cursor.start = 5",
    ):
        module.load_state_dict(state)
    assert _same(module.buffer, before) and module.batches_consumed == 0
    with pytest.raises(ValueError, match=r"R3DataModule state must be a dict, got list"):
        module.load_state_dict([])


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
    with pytest.raises(ValueError, match=rf"expert id {value} is out of range for int32 \(ids < 2\*\*31\)"):
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
