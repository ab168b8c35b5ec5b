import math

import pytest
import torch

from r3lightning.routes import compact_route_dtype, dummy_routes


@pytest.mark.parametrize(("top_k", "num_experts"), [(1, 1), (2, 5), (3, 8), (8, 128), (4, 4), (6, 9)])
def test_rows_distinct_and_rotate_over_all_experts(top_k, num_experts):
    rows = 3 * num_experts
    routes = dummy_routes(rows, 4, top_k, num_experts)
    assert routes.shape == (rows, 4, top_k)
    for r in range(rows):
        for layer in range(4):
            ids = routes[r, layer].tolist()
            assert len(set(ids)) == top_k  # distinct within the row
            assert all(0 <= e < num_experts for e in ids)
            assert ids == routes[r, 0].tolist()
    # any window of ceil(E / K) consecutive rows touches every expert
    window = math.ceil(num_experts / top_k)
    for start in range(rows - window + 1):
        assert set(routes[start : start + window, 0].flatten().tolist()) == set(range(num_experts))
    # over E rows each expert is used exactly top_k times: no expert or EP rank is favoured
    counts = torch.bincount(routes[:num_experts, 0].flatten().long(), minlength=num_experts)
    assert counts.tolist() == [top_k] * num_experts


def test_exact_values_and_prefix_property():
    assert dummy_routes(4, 1, 2, 3)[:, 0].tolist() == [[0, 1], [2, 0], [1, 2], [0, 1]]
    # a shorter request is a prefix of a longer one: padding rows depend only on their rank
    assert torch.equal(dummy_routes(5, 2, 3, 7), dummy_routes(11, 2, 3, 7)[:5])
    assert dummy_routes(0, 2, 3, 7).shape == (0, 2, 3)


def test_dtypes():
    assert dummy_routes(2, 1, 2, 256).dtype == torch.uint8
    assert dummy_routes(2, 1, 2, 257).dtype == torch.int16
    assert dummy_routes(2, 1, 2, 40000).dtype == torch.int32
    assert dummy_routes(2, 1, 2, 8, dtype=torch.int64).dtype == torch.int64
    assert compact_route_dtype(0) == torch.uint8
    assert compact_route_dtype(255) == torch.uint8
    assert compact_route_dtype(32767) == torch.int16
    assert compact_route_dtype(32768) == torch.int32


def test_errors():
    with pytest.raises(ValueError, match=r"top_k \(3\) must be <= num_experts \(2\)"):
        dummy_routes(1, 1, 3, 2)
    with pytest.raises(ValueError, match="num_rows must be an int >= 0"):
        dummy_routes(-1, 1, 1, 2)
    with pytest.raises(ValueError, match="num_layers must be an int >= 1"):
        dummy_routes(1, 0, 1, 2)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        dummy_routes(1, 1, True, 2)
    with pytest.raises(ValueError, match=r"dtype torch\.uint8 cannot hold expert id 299"):
        dummy_routes(1, 1, 1, 300, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dtype must be an integer dtype"):
        dummy_routes(1, 1, 1, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_expert_id must be a non-negative int"):
        compact_route_dtype(-1)
    with pytest.raises(ValueError, match="does not fit in int32"):
        compact_route_dtype(2**31)
