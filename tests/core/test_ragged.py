"""Host index maths of r3lightning.ragged against hand-written values."""

import numpy as np
import pytest
import torch

from r3lightning.padded import padded_flat_index
from r3lightning.ragged import (
    batch_index,
    host_int64,
    host_lengths,
    offsets_from_lengths,
    segment_ids_and_positions,
    tensor_from_bytes,
    tensor_to_bytes,
    to_device_async,
)


def test_ragged_batch_index_lengths_and_bytes_helpers():
    assert batch_index(-2, 6, owner="X", unit="row") == 4
    assert batch_index(slice(5, 1), 6, owner="X", unit="row") == slice(5, 5)
    assert batch_index(slice(4, 1, 2), 6, owner="X", unit="row").tolist() == []
    assert batch_index(slice(5, None, -2), 6, owner="X", unit="row").tolist() == [5, 3, 1]
    assert batch_index((1, -1), 6, owner="X", unit="row").tolist() == [1, 5]
    assert batch_index(np.array([True, False, True]), 3, owner="X", unit="row").tolist() == [0, 2]
    with pytest.raises(IndexError, match=r"row 3 is out of range for a X of 3 rows"):
        batch_index(torch.tensor([0, 3]), 3, owner="X", unit="row")
    with pytest.raises(TypeError, match="unsupported X index of type str"):
        batch_index("0", 3, owner="X", unit="row")
    assert batch_index(torch.tensor(2), 3, owner="X", unit="row") == 2
    with pytest.raises(TypeError, match="unsupported X index of type float"):  # not truncated
        batch_index(np.array(1.5), 3, owner="X", unit="row")
    with pytest.raises(TypeError, match="bool scalar"):
        batch_index(torch.tensor(True), 3, owner="X", unit="row")

    assert host_lengths(np.array([2, 0], dtype=np.uint8), "n").tolist() == [2, 0]
    with pytest.raises(ValueError, match=r"n must hold ints, got \[1, True\]"):
        host_lengths([1, True], "n")
    with pytest.raises(ValueError, match=r"n must be >= 0, got \[1, -1\]"):
        host_lengths(torch.tensor([1, -1]), "n")

    for tensor in (torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16), torch.empty(0, 3, dtype=torch.int64)):
        raw, dtype_name, shape = tensor_to_bytes(tensor)
        raw.flags.writeable = False  # as an out-of-band pickle buffer may be
        back = tensor_from_bytes(raw, dtype_name, shape)
        assert back.dtype == tensor.dtype and torch.equal(back, tensor)


def test_ragged_index_helpers():
    lengths = torch.tensor([2, 0, 3])
    assert offsets_from_lengths(lengths).tolist() == [0, 2, 2, 5]
    assert offsets_from_lengths(lengths).dtype == torch.int32
    segment, position = segment_ids_and_positions(lengths)
    assert segment.tolist() == [0, 0, 2, 2, 2] and position.tolist() == [0, 1, 0, 1, 2]
    # [3, 4] grid: left padding puts each segment at the right end of its row
    assert padded_flat_index(lengths, 4, "left").tolist() == [2, 3, 9, 10, 11]
    assert padded_flat_index(lengths, 4, "right").tolist() == [0, 1, 8, 9, 10]
    assert host_int64(np.array([1, 2], dtype=np.uint8), "n").dtype == torch.int64
    assert host_int64([], "n").shape == (0,)
    host = torch.arange(3)
    assert to_device_async(host, torch.device("cpu")) is host
    assert to_device_async(host, torch.device("meta")).device.type == "meta"
    with pytest.raises(ValueError, match=r"counts must be >= 0, got counts\[0\] = -2"):
        offsets_from_lengths(torch.tensor([-2]), "counts")
    with pytest.raises(ValueError, match=r"n must hold integers, got dtype torch\.bool"):
        host_int64(torch.tensor([True]), "n")
