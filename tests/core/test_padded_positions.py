"""``position_ids_from_mask``: rotary positions of a left-padded batch, defined in the core
(``r3lightning.padded``) and still importable from ``r3lightning.align.layout``."""

import warnings

import pytest
import torch

from r3lightning.padded import position_ids_from_mask


def _reference(mask: list[list[int]]) -> list[list[int]]:
    """Each real token's offset among its row's real tokens; padding gets 0."""
    rows = []
    for row in mask:
        seen = 0
        positions = []
        for real in row:
            positions.append(seen if real else 0)
            seen += int(bool(real))
        rows.append(positions)
    return rows


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.float32])
def test_positions_count_the_real_tokens_of_each_row(dtype):
    mask = [[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1]]
    got = position_ids_from_mask(torch.tensor(mask).to(dtype))
    assert got.dtype == torch.int64
    assert got.tolist() == _reference(mask) == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_an_empty_batch_gives_empty_positions():
    assert position_ids_from_mask(torch.zeros(0, 5, dtype=torch.bool)).shape == (0, 5)


def test_the_public_paths_of_0_2_give_the_core_objects_without_a_warning():
    from r3lightning import padded, routes

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from r3lightning.align.dummy import dummy_routes
        from r3lightning.align.layout import position_ids_from_mask as from_layout

    assert from_layout is padded.position_ids_from_mask
    assert dummy_routes is routes.dummy_routes
