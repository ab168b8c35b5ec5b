import pytest
from packed_reference import LENGTHS, make_segments

from r3lightning import PackedTensor


@pytest.fixture
def packed():
    segments, refs = make_segments(LENGTHS)
    return PackedTensor.from_segments(segments), refs
