import pickle
import random

import pytest
import torch
from collate_reference import assert_batch_matches, make_trajectory
from hypothesis import given, settings
from hypothesis import strategies as st
from runif import run_if

from r3lightning.data.collate import PinnedBufferPool, RolloutCollator, collate_trajectories
from r3lightning.packed import PackedTensor
from r3lightning.rollout.trajectory import Trajectory
from r3lightning.routes import dummy_routes


def batch_of(seed, count, **kwargs):
    rng = random.Random(seed)
    return [make_trajectory(rng, **kwargs) for _ in range(count)]


def test_collated_batch_equals_reference_built_per_trajectory():
    trajectories = batch_of(0, 6, routes="random")
    batch = RolloutCollator(num_threads=1, pad_token_id=3)(trajectories)
    assert_batch_matches(batch, trajectories, pad_token_id=3)
    assert isinstance(batch.routed_experts, PackedTensor)
    assert batch.routed_experts.cu_seqlens.dtype == torch.int32


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    count=st.integers(1, 9),
    threads=st.integers(2, 4),
    routes=st.sampled_from(["captured", "random", "none"]),
)
def test_thread_pool_fill_is_identical_to_serial(seed, count, threads, routes):
    trajectories = batch_of(seed, count, routes=routes, max_prompt=6, max_response=7)
    serial = RolloutCollator(num_threads=1)(trajectories)
    collator = RolloutCollator(num_threads=threads)
    try:
        threaded = collator(trajectories)
    finally:
        collator.close()
    assert threaded.equal(serial)
    assert_batch_matches(threaded, trajectories)


def test_none_routes_mixed_with_routes_get_empty_segments():
    rng = random.Random(1)
    trajectories = [make_trajectory(rng), make_trajectory(rng, routes="none"), make_trajectory(rng)]
    batch = collate_trajectories(trajectories)
    assert batch.routed_experts.lengths[1] == 0
    assert_batch_matches(batch, trajectories)


def test_all_none_routes_give_no_routes():
    trajectories = batch_of(2, 3, routes="none")
    assert collate_trajectories(trajectories).routed_experts is None


def test_zero_length_responses_and_zero_route_rows():
    trajectories = [
        Trajectory([4, 5], [], routed_experts=torch.empty(0, 3, 2, dtype=torch.int64)),
        Trajectory([6], [], routed_experts=torch.empty(0, 3, 2, dtype=torch.int64)),
    ]
    batch = collate_trajectories(trajectories)
    assert batch.loss_mask.sum() == 0 and batch.routed_experts.num_rows == 0
    assert batch.routed_experts.row_shape == (3, 2)
    assert_batch_matches(batch, trajectories)


def test_empty_batch():
    batch = RolloutCollator(num_threads=2)([])
    assert len(batch) == 0 and batch.input_ids.shape == (0, 0) and batch.routed_experts is None


def test_widest_route_dtype_in_the_batch_wins():
    narrow = Trajectory([1, 2], [3], routed_experts=torch.tensor([200, 201]).repeat(2, 3, 1))  # uint8
    wide = Trajectory([1], [3], routed_experts=torch.tensor([1000, 999]).repeat(1, 3, 1))  # int16
    batch = collate_trajectories([narrow, wide])
    assert narrow.routed_experts.dtype == torch.uint8 and batch.routed_experts.dtype == torch.int16
    assert_batch_matches(batch, [narrow, wide])


def test_mixed_route_schemas_in_one_batch_are_rejected():
    a = Trajectory([1], [2], routed_experts=torch.zeros(1, 3, 2, dtype=torch.int64))
    b = Trajectory([1], [2], routed_experts=torch.zeros(1, 4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"different route schemas .*\[\(3, 2\), \(4, 2\)\]"):
        RolloutCollator(num_threads=2)([a, b])


def test_width_multiple_adds_left_padding():
    trajectories = batch_of(3, 3)
    batch = RolloutCollator(num_threads=1, width_multiple=8)(trajectories)
    assert batch.width % 8 == 0 and batch.width >= max(t.num_tokens for t in trajectories)
    assert_batch_matches(batch, trajectories)


def test_none_entries_become_zero_loss_placeholders_with_dummy_routes():
    real = batch_of(4, 2, schema=(3, 2))
    batch = RolloutCollator(num_threads=1, num_experts=8, pad_token_id=9)([real[0], None, real[1], None])
    assert_batch_matches(batch[[0, 2]].trim(), real, pad_token_id=9)
    pads = batch[[1, 3]]
    assert pads.lengths_host()[0].tolist() == [1, 1] and pads.loss_mask.sum() == 0
    assert pads.input_ids[:, -1].tolist() == [9, 9] and pads.advantages.tolist() == [0.0, 0.0]
    expected = dummy_routes(2, 3, 2, 8)
    assert torch.equal(
        torch.cat([pads.routed_experts[0], pads.routed_experts[1]]).to(expected.dtype), expected
    )


def test_collator_pickles_without_its_threads():
    collator = RolloutCollator(num_threads=2)
    trajectories = batch_of(5, 4)
    first = collator(trajectories)
    clone = pickle.loads(pickle.dumps(collator))
    assert clone._executor is None and clone(trajectories).equal(first)
    collator.close()
    clone.close()


# ---------------------------------------------------------------------------- buffer pool


class CountingAllocator:
    """Plain CPU allocations standing in for pinned ones, counted."""

    def __init__(self):
        self.calls = 0

    def __call__(self, shape, dtype):
        self.calls += 1
        return torch.empty(shape, dtype=dtype)


class RecordedFence:
    """Records the wait the pool must do before rewriting a slot."""

    def __init__(self):
        self.waited = False

    def synchronize(self):
        self.waited = True


def storage_ptr(batch):
    return batch.input_ids.untyped_storage().data_ptr()


def pooled_collator(**kwargs):
    allocator = CountingAllocator()
    return RolloutCollator(
        num_threads=2, pin_memory=PinnedBufferPool(allocator=allocator, **kwargs)
    ), allocator


def test_pool_reuses_released_buffers_and_never_rewrites_leased_ones():
    collator, allocator = pooled_collator(slots=2)
    trajectories = batch_of(6, 4)
    first = collator(trajectories)
    second = collator(batch_of(7, 4))
    second_copy = pickle.loads(pickle.dumps(second))
    assert storage_ptr(first) != storage_ptr(second)

    third = collator(batch_of(8, 4))  # both slots leased: fresh buffers, pool untouched
    assert collator.pool.misses == 1 and third._lease is None
    assert storage_ptr(third) not in (storage_ptr(first), storage_ptr(second))
    allocations = allocator.calls

    fence = RecordedFence()
    first.release(after=fence)
    fourth = collator(trajectories)
    assert fence.waited  # waited for the (pretend) copy out of the slot before rewriting it
    assert storage_ptr(fourth) == storage_ptr(first)
    assert allocator.calls == allocations + 1  # the slot's buffers reused; only the offsets are fresh
    assert second.equal(second_copy)  # a leased slot was never written
    assert_batch_matches(fourth, trajectories)
    collator.close()


def test_pool_leases_the_least_recently_released_slot():
    """Released one at a time right after their batch (Lightning's pattern without prefetch), the
    slots alternate: a new batch takes the slot whose copy was issued a step earlier, never the
    one just released (whose fence is the copy still running)."""
    collator, _ = pooled_collator(slots=3)
    trajectories = batch_of(6, 4)  # one size: a slot keeps its buffers
    pointers, fences = [], []
    for _ in range(7):
        batch = collator(trajectories)
        pointers.append(storage_ptr(batch))
        fences.append(RecordedFence())
        batch.release(after=fences[-1])
    a, b, c = pointers[:3]
    assert len({a, b, c}) == 3 and pointers == [a, b, c, a, b, c, a]
    # each batch waited on the fence of the batch three steps back, not on the one just issued
    assert [f.waited for f in fences] == [True, True, True, True, False, False, False]
    assert collator.pool.misses == 0 and collator.pool.hits == 7
    collator.close()


def test_moved_copies_share_nothing_with_the_pool():
    collator, _ = pooled_collator(slots=1)
    batch = collator(batch_of(19, 3))
    offsets = batch.routed_experts.cu_seqlens_host.clone()
    lengths = [t.clone() for t in batch.lengths_host()]
    moved = batch.to("meta")  # stands in for an accelerator: a copy of every field
    batch.release()
    again = collator(batch_of(20, 3, max_prompt=1, max_response=1))  # rewrites the slot
    assert again._lease is not None and storage_ptr(again) == storage_ptr(batch)
    assert torch.equal(moved.routed_experts.cu_seqlens_host, offsets)
    assert all(torch.equal(a, b) for a, b in zip(moved.lengths_host(), lengths, strict=True))
    collator.close()


def test_release_is_idempotent_and_stale_leases_cannot_free_a_reused_slot():
    collator, _ = pooled_collator(slots=1, recycle_after=1)
    first = collator(batch_of(9, 2))
    lease = first._lease
    assert collator(batch_of(10, 2))._lease is None  # first may still be in use: a miss
    second = collator(batch_of(10, 2))  # one more batch later the slot is recycled
    assert second._lease is not None and storage_ptr(second) == storage_ptr(first)
    lease()  # stale: must not free the slot second holds
    assert collator.pool.free_slots == 0
    second.release()
    second.release()
    assert collator.pool.free_slots == 1
    collator.close()


def test_recycle_after_frees_unreleased_slots_after_n_batches():
    collator, _ = pooled_collator(slots=2, recycle_after=2)
    a = collator(batch_of(11, 2))
    b = collator(batch_of(12, 2))
    c = collator(batch_of(13, 2))  # a is only 2 batches old: not yet recycled
    assert c._lease is None and collator.pool.misses == 1
    d = collator(batch_of(14, 2))  # a is now 3 batches old
    assert storage_ptr(d) == storage_ptr(a) and b._lease is not None
    collator.close()


def test_pool_buffers_grow_with_headroom_and_shrink_as_views():
    collator, allocator = pooled_collator(slots=1)
    small = batch_of(15, 2, max_prompt=2, max_response=2)
    big = batch_of(16, 5, max_prompt=6, max_response=6)
    a = collator(small)
    a.release()
    calls = allocator.calls
    b = collator(big)  # larger: reallocated
    assert allocator.calls > calls
    assert_batch_matches(b, big)
    b.release()
    calls = allocator.calls
    c = collator(small)  # smaller: views of the grown buffers (only the offsets are fresh)
    assert allocator.calls == calls + 1
    assert_batch_matches(c, small)
    collator.close()


def test_failed_collation_returns_its_slot():
    collator, _ = pooled_collator(slots=1)
    a = Trajectory([1], [2], routed_experts=torch.zeros(1, 3, 2, dtype=torch.int64))
    b = Trajectory([1], [2], routed_experts=torch.zeros(1, 4, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"different route schemas"):
        collator([a, b])
    assert collator.pool.free_slots == 1
    collator.close()


def test_pool_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"slots must be an int >= 1, got 0"):
        PinnedBufferPool(0)
    with pytest.raises(ValueError, match=r"recycle_after must be an int >= 1, got 0"):
        PinnedBufferPool(2, recycle_after=0)
    with pytest.raises(ValueError, match=r"num_threads must be an int >= 1, got 0"):
        RolloutCollator(num_threads=0)


@run_if(cuda=True)  # pinned memory
def test_real_pinned_pool_and_async_transfer():
    collator = RolloutCollator(num_threads=2, pin_memory=PinnedBufferPool(2))
    trajectories = batch_of(17, 4)
    batch = collator(trajectories)
    assert batch.is_pinned()
    on_gpu = batch.to("cuda", non_blocking=True)
    fence = torch.cuda.Event()
    fence.record()
    batch.release(after=fence)
    again = collator(batch_of(18, 4))
    assert again.is_pinned()
    assert_batch_matches(on_gpu.cpu(), trajectories)
    collator.close()


def test_bad_collator_settings_are_rejected_naming_the_field():
    with pytest.raises(ValueError, match=r"num_threads must be an int >= 1, got 2\.5"):
        RolloutCollator(num_threads=2.5)
    trajectories = [make_trajectory(random.Random(1), tag=1)]
    for kwargs, match in (
        ({"width_multiple": 0}, "width_multiple must be an int >= 1, got 0"),
        ({"width_multiple": 1.5}, r"width_multiple must be an int >= 1, got 1\.5"),
        ({"pad_token_id": -1}, "pad_token_id must be an int >= 0, got -1"),
    ):
        with pytest.raises(ValueError, match=match):
            RolloutCollator(num_threads=1, **kwargs)
        with pytest.raises(ValueError, match=match):
            collate_trajectories(trajectories, **kwargs)


def test_batch_and_collate_do_not_import_each_other():
    import ast
    import inspect

    from r3lightning.data import batch as batch_module
    from r3lightning.data import collate as collate_module
    from r3lightning.data import fill as fill_module

    def imports(module):
        tree = ast.parse(inspect.getsource(module))
        return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}

    assert "r3lightning.data.collate" not in imports(batch_module)  # also no function-level import
    assert "r3lightning.data.batch" in imports(collate_module)
    assert not {"r3lightning.data.batch", "r3lightning.data.collate"} & imports(fill_module)
