import io
import pickle
import random

import numpy as np
import pytest
import torch
from collate_reference import make_trajectory
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.data.buffer import ReplayBuffer, pack_trajectories, unpack_trajectories
from r3lightning.rollout.trajectory import Trajectory, padding_trajectories


def routes(rows, layers=2, top_k=2, high=8, dtype=torch.int64):
    return (torch.arange(rows * layers * top_k) % high).reshape(rows, layers, top_k).to(dtype)


# ---------------------------------------------------------------------------- Trajectory


def test_trajectory_normalises_inputs_and_defaults():
    t = Trajectory(np.array([3, 4], dtype=np.int32), [5, 6, 7], reward=0.5, routed_experts=routes(4))
    assert t.prompt_ids.dtype == torch.int64 and t.prompt_ids.tolist() == [3, 4]
    assert t.response_ids.tolist() == [5, 6, 7]
    assert t.loss_mask.dtype == torch.float32 and t.loss_mask.tolist() == [1.0, 1.0, 1.0]
    assert t.rollout_logprobs.dtype == torch.float32 and t.rollout_logprobs.tolist() == [0.0, 0.0, 0.0]
    assert (t.reward, t.advantage) == (0.5, 0.5)  # advantage defaults to the reward
    assert t.num_tokens == 5 and t.prompt_length == 2 and t.response_length == 3
    assert t.route_schema == (2, 2) and t.route_rows == 4


@pytest.mark.parametrize(
    ("high", "dtype"), [(1, torch.uint8), (256, torch.uint8), (257, torch.int16), (40000, torch.int32)]
)
def test_routes_are_stored_in_the_compact_dtype_of_their_largest_id(high, dtype):
    raw = routes(3, high=high, dtype=torch.int64)
    raw[-1, -1, -1] = high - 1
    t = Trajectory([1], [2, 3], routed_experts=raw)
    assert t.routed_experts.dtype == dtype
    assert torch.equal(t.routed_experts.to(torch.int64), raw)


def test_empty_routes_and_zero_length_response_are_valid():
    t = Trajectory([1, 2], [], routed_experts=torch.empty(0, 3, 2, dtype=torch.int32))
    assert t.response_length == 0 and t.loss_mask.numel() == 0
    assert t.route_rows == 0 and t.route_schema == (3, 2) and t.routed_experts.dtype == torch.uint8


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"prompt_ids": []}, ValueError, r"prompt_ids must hold at least one token"),
        ({"prompt_ids": [[1, 2]]}, ValueError, r"prompt_ids must be 1-D"),
        ({"prompt_ids": [1.5]}, TypeError, r"prompt_ids must hold integer token ids"),
        (
            {"response_ids": [1, -2]},
            ValueError,
            r"response_ids must hold token ids >= 0, got response_ids\[1\] = -2",
        ),
        ({"loss_mask": [1.0]}, ValueError, r"loss_mask must have one entry per response token \(2\)"),
        ({"rollout_logprobs": [0.0, float("inf")]}, ValueError, r"rollout_logprobs must be finite"),
        ({"reward": float("inf")}, ValueError, r"reward must be finite"),
        ({"advantage": "high"}, TypeError, r"advantage must be a real number"),
        (
            {"routed_experts": torch.zeros(4, 2, dtype=torch.int64)},
            ValueError,
            r"routed_experts: expected shape \[rows, num_layers, top_k\], got \[4, 2\]",
        ),
        (
            {"routed_experts": torch.zeros(4, 0, 2, dtype=torch.int64)},
            ValueError,
            r"routed_experts: shape \[4, 0, 2\] has 0 on axis 1, expected num_layers >= 1",
        ),
        (
            {"routed_experts": torch.zeros(5, 2, 2, dtype=torch.int64)},
            ValueError,
            r"routed_experts: 5 route rows, expected at most one per token, 4 \(len\(prompt_ids\)",
        ),
        (
            {"routed_experts": torch.tensor([[[1, 2], [0, 0]], [[4, 5], [3, 3]]])},
            ValueError,
            r"routed_experts: row 1 layer 1 repeats an expert: \[3, 3\]",
        ),
        ({"routed_experts": torch.zeros(2, 2, 2)}, TypeError, r"routed_experts must hold integer expert ids"),
        (
            {"routed_experts": -2 * torch.ones(2, 2, 2, dtype=torch.int64)},
            ValueError,
            r"expert id -2 is negative",
        ),
        ({"response_ids": "abc"}, TypeError, r"response_ids must be a tensor, ndarray or list"),
    ],
)
def test_bad_trajectory_fields_raise_naming_the_field(kwargs, error, match):
    args = {"prompt_ids": [1, 2], "response_ids": [3, 4], **kwargs}
    prompt, response = args.pop("prompt_ids"), args.pop("response_ids")
    with pytest.raises(error, match=match):
        Trajectory(prompt, response, **args)


def test_dense_zero_rows_pass_the_route_check_but_a_repeated_zero_does_not():
    dense = torch.tensor([[[1, 2, 3], [0, 0, 0]], [[4, 5, 6], [0, 6, 7]]]).to(torch.uint16)
    assert Trajectory([1, 2], [3], routed_experts=dense).routed_experts.tolist() == dense.tolist()
    dense[1, 1] = torch.tensor([0, 0, 7])  # zeros in a row that is not all zero: expert 0 twice
    with pytest.raises(ValueError, match=r"routed_experts: row 1 layer 1 repeats an expert: \[0, 0, 7\]"):
        Trajectory([1, 2], [3], routed_experts=dense)


def test_validate_against_model_bounds():
    t = Trajectory([1, 9], [3], routed_experts=routes(2, high=8))
    t.validate(vocab_size=10, num_experts=8, route_schema=(2, 2))
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] = 9 is out of range for a vocabulary of 9"):
        t.validate(vocab_size=9)
    with pytest.raises(ValueError, match=r"routed_experts: expert id 7 is out of range for num_experts=7"):
        t.validate(num_experts=7)
    with pytest.raises(ValueError, match=r"shape \[2, 2, 2\] has 2 on axis 1, expected num_layers=4"):
        t.validate(route_schema=(4, 2))


def test_trajectory_equality_and_pickling():
    t = Trajectory([1, 2], [3], loss_mask=[0], rollout_logprobs=[-0.25], reward=1.0, routed_experts=routes(2))
    u = pickle.loads(pickle.dumps(t))
    assert u == t and u.routed_experts.dtype == torch.uint8
    assert t != Trajectory([1, 2], [3], loss_mask=[0], rollout_logprobs=[-0.25], reward=1.0)
    assert "prompt=2" in repr(t)


def test_padding_trajectories_spread_dummy_routes_over_experts():
    pads = padding_trajectories(3, pad_token_id=7, route_schema=(2, 2), num_experts=6)
    assert [p.prompt_ids.tolist() for p in pads] == [[7]] * 3
    assert all(p.response_length == 0 and p.reward == 0.0 and p.advantage == 0.0 for p in pads)
    rows = [p.routed_experts[0, 0].tolist() for p in pads]
    assert rows == [[0, 1], [2, 3], [4, 5]]  # distinct per row, rotating across all experts
    assert all(p.route_rows == 0 for p in padding_trajectories(2, route_schema=(2, 2)))
    assert all(p.routed_experts is None for p in padding_trajectories(2))


# ---------------------------------------------------------------------------- ReplayBuffer


def tagged(i, **kwargs):
    return Trajectory([100 + i], [1, 2], routed_experts=routes(2), **kwargs)


def tags(buffer):
    return [int(t.prompt_ids[0]) - 100 for t in buffer]


def test_add_extend_iterate_and_fifo_eviction():
    buffer = ReplayBuffer(capacity=3)
    buffer.add(tagged(0))
    buffer.extend([tagged(1), tagged(2)])
    assert len(buffer) == 3 and tags(buffer) == [0, 1, 2] and (buffer.start, buffer.stop) == (0, 3)
    buffer.extend([tagged(3), tagged(4)])  # the two oldest go first
    assert tags(buffer) == [2, 3, 4] and (buffer.start, buffer.stop) == (2, 5)
    assert tags(buffer.window(3, 5)) == [3, 4] and buffer[0].prompt_ids.item() == 102
    with pytest.raises(KeyError, match=r"\[1, 4\) are not all in the buffer, which holds \[2, 5\)"):
        buffer.window(1, 4)
    buffer.extend([tagged(i) for i in range(5, 10)])  # more than the capacity: newest kept
    assert tags(buffer) == [7, 8, 9] and (buffer.start, buffer.stop) == (7, 10)
    buffer.clear()
    assert len(buffer) == 0 and (buffer.start, buffer.stop) == (10, 10) and buffer.route_schema is None


def test_rejected_trajectory_leaves_buffer_unchanged():
    buffer = ReplayBuffer(vocab_size=200, num_experts=8)
    buffer.extend([tagged(0), tagged(1)])
    before = [t for t in buffer]
    bad_schema = Trajectory([1], [2], routed_experts=torch.zeros(1, 3, 2, dtype=torch.int64))
    with pytest.raises(
        ValueError, match=r"trajectory 1 of the batch rejected: .*has 3 on axis 1, expected num_layers=2"
    ):
        buffer.extend([tagged(2), bad_schema, tagged(3)])  # all-or-nothing
    with pytest.raises(ValueError, match=r"trajectory rejected: .*response_ids\[0\] = 500 is out of range"):
        buffer.add(Trajectory([1], [500]))
    with pytest.raises(ValueError, match=r"expert id 9 is out of range for num_experts=8"):
        buffer.add(Trajectory([1], [2], routed_experts=torch.tensor([[[9, 1], [2, 3]]])))
    with pytest.raises(TypeError, match=r"takes Trajectory objects, got dict at position 0"):
        buffer.add({"prompt_ids": [1]})
    assert len(buffer) == 2 and all(a is b for a, b in zip(buffer, before, strict=True))
    assert (buffer.start, buffer.stop) == (0, 2)


def test_first_schema_within_one_extend_must_agree():
    buffer = ReplayBuffer()
    mixed = [Trajectory([1], [2], routed_experts=routes(1, layers=layers)) for layers in (2, 3)]
    with pytest.raises(ValueError, match=r"trajectory 1 of the batch rejected"):
        buffer.extend(mixed)
    assert len(buffer) == 0 and buffer.route_schema is None
    buffer.extend([Trajectory([1], [2]), mixed[1]])  # trajectories without routes do not fix it
    assert buffer.route_schema == (3, 2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_buffer_rejects_bad_bounds(bad):
    with pytest.raises(ValueError, match=r"ReplayBuffer capacity must be an int >= 1, got "):
        ReplayBuffer(capacity=bad)


def mixed_trajectories():
    return [
        Trajectory(
            [1, 2],
            [3, 4],
            loss_mask=[1, 0],
            rollout_logprobs=[-0.5, -1.5],
            reward=0.1,
            routed_experts=routes(3),
        ),
        Trajectory([5], [], reward=-0.3, advantage=0.7),  # no routes, empty response
        Trajectory([6, 7, 8], [9], routed_experts=routes(2) + 290),  # int16 routes
        Trajectory([1], [2], routed_experts=torch.empty(0, 2, 2, dtype=torch.int64)),  # zero rows
    ]


def test_state_dict_round_trip_keeps_contents_position_and_dtypes():
    buffer = ReplayBuffer(capacity=4)
    buffer.extend([tagged(0), tagged(1)])
    buffer.extend(mixed_trajectories())  # evicts tags 0 and 1
    state = buffer.state_dict()
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    loaded = torch.load(blob, weights_only=True)  # plain tensors and ints only
    restored = ReplayBuffer(capacity=4)
    restored.load_state_dict(loaded)
    assert (restored.start, restored.stop, restored.route_schema) == (2, 6, (2, 2))
    assert all(a == b for a, b in zip(restored, buffer, strict=True))
    assert [None if t.routed_experts is None else t.routed_experts.dtype for t in restored] == [
        torch.uint8,
        None,
        torch.int16,
        torch.uint8,
    ]
    packed = state["trajectories"]
    assert packed["routes"].shape == (5, 2, 2) and packed["route_rows"].tolist() == [3, -1, 2, 0]


def test_load_state_dict_refuses_to_lose_samples_or_break_bounds():
    state = ReplayBuffer().state_dict()
    full = ReplayBuffer()
    full.extend(mixed_trajectories())
    with pytest.raises(ValueError, match=r"holds 4 trajectories, more than this buffer's capacity 2"):
        ReplayBuffer(capacity=2).load_state_dict(full.state_dict())
    with pytest.raises(ValueError, match=r"trajectory 2 rejected: .*expert id 297"):
        ReplayBuffer(num_experts=16).load_state_dict(full.state_dict())
    with pytest.raises(ValueError, match=r"state version"):
        ReplayBuffer().load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match=r"ReplayBuffer state start must be an int >= 0, got -1"):
        ReplayBuffer().load_state_dict({**state, "start": -1})


def test_loaded_routes_fix_the_schema_even_when_the_state_names_none():
    full = ReplayBuffer()
    full.extend(mixed_trajectories())
    restored = ReplayBuffer()
    restored.load_state_dict({**full.state_dict(), "route_schema": None})
    assert restored.route_schema == (2, 2)
    with pytest.raises(ValueError, match=r"has 3 on axis 1, expected num_layers=2"):
        restored.add(Trajectory([1, 2], [3], routed_experts=routes(2, layers=3)))
    assert len(restored) == 4


@settings(max_examples=25, deadline=None)
@given(
    capacity=st.none() | st.integers(1, 6),
    sizes=st.lists(st.integers(0, 4), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
)
def test_buffer_holds_the_newest_capacity_trajectories(capacity, sizes, seed):
    rng = random.Random(seed)
    buffer, added = ReplayBuffer(capacity=capacity), []
    for size in sizes:
        batch = [make_trajectory(rng, tag=100 + len(added) + i) for i in range(size)]
        buffer.extend(batch)
        added += batch
    kept = added if capacity is None else added[max(len(added) - capacity, 0) :]
    assert (
        [t for t in buffer] == kept and buffer.stop == len(added) and buffer.start == len(added) - len(kept)
    )
    again = unpack_trajectories(pack_trajectories(kept))
    assert again == kept


def test_trajectory_owns_its_tensors_so_reused_inputs_cannot_rewrite_the_buffer():
    prompt = torch.tensor([1, 2, 3])
    response = torch.tensor([4, 5])
    loss_mask = torch.ones(2, dtype=torch.float32)
    logprobs = torch.full((2,), -0.5)
    captured = routes(4, dtype=torch.uint8)
    buffer = ReplayBuffer()
    buffer.add(
        Trajectory(prompt, response, loss_mask=loss_mask, rollout_logprobs=logprobs, routed_experts=captured)
    )
    for tensor in (prompt, response, loss_mask, logprobs, captured):  # the caller reuses its buffers
        tensor.fill_(0)
    (stored,) = buffer
    assert stored.prompt_ids.tolist() == [1, 2, 3] and stored.response_ids.tolist() == [4, 5]
    assert stored.loss_mask.tolist() == [1.0, 1.0] and stored.rollout_logprobs.tolist() == [-0.5, -0.5]
    assert torch.equal(stored.routed_experts, routes(4, dtype=torch.uint8))
