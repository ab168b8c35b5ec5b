import align_reference as ref
import pytest
import torch

from r3lightning.align.layout import TokenMetadataLayout, split_for_sequence_parallel


def left_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.tensor([[col >= width - n for col in range(width)] for n in lengths], dtype=torch.bool)


def grid_of(layout: TokenMetadataLayout) -> list[list[object]]:
    seq = layout.position_sequence.reshape(layout.token_shape).tolist()
    off = layout.position_offset.reshape(layout.token_shape).tolist()
    return [
        [None if i < 0 else (i, j) for i, j in zip(r1, r2, strict=True)]
        for r1, r2 in zip(seq, off, strict=True)
    ]


LENGTHS = [3, 0, 5, 1, 4]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("multiple", [1, 2, 8])
def test_padded_positions_match_reference(side, multiple):
    layout = TokenMetadataLayout.padded(left_mask(LENGTHS, 6), side=side, pad_to_multiple=multiple)
    expected = ref.padded_positions(LENGTHS, 6, multiple, side)
    assert layout.kind == "padded"
    assert layout.token_shape == (5, len(expected[0]))
    assert grid_of(layout) == expected
    assert layout.sequence_lengths.tolist() == LENGTHS
    assert layout.batch_width == 6
    assert layout.cu_seqlens_padded is None and layout.cp_size == 1 and layout.cp_rank == 0
    ids = [[0 if cell is None else cell[1] for cell in row] for row in expected]
    assert layout.position_ids.tolist() == ids
    assert layout.token_mask.tolist() == [[cell is not None for cell in row] for row in expected]


def test_padded_accepts_integer_mask():
    layout = TokenMetadataLayout.padded(left_mask([2, 1], 3).long())
    assert layout.sequence_lengths.tolist() == [2, 1]


@pytest.mark.parametrize("multiple", [1, 2, 8])
def test_packed_positions_match_reference(multiple):
    layout = TokenMetadataLayout.packed(LENGTHS, pad_to_multiple=multiple)
    assert layout.kind == "packed"
    expected = ref.packed_positions(LENGTHS, multiple)
    assert grid_of(layout) == expected
    assert layout.token_shape == (1, len(expected[0]))
    assert layout.position_ids.tolist() == [ref.packed_position_ids(LENGTHS, multiple)]
    padded = [len(s) for s in ref.packed_spans(LENGTHS, multiple)]
    assert layout.cu_seqlens_padded.dtype == torch.int32
    assert layout.cu_seqlens_padded.tolist() == [sum(padded[:i]) for i in range(len(padded) + 1)]
    assert layout.cu_seqlens.tolist() == [sum(LENGTHS[:i]) for i in range(len(LENGTHS) + 1)]
    assert layout.max_seqlen_padded == max(padded)
    assert layout.batch_width == max(LENGTHS)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_packed_context_parallel_every_rank(cp_size):
    multiple = 2 * cp_size * 2  # 2 * TP * CP with TP = 2
    full = ref.packed_positions(LENGTHS, multiple)[0]
    shards = []
    for rank in range(cp_size):
        layout = TokenMetadataLayout.packed(LENGTHS, pad_to_multiple=multiple, cp_size=cp_size, cp_rank=rank)
        expected = ref.packed_positions(LENGTHS, multiple, cp_size, rank)
        assert grid_of(layout) == expected
        assert layout.token_shape == (1, len(full) // cp_size)
        assert layout.position_ids.tolist() == [ref.packed_position_ids(LENGTHS, multiple, cp_size, rank)]
        assert layout.cp_size == cp_size and layout.cp_rank == rank
        shards.append(grid_of(layout)[0])
    # the shards are a partition of the unsharded layout's positions
    real_full = sorted(c for c in full if c is not None)
    real_shards = sorted(c for shard in shards for c in shard if c is not None)
    assert real_shards == real_full


def test_empty_batch_and_empty_sequences():
    layout = TokenMetadataLayout.packed([], pad_to_multiple=4)
    assert layout.token_shape == (1, 0) and layout.batch_size == 0
    layout = TokenMetadataLayout.packed([0, 0], pad_to_multiple=4, cp_size=2, cp_rank=1)
    assert layout.token_shape == (1, 0)
    layout = TokenMetadataLayout.padded(torch.zeros(2, 3, dtype=torch.bool))
    assert layout.token_mask.sum() == 0


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("next_token", [False, True])
def test_from_batch_padded(side, next_token):
    batch = torch.arange(5 * 6 * 2).reshape(5, 6, 2)
    layout = TokenMetadataLayout.padded(left_mask(LENGTHS, 6), side=side, pad_to_multiple=4)
    got = layout.from_batch(batch, pad=-1, next_token=next_token)
    expected = ref.from_batch(grid_of(layout), batch, LENGTHS, -1, next_token)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_from_batch_packed_input_ids(cp_rank):
    input_ids = torch.randint(0, 100, (5, 7))
    layout = TokenMetadataLayout.packed(LENGTHS, pad_to_multiple=4, cp_size=2, cp_rank=cp_rank)
    got = layout.from_batch(input_ids, pad=0)
    assert torch.equal(got, ref.from_batch(grid_of(layout), input_ids, LENGTHS, 0))
    labels = layout.from_batch(input_ids, pad=-100, next_token=True)
    assert torch.equal(labels, ref.from_batch(grid_of(layout), input_ids, LENGTHS, -100, next_token=True))


def test_from_batch_row_callable_pad():
    layout = TokenMetadataLayout.packed([2, 1], pad_to_multiple=2)
    batch = torch.tensor([[1.0, 2.0], [0.0, 3.0]])
    got = layout.from_batch(batch, pad=lambda n: torch.arange(n, dtype=torch.float32) + 100)
    assert got.tolist() == [[1.0, 2.0, 3.0, 100.0]]


def test_split_for_sequence_parallel_reassembles():
    routes = torch.arange(1 * 12 * 2 * 3).reshape(1, 12, 2, 3)
    parts = [split_for_sequence_parallel(routes, 4, r) for r in range(4)]
    assert all(p.shape == (1, 3, 2, 3) for p in parts)
    assert parts[1].data_ptr() == routes[:, 3:6].data_ptr()  # a view, no copy
    assert torch.equal(torch.cat(parts, dim=1), routes)
    batch = torch.arange(2 * 8).reshape(2, 8)
    assert torch.equal(split_for_sequence_parallel(batch, 2, 1), batch[:, 4:])


def test_split_for_sequence_parallel_errors():
    t = torch.zeros(1, 10)
    with pytest.raises(ValueError, match="not divisible by tp_size=4"):
        split_for_sequence_parallel(t, 4, 0)
    with pytest.raises(ValueError, match=r"tp_rank must be an int in \[0, 2\)"):
        split_for_sequence_parallel(t, 2, 2)
    with pytest.raises(ValueError, match="tp_size must be an int >= 1"):
        split_for_sequence_parallel(t, 0, 0)
    with pytest.raises(ValueError, match="dim 3 out of range"):
        split_for_sequence_parallel(t, 2, 0, dim=3)


def test_padded_errors():
    right_padded = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="attention_mask row 0 is not left-padded"):
        TokenMetadataLayout.padded(right_padded)
    holey = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="attention_mask row 1 is not left-padded"):
        TokenMetadataLayout.padded(holey, side="right")
    with pytest.raises(ValueError, match="bool or hold only 0/1"):
        TokenMetadataLayout.padded(torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match=r"2-D \[batch, seq\]"):
        TokenMetadataLayout.padded(torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="side must be 'left' or 'right'"):
        TokenMetadataLayout.padded(torch.ones(1, 3, dtype=torch.bool), side="middle")
    with pytest.raises(ValueError, match="pad_to_multiple must be an int >= 1"):
        TokenMetadataLayout.padded(torch.ones(1, 3, dtype=torch.bool), pad_to_multiple=0)


def test_packed_errors():
    with pytest.raises(ValueError, match=r"pad_to_multiple \(4\) must be a multiple of 2 \* cp_size = 8"):
        TokenMetadataLayout.packed([3], pad_to_multiple=4, cp_size=4)
    with pytest.raises(ValueError, match=r"cp_rank must be an int in \[0, 2\) for cp_size=2, got 2"):
        TokenMetadataLayout.packed([3], pad_to_multiple=4, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="cp_size must be an int >= 1"):
        TokenMetadataLayout.packed([3], cp_size=0)
    with pytest.raises(ValueError, match="sequence_lengths must be >= 0"):
        TokenMetadataLayout.packed([3, -1])
    with pytest.raises(ValueError, match="sequence_lengths must hold integers"):
        TokenMetadataLayout.packed(torch.tensor([1.5]))
    with pytest.raises(ValueError, match="sequence_lengths must hold ints"):
        TokenMetadataLayout.packed([1, 2.0])
    with pytest.raises(ValueError, match=r"batch_width must be an int >= the longest sequence \(5\)"):
        TokenMetadataLayout.packed([5, 2], batch_width=4)
    layout = TokenMetadataLayout.packed([2])
    with pytest.raises(ValueError, match=r"tensor must be a \[B=1, S, ...\] batch tensor"):
        layout.from_batch(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"batch width must be an int >= the longest sequence \(2\)"):
        layout.from_batch(torch.zeros(1, 1))
    with pytest.raises(ValueError, match="max_seqlen_padded is defined for packed layouts only"):
        _ = TokenMetadataLayout.padded(torch.ones(1, 2, dtype=torch.bool)).max_seqlen_padded


@pytest.mark.parametrize(("cp_size", "tp_size"), [(1, 2), (2, 2), (4, 2), (2, 4)])
def test_every_real_token_reaches_exactly_one_cp_tp_rank(cp_size, tp_size):
    multiple = 2 * tp_size * cp_size if cp_size > 1 else tp_size
    seen = []
    for cp_rank in range(cp_size):
        layout = TokenMetadataLayout.packed(
            LENGTHS, pad_to_multiple=multiple, cp_size=cp_size, cp_rank=cp_rank
        )
        expected = ref.packed_positions(LENGTHS, multiple, cp_size, cp_rank)[0]
        share = len(expected) // tp_size
        for tp_rank in range(tp_size):
            local = split_for_sequence_parallel(
                layout.position_sequence.reshape(layout.token_shape), tp_size, tp_rank
            )
            offsets = split_for_sequence_parallel(
                layout.position_offset.reshape(layout.token_shape), tp_size, tp_rank
            )
            cells = [
                None if i < 0 else (i, j) for i, j in zip(local[0].tolist(), offsets[0].tolist(), strict=True)
            ]
            assert cells == expected[tp_rank * share : (tp_rank + 1) * share]
            seen.extend(c for c in cells if c is not None)
    assert sorted(seen) == [(i, j) for i, n in enumerate(LENGTHS) for j in range(n)]
