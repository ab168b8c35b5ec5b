import pickle
import random

import pytest
import torch
from collate_reference import assert_batch_matches, make_trajectory
from runif import run_if

from r3lightning.data.batch import ROW_FIELDS, TOKEN_FIELDS, RolloutBatch
from r3lightning.data.collate import collate_trajectories
from r3lightning.packed import PackedTensor
from r3lightning.routes import dummy_routes


@pytest.fixture
def trajectories():
    rng = random.Random(7)
    return [make_trajectory(rng, tag=100 + i, routes="random") for i in range(6)]


@pytest.fixture
def batch(trajectories):
    return collate_trajectories(trajectories)


def check_rows(part, trajectories, rows):
    """``part`` holds exactly trajectories ``rows`` (padded to the parent's width)."""
    picked = [trajectories[r] for r in rows]
    assert_batch_matches(part, picked)


@pytest.mark.parametrize(
    "index",
    [
        slice(1, 4),
        slice(None, None, 2),
        slice(5, 1, -2),
        [4, 0, 4],
        (4, 0),
        torch.tensor([3, 1]),
        [True, False] * 3,
    ],
)
def test_indexing_matches_the_selected_trajectories(batch, trajectories, index):
    rows = list(range(6))
    if isinstance(index, slice):
        rows = rows[index]
    elif isinstance(index, torch.Tensor):
        rows = index.tolist()
    elif isinstance(index[0], bool):
        rows = [r for r, keep in zip(rows, index, strict=True) if keep]
    else:
        rows = list(index)
    part = batch[index]
    assert len(part) == len(rows) and part.width == batch.width
    check_rows(part, trajectories, rows)


def test_int_index_gives_a_one_row_batch(batch, trajectories):
    check_rows(batch[-1], trajectories, [5])
    with pytest.raises(IndexError, match=r"row 6 is out of range for a RolloutBatch of 6 rows"):
        batch[6]
    with pytest.raises(IndexError, match=r"row -9 is out of range"):
        batch[[0, -9]]
    with pytest.raises(IndexError, match=r"bool mask must have one entry per row \(6\)"):
        batch[[True, False]]
    with pytest.raises(TypeError, match=r"cannot be indexed by a bool scalar"):
        batch[True]
    with pytest.raises(
        IndexError, match=r"RolloutBatch index must hold integers or bools, got torch\.float32"
    ):
        batch[[1.0, 2.0]]
    empty = batch[4:1:2]  # an empty strided slice, like list indexing
    assert len(empty) == 0 and empty.width == batch.width and len(empty.routed_experts) == 0


def test_slices_are_views_and_trim_drops_shared_padding(batch, trajectories):
    part = batch[2:4]
    assert part.input_ids.data_ptr() == batch.input_ids[2:4].data_ptr()
    trimmed = part.trim()
    assert trimmed.width == max(t.num_tokens for t in trajectories[2:4])
    assert_batch_matches(trimmed, trajectories[2:4])


def test_split_and_chunk_then_cat_round_trip(batch, trajectories):
    parts = batch.split(4)
    assert [len(p) for p in parts] == [4, 2]
    assert [len(p) for p in batch.split([1, 0, 5])] == [1, 0, 5]
    assert [len(p) for p in batch.chunk(4)] == [2, 2, 2]
    assert RolloutBatch.cat(parts).equal(batch)
    trimmed = [p.trim() for p in batch.chunk(3)]
    assert RolloutBatch.cat(trimmed).equal(batch)  # re-padded to the widest part
    with pytest.raises(ValueError, match=r"sum to the batch size 6"):
        batch.split([2, 2])


def test_cat_widens_route_dtypes_and_requires_consistent_routes(trajectories):
    wide = make_trajectory(random.Random(0), max_expert=1000)
    a, b = collate_trajectories(trajectories[:2]), collate_trajectories([wide])
    assert a.routed_experts.dtype == torch.uint8 and b.routed_experts.dtype == torch.int16
    joined = RolloutBatch.cat([a, b])
    assert_batch_matches(joined, [*trajectories[:2], wide])
    no_routes = collate_trajectories([make_trajectory(random.Random(1), routes="none")])
    with pytest.raises(ValueError, match=r"either every batch has routed_experts or none does"):
        RolloutBatch.cat([a, no_routes])


def test_repeat_and_repeat_interleave(batch, trajectories):
    check_rows(batch.repeat(2), trajectories, list(range(6)) * 2)
    assert len(batch.repeat(0)) == 0
    with pytest.raises(ValueError, match="repeats must be an int >= 0, got -1"):
        batch.repeat(-1)
    check_rows(batch.repeat_interleave(3), trajectories, [r for r in range(6) for _ in range(3)])
    check_rows(batch.repeat_interleave([0, 1, 2, 0, 0, 1]), trajectories, [1, 2, 2, 5])
    with pytest.raises(ValueError, match=r"one count >= 0 per row \(6\)"):
        batch.repeat_interleave([1, 2])


def test_pad_to_multiple_adds_zero_loss_rows_with_dummy_routes(batch, trajectories):
    padded = batch.pad_to_multiple(4, num_layers=3, top_k=2, num_experts=8, pad_token_id=5)
    assert len(padded) == 8
    check_rows(padded[:6], trajectories, range(6))
    extra = padded[6:]
    assert extra.loss_mask.sum() == 0 and extra.advantages.tolist() == [0.0, 0.0]
    assert extra.lengths_host()[0].tolist() == [1, 1] and extra.input_ids[:, -1].tolist() == [5, 5]
    assert extra.attention_mask.sum(dim=1).tolist() == [1, 1]
    expected = dummy_routes(2, 3, 2, 8)
    assert torch.equal(extra.routed_experts.values.to(expected.dtype), expected)
    assert batch.pad_to_multiple(3) is batch
    with pytest.raises(ValueError, match=r"num_experts is required"):
        batch.pad_to_multiple(4)
    with pytest.raises(
        ValueError, match=r"\(num_layers, top_k\) = \(4, 2\) does not match the routes' schema \(3, 2\)"
    ):
        batch.pad_to_multiple(4, num_layers=4, num_experts=8)


def test_pad_to_multiple_without_routes():
    rng = random.Random(3)
    batch = collate_trajectories([make_trajectory(rng, routes="none") for _ in range(3)])
    padded = batch.pad_to_multiple(2)
    assert len(padded) == 4 and padded.routed_experts is None and padded.loss_mask[3].sum() == 0


def test_position_ids_count_each_rows_real_tokens(batch):
    width = batch.attention_mask.shape[1]
    expected = [[0] * (width - n) + list(range(n)) for n in batch.sequence_lengths.tolist()]
    assert batch.position_ids.tolist() == expected


def test_pickle_round_trip_including_bfloat16(batch):
    again = pickle.loads(pickle.dumps(batch))
    assert again.equal(batch) and again.lengths_host()[0].tolist() == batch.lengths_host()[0].tolist()
    half = RolloutBatch(
        **{name: getattr(batch, name) for name in ("input_ids", "attention_mask", "loss_mask", "advantages")},
        rollout_logprobs=batch.rollout_logprobs.to(torch.bfloat16),
        rewards=batch.rewards.to(torch.bfloat16),
        prompt_lengths=batch.prompt_lengths,
        sequence_lengths=batch.sequence_lengths,
        routed_experts=batch.routed_experts,
    )
    again = pickle.loads(pickle.dumps(half, protocol=5))
    assert again.rollout_logprobs.dtype == torch.bfloat16 and again.equal(half)
    view = batch[1:2]  # a view pickles only its own rows
    assert len(pickle.dumps(view)) < len(pickle.dumps(batch))
    assert pickle.loads(pickle.dumps(view)).equal(view)


def test_to_moves_every_field_including_routes(batch):
    assert batch.to("cpu") is batch
    moved = batch.to("meta")
    names = ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs", "advantages", "rewards")
    assert all(getattr(moved, n).device.type == "meta" for n in names)
    assert moved.prompt_lengths.device.type == "meta" and moved.sequence_lengths.device.type == "meta"
    assert isinstance(moved.routed_experts, PackedTensor) and moved.routed_experts.device.type == "meta"
    assert moved.routed_experts.cu_seqlens.device.type == "meta"
    assert moved.lengths_host()[0].device.type == "cpu"  # host lengths travel along, no sync
    assert moved.routed_experts.cu_seqlens_host.device.type == "cpu"


@run_if(cuda=True)  # pinned memory
def test_pin_memory_and_gpu_round_trip(batch):
    pinned = batch.pin_memory()
    assert pinned.is_pinned() and pinned.pin_memory() is pinned and not batch.is_pinned()
    assert pinned.to("cuda", non_blocking=True).cpu().equal(batch)


def test_construction_validates_shapes(batch):
    fields = {name: getattr(batch, name) for name in (*TOKEN_FIELDS, *ROW_FIELDS, "routed_experts")}
    with pytest.raises(ValueError, match=r"RolloutBatch.loss_mask must have shape \(6, \d+\) like input_ids"):
        RolloutBatch(**{**fields, "loss_mask": batch.loss_mask[:, 1:]})
    with pytest.raises(ValueError, match=r"RolloutBatch.rewards must have shape \(6,\)"):
        RolloutBatch(**{**fields, "rewards": batch.rewards[:2]})
    with pytest.raises(ValueError, match=r"attention_mask must be bool"):
        RolloutBatch(**{**fields, "attention_mask": batch.attention_mask.long()})
    with pytest.raises(ValueError, match=r"one segment per row \(6\), got 2"):
        RolloutBatch(**{**fields, "routed_experts": batch.routed_experts[:2]})
    plain = RolloutBatch(**fields)  # host lengths computed on demand
    assert plain.lengths_host()[0].tolist() == batch.lengths_host()[0].tolist()
    assert plain.response_lengths.tolist() == [t - p for t, p in zip(*batch.lengths_host(), strict=True)]
    assert plain.num_tokens == int(batch.attention_mask.sum())
    plain.release()  # unpooled: nothing to hand back


def test_counts_and_sizes_must_be_ints(batch):
    for bad in (1.5, True, [1.0] * 6, [True, 1, 1, 1, 1, 1]):
        with pytest.raises(ValueError, match="repeats must"):
            batch.repeat_interleave(bad)
    with pytest.raises(ValueError, match="split size must be an int >= 1, got True"):
        batch.split(True)
    with pytest.raises(ValueError, match=r"chunks must be an int >= 1, got 2\.5"):
        batch.chunk(2.5)
    with pytest.raises(ValueError, match=r"multiple must be an int >= 1, got 4\.0"):
        batch.pad_to_multiple(4.0, num_experts=8)
