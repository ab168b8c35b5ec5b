import align_reference as ref
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from runif import run_if

from r3lightning.align.align import align_packed_token_metadata, build_replay_mask, scatter_to_padded_batch
from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.packed import PackedTensor
from r3lightning.routes import dummy_routes

L, K, E = 3, 2, 5
LENGTHS = [4, 0, 7, 1, 5]


def left_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.tensor(
        [[col >= width - n for col in range(width)] for n in lengths], dtype=torch.bool
    ).reshape(len(lengths), width)


def grid_of(layout: TokenMetadataLayout) -> list[list[object]]:
    """The layout's placement, read back only to feed the reference's loops.

    The placement itself is checked against the reference in test_layout.py; the reference grids
    are recomputed independently below wherever placement matters.
    """
    seq = layout.position_sequence.reshape(layout.token_shape).tolist()
    off = layout.position_offset.reshape(layout.token_shape).tolist()
    return [
        [None if i < 0 else (i, j) for i, j in zip(r1, r2, strict=True)]
        for r1, r2 in zip(seq, off, strict=True)
    ]


def reference_grid(kind, lengths, width=None, side="left", multiple=1, cp_size=1, cp_rank=0):
    if kind == "padded":
        return ref.padded_positions(lengths, width, multiple, side)
    return ref.packed_positions(lengths, multiple, cp_size, cp_rank)


def make_layout(kind, lengths, width=None, side="left", multiple=1, cp_size=1, cp_rank=0):
    if kind == "padded":
        return TokenMetadataLayout.padded(left_mask(lengths, width), side=side, pad_to_multiple=multiple)
    return TokenMetadataLayout.packed(lengths, pad_to_multiple=multiple, cp_size=cp_size, cp_rank=cp_rank)


def random_segments(lengths, starts, counts, generator):
    return [
        torch.randint(0, E, (c, L, K), generator=generator, dtype=torch.int64).to(torch.uint8) for c in counts
    ]


LAYOUTS = [
    ("padded", {"width": 8, "side": "left", "multiple": 1}),
    ("padded", {"width": 8, "side": "left", "multiple": 8}),
    ("padded", {"width": 7, "side": "right", "multiple": 2}),
    ("packed", {"multiple": 1}),
    ("packed", {"multiple": 2}),
    ("packed", {"multiple": 8}),
    *[("packed", {"multiple": 4, "cp_size": 2, "cp_rank": r}) for r in range(2)],
    *[("packed", {"multiple": 8, "cp_size": 4, "cp_rank": r}) for r in range(4)],
]
COVERAGE = {
    "full": (None, LENGTHS),
    "short": (None, [2, 0, 7, 0, 3]),
    "starts": ([1, 0, 3, 1, 0], [3, 0, 2, 0, 5]),
}


@pytest.mark.parametrize(("kind", "kwargs"), LAYOUTS)
@pytest.mark.parametrize("coverage", sorted(COVERAGE))
@pytest.mark.parametrize("next_token", [False, True])
def test_align_matches_reference(kind, kwargs, coverage, next_token):
    starts, counts = COVERAGE[coverage]
    gen = torch.Generator().manual_seed(0)
    segments = random_segments(LENGTHS, starts, counts, gen)
    packed = PackedTensor.from_segments(segments)
    layout = make_layout(kind, LENGTHS, **kwargs)
    grid = reference_grid(kind, LENGTHS, **kwargs)
    assert grid_of(layout) == grid

    dummy = dummy_routes(layout.num_positions, L, K, E)
    got = align_packed_token_metadata(
        packed, layout, pad=lambda n: dummy_routes(n, L, K, E), segment_starts=starts, next_token=next_token
    )
    expected = ref.align(grid, segments, LENGTHS, starts, lambda k: dummy[k], next_token)
    assert got.dtype == torch.uint8
    assert got.shape == (*layout.token_shape, L, K)
    assert torch.equal(got, expected)

    scalar = align_packed_token_metadata(packed, layout, pad=7, segment_starts=starts, next_token=next_token)
    seven = torch.full((L, K), 7, dtype=torch.uint8)
    assert torch.equal(scalar, ref.align(grid, segments, LENGTHS, starts, lambda k: seven, next_token))

    mask = build_replay_mask(packed, layout, segment_starts=starts)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, ref.covered_mask(grid, counts, starts))
    assert torch.equal(build_replay_mask(counts, layout, starts), mask)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_context_parallel_shards_reassemble_to_unsharded(cp_size):
    multiple = 4 * cp_size
    starts, counts = COVERAGE["starts"]
    segments = random_segments(LENGTHS, starts, counts, torch.Generator().manual_seed(1))
    packed = PackedTensor.from_segments(segments)
    full = align_packed_token_metadata(
        packed, TokenMetadataLayout.packed(LENGTHS, pad_to_multiple=multiple), pad=9, segment_starts=starts
    )
    shards = [
        align_packed_token_metadata(
            packed,
            TokenMetadataLayout.packed(LENGTHS, pad_to_multiple=multiple, cp_size=cp_size, cp_rank=r),
            pad=9,
            segment_starts=starts,
        )
        for r in range(cp_size)
    ]
    # undo the load-balanced sharding: sequence by sequence, rank r owns chunks r and 2cp-1-r
    rebuilt, cursor = [], [0] * cp_size
    for n in LENGTHS:
        padded = -(-n // multiple) * multiple
        chunk = padded // (2 * cp_size)
        pieces = [None] * (2 * cp_size)
        for r in range(cp_size):
            local = shards[r][0, cursor[r] : cursor[r] + 2 * chunk]
            pieces[r], pieces[2 * cp_size - 1 - r] = local[:chunk], local[chunk:]
            cursor[r] += 2 * chunk
        rebuilt.extend(pieces)
    assert torch.equal(torch.cat(rebuilt)[None], full)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("next_token", [False, True])
def test_scatter_round_trip_from_every_rank(cp_size, next_token):
    width = 9
    batch = torch.randn(len(LENGTHS), width, 2, generator=torch.Generator().manual_seed(2))
    real = left_mask(LENGTHS, width)
    out = None
    for rank in range(cp_size):
        layout = TokenMetadataLayout.packed(
            LENGTHS, pad_to_multiple=4 * cp_size, cp_size=cp_size, cp_rank=rank
        )
        shard = layout.from_batch(batch, pad=float("nan"), next_token=next_token)
        expected = ref.scatter(grid_of(layout), shard, LENGTHS, width, -5.0, out=None, next_token=next_token)
        alone = scatter_to_padded_batch(shard, layout, width=width, pad=-5.0, next_token=next_token)
        assert torch.equal(alone, expected)
        out = scatter_to_padded_batch(shard, layout, width=width, pad=-5.0, out=out, next_token=next_token)
    # every real token (but the first of each sequence when shifted) comes back exactly
    written = real.clone()
    if next_token:
        for i, n in enumerate(LENGTHS):
            if n:
                written[i, width - n] = False
    assert torch.equal(out[written], batch[written])
    assert (out[~written] == -5.0).all()


@pytest.mark.parametrize("side", ["left", "right"])
def test_scatter_round_trip_padded(side):
    batch = torch.arange(len(LENGTHS) * 7).reshape(len(LENGTHS), 7)
    layout = TokenMetadataLayout.padded(left_mask(LENGTHS, 7), side=side, pad_to_multiple=4)
    back = scatter_to_padded_batch(layout.from_batch(batch), layout, pad=-1)
    real = left_mask(LENGTHS, 7)
    assert torch.equal(back, torch.where(real, batch, -1))


def test_row_pad_and_dtype_promotion():
    packed = PackedTensor.from_segments([torch.tensor([[[1]], [[2]]], dtype=torch.uint8)])
    layout = TokenMetadataLayout.packed([3], pad_to_multiple=4)
    got = align_packed_token_metadata(packed, layout, pad=torch.tensor([300], dtype=torch.int16))
    assert got.dtype == torch.int16
    assert got[0, :, 0, 0].tolist() == [1, 2, 300, 300]
    wide = align_packed_token_metadata(packed, layout, pad=lambda n: dummy_routes(n, 1, 1, 400))
    assert wide.dtype == torch.int16 and wide[0, :, 0, 0].tolist() == [1, 2, 0, 1]


def test_all_segments_empty():
    packed = PackedTensor.from_segments([torch.zeros(0, L, K, dtype=torch.uint8)] * 2)
    layout = TokenMetadataLayout.packed([3, 2], pad_to_multiple=2)
    got = align_packed_token_metadata(packed, layout, pad=lambda n: dummy_routes(n, L, K, E))
    assert torch.equal(got[0], dummy_routes(6, L, K, E))
    assert not build_replay_mask(packed, layout).any()


def test_align_errors():
    layout = TokenMetadataLayout.packed([4, 3])
    packed = PackedTensor.from_segments(
        [torch.zeros(2, L, K, dtype=torch.uint8), torch.zeros(3, L, K, dtype=torch.uint8)]
    )
    with pytest.raises(
        ValueError,
        match=r"segment 1 has 3 rows starting at real-token offset 1, but trajectory 1 has only 2 real tokens "
        r"from there \(3 in all\)",
    ):
        align_packed_token_metadata(packed, layout, pad=0, segment_starts=[0, 1])
    too_long = PackedTensor.from_segments(
        [torch.zeros(5, L, K, dtype=torch.uint8), torch.zeros(0, L, K, dtype=torch.uint8)]
    )
    with pytest.raises(
        ValueError, match="segment 0 has 5 rows starting at real-token offset 0, but trajectory 0 has only 4"
    ):
        align_packed_token_metadata(too_long, layout, pad=0)
    with pytest.raises(ValueError, match="packed metadata has 1 segments but the layout has 2 trajectories"):
        align_packed_token_metadata(packed[:1], layout, pad=0)
    with pytest.raises(ValueError, match=r"segment_starts must have one entry per trajectory \(2\), got 3"):
        align_packed_token_metadata(packed, layout, pad=0, segment_starts=[0, 0, 0])
    with pytest.raises(ValueError, match="segment_starts must be >= 0"):
        align_packed_token_metadata(packed, layout, pad=0, segment_starts=[0, -1])
    with pytest.raises(ValueError, match=r"pad -1 is not representable in the metadata dtype torch\.uint8"):
        align_packed_token_metadata(packed, TokenMetadataLayout.packed([4, 3], pad_to_multiple=8), pad=-1)
    with pytest.raises(
        ValueError, match=r"pad\(11\) must return a tensor of shape \(11, 3, 2\), got \(11, 2, 2\)"
    ):
        align_packed_token_metadata(
            packed,
            TokenMetadataLayout.packed([4, 3], pad_to_multiple=8),
            pad=lambda n: dummy_routes(n, 2, K, E),
        )
    with pytest.raises(ValueError, match=r"pad row of shape \(4,\) does not broadcast to row shape \(3, 2\)"):
        align_packed_token_metadata(packed, layout, pad=torch.zeros(4))
    with pytest.raises(ValueError, match="pad must be a scalar, a row tensor or a callable"):
        align_packed_token_metadata(packed, layout, pad="x")
    with pytest.raises(TypeError, match="packed must be a PackedTensor"):
        align_packed_token_metadata(torch.zeros(7, L, K), layout, pad=0)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        build_replay_mask([1, -1], layout)


def test_scatter_errors():
    layout = TokenMetadataLayout.packed([4, 3], pad_to_multiple=2)
    with pytest.raises(
        ValueError, match=r"tensor must have the layout's token shape \(1, 8\) leading, got \(1, 7\)"
    ):
        scatter_to_padded_batch(torch.zeros(1, 7), layout)
    with pytest.raises(ValueError, match=r"batch width must be an int >= the longest sequence \(4\), got 3"):
        scatter_to_padded_batch(torch.zeros(1, 8), layout, width=3)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor of shape \(2, 4\)"):
        scatter_to_padded_batch(torch.zeros(1, 8), layout, out=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        scatter_to_padded_batch(torch.zeros(1, 8), layout, out=torch.zeros(4, 2).t())


@st.composite
def layouts_and_segments(draw):
    lengths = draw(st.lists(st.integers(0, 9), min_size=0, max_size=4))
    kind = draw(st.sampled_from(["padded", "packed"]))
    if kind == "padded":
        kwargs = {
            "width": max(lengths, default=0) + draw(st.integers(0, 2)),
            "side": draw(st.sampled_from(["left", "right"])),
            "multiple": draw(st.sampled_from([1, 2, 8])),
        }
    else:
        cp_size = draw(st.sampled_from([1, 2, 4]))
        kwargs = {
            "multiple": cp_size * 2 * draw(st.integers(1, 3))
            if cp_size > 1
            else draw(st.sampled_from([1, 2, 8])),
            "cp_size": cp_size,
            "cp_rank": draw(st.integers(0, cp_size - 1)),
        }
    starts = [draw(st.integers(0, n)) for n in lengths]
    counts = [draw(st.integers(0, n - s)) for n, s in zip(lengths, starts, strict=True)]
    return lengths, kind, kwargs, starts, counts, draw(st.booleans())


def same_positions(got: torch.Tensor, expected: torch.Tensor, token_shape: tuple[int, ...]) -> bool:
    """Exact equality; the reference cannot tell the width of a zero-row grid, so compare flat."""
    assert tuple(got.shape[:2]) == token_shape
    return torch.equal(got.flatten(0, 1), expected.flatten(0, 1))


@settings(max_examples=60, deadline=None)
@given(case=layouts_and_segments(), seed=st.integers(0, 2**16))
def test_random_layouts_match_reference(case, seed):
    lengths, kind, kwargs, starts, counts, next_token = case
    segments = random_segments(lengths, starts, counts, torch.Generator().manual_seed(seed))
    packed = (
        PackedTensor.from_segments(segments) if segments else PackedTensor.empty((L, K), dtype=torch.uint8)
    )
    layout = make_layout(kind, lengths, **kwargs)
    grid = reference_grid(kind, lengths, **kwargs)
    if grid:
        assert grid_of(layout) == grid
    shape = layout.token_shape
    dummy = dummy_routes(layout.num_positions, L, K, E)
    got = align_packed_token_metadata(
        packed, layout, pad=lambda n: dummy_routes(n, L, K, E), segment_starts=starts, next_token=next_token
    )
    expected = ref.align(grid, segments, lengths, starts, lambda k: dummy[k], next_token, row_shape=(L, K))
    assert same_positions(got, expected, shape)
    mask = build_replay_mask(packed, layout, starts)
    assert same_positions(mask, ref.covered_mask(grid, counts, starts), shape)
    width = max(lengths, default=0) + 1
    batch = torch.randint(0, 1000, (len(lengths), width))
    laid = layout.from_batch(batch, pad=-1, next_token=next_token)
    assert same_positions(laid, ref.from_batch(grid, batch, lengths, -1, next_token), shape)
    back = scatter_to_padded_batch(laid, layout, width=width, pad=-2, next_token=next_token)
    assert torch.equal(back, ref.scatter(grid, laid, lengths, width, -2, next_token=next_token))


@run_if(cuda=True)
def test_cuda_alignment_never_synchronises():
    segments = random_segments(LENGTHS, None, LENGTHS, torch.Generator().manual_seed(3))
    packed = PackedTensor.from_segments(segments)
    layout = TokenMetadataLayout.packed(LENGTHS, pad_to_multiple=8, cp_size=2, cp_rank=1)
    expected = align_packed_token_metadata(packed, layout, pad=lambda n: dummy_routes(n, L, K, E))
    expected_scalar = align_packed_token_metadata(packed, layout, pad=3)
    logprobs = torch.randn(layout.token_shape)
    expected_back = scatter_to_padded_batch(logprobs, layout, pad=0.0)
    on_device = packed.to("cuda")
    logprobs_device = logprobs.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = align_packed_token_metadata(on_device, layout, pad=lambda n: dummy_routes(n, L, K, E))
        got_scalar = align_packed_token_metadata(on_device, layout, pad=3)
        mask = build_replay_mask(on_device, layout)
        back = scatter_to_padded_batch(logprobs_device, layout, pad=0.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.is_cuda and mask.is_cuda and back.is_cuda
    assert torch.equal(got.cpu(), expected) and torch.equal(got_scalar.cpu(), expected_scalar)
    assert torch.equal(mask.cpu(), build_replay_mask(packed, layout))
    assert torch.equal(back.cpu(), expected_back)


def test_scalar_pads_must_fit_the_dtype_but_floats_may_round():
    layout = TokenMetadataLayout.packed([2, 1], pad_to_multiple=4)
    routes = PackedTensor.from_segments(
        [torch.zeros(2, 1, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8)]
    )
    for bad in (300, float("nan"), 0.5, -1):
        with pytest.raises(ValueError, match=r"is not representable in the metadata dtype torch\.uint8"):
            align_packed_token_metadata(routes, layout, pad=bad)
    logprobs = PackedTensor.from_segments([torch.tensor([-1.0, -2.0]), torch.tensor([-3.0])])
    got = align_packed_token_metadata(logprobs, layout, pad=0.1)
    pad = torch.tensor(0.1, dtype=torch.float32).item()
    assert got.tolist() == [[-1.0, -2.0, pad, pad, -3.0, pad, pad, pad]]


def test_scatter_pad_must_fit_the_dtype():
    layout = TokenMetadataLayout.packed([2, 1])
    tokens = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"pad 0\.5 is not representable in the dtype torch\.int64"):
        scatter_to_padded_batch(tokens, layout, pad=0.5)
    with pytest.raises(ValueError, match=r"pad -1 is not representable in the dtype torch\.bool"):
        scatter_to_padded_batch(tokens > 5, layout, pad=-1)
    assert scatter_to_padded_batch(tokens, layout, pad=-100).tolist() == [[5, 6], [-100, 7]]
