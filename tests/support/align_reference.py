"""Deliberately slow reference for token layouts: plain Python loops over every token.

It shares no code with r3lightning.align; it spells out the layouts as DESIGN.md describes them
so the vectorised implementation can be checked for exact equality.
"""

from __future__ import annotations

import torch

# a model-facing position holds (trajectory, real-token offset) or None for padding


def _round_up(n: int, multiple: int) -> int:
    while n % multiple:
        n += 1
    return n


def padded_positions(lengths: list[int], width: int, multiple: int, side: str) -> list[list[object]]:
    """``[B][S']`` grid of (i, j) / None for a padded layout of a left-padded ``[B, width]`` batch."""
    model_width = _round_up(width, multiple)
    grid = []
    for i, n in enumerate(lengths):
        row: list[object] = []
        for col in range(model_width):
            j = col - (model_width - n) if side == "left" else col
            row.append((i, j) if 0 <= j < n else None)
        grid.append(row)
    return grid


def packed_spans(lengths: list[int], multiple: int) -> list[list[object]]:
    """Per sequence, its padded span: (i, j) for real tokens then None for padding."""
    return [[(i, j) if j < n else None for j in range(_round_up(n, multiple))] for i, n in enumerate(lengths)]


def _cp_shard(span: list, cp_size: int, cp_rank: int) -> list:
    """Chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` (all of it for one rank)."""
    if cp_size == 1:
        return list(span)
    chunk = len(span) // (2 * cp_size)
    kept: list = []
    for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
        kept.extend(span[c * chunk : (c + 1) * chunk])
    return kept


def packed_positions(
    lengths: list[int], multiple: int, cp_size: int = 1, cp_rank: int = 0
) -> list[list[object]]:
    """``[1][T_local]`` grid for a packed layout, this CP rank's shard."""
    row: list[object] = []
    for span in packed_spans(lengths, multiple):
        row.extend(_cp_shard(span, cp_size, cp_rank))
    return [row]


def packed_position_ids(lengths: list[int], multiple: int, cp_size: int = 1, cp_rank: int = 0) -> list[int]:
    """Position ids of this CP rank's shard: the offset of every position within its padded span."""
    ids: list[int] = []
    for span in packed_spans(lengths, multiple):
        ids.extend(_cp_shard(list(range(len(span))), cp_size, cp_rank))
    return ids


def align(
    grid: list[list[object]],
    segments: list[torch.Tensor],
    lengths: list[int],
    starts: list[int] | None,
    pad_rows,
    next_token: bool = False,
    row_shape: tuple[int, ...] = (),
) -> torch.Tensor:
    """Dense ``[*grid shape, *row]``: segment rows on covered positions, ``pad_rows(k)`` (the k-th
    uncovered position, in row-major order) elsewhere."""
    starts = starts or [0] * len(segments)
    out_rows = []
    uncovered = 0
    for row in grid:
        for cell in row:
            value = None
            if cell is not None:
                i, j = cell
                j = j + 1 if next_token else j
                k = j - starts[i]
                if j < lengths[i] and 0 <= k < segments[i].shape[0]:
                    value = segments[i][k]
            if value is None:
                value = pad_rows(uncovered)
                uncovered += 1
            out_rows.append(value)
    stacked = torch.stack(out_rows) if out_rows else torch.empty(0, *row_shape, dtype=torch.uint8)
    return stacked.reshape(len(grid), len(grid[0]) if grid else 0, *stacked.shape[1:])


def covered_mask(grid: list[list[object]], counts: list[int], starts: list[int] | None) -> torch.Tensor:
    starts = starts or [0] * len(counts)
    out = torch.zeros(len(grid), len(grid[0]) if grid else 0, dtype=torch.bool)
    for r, row in enumerate(grid):
        for c, cell in enumerate(row):
            if cell is not None:
                i, j = cell
                out[r, c] = starts[i] <= j < starts[i] + counts[i]
    return out


def _batch_cells(grid: list[list[object]], lengths: list[int], width: int, next_token: bool):
    """``(r, c, i, column)``: grid cell ``(r, c)`` holds (with ``next_token``: is followed by) the
    token at ``[i, column]`` of the left-padded ``[B, width]`` batch."""
    for r, row in enumerate(grid):
        for c, cell in enumerate(row):
            if cell is not None:
                i, j = cell
                j = j + 1 if next_token else j
                if j < lengths[i]:
                    yield r, c, i, width - lengths[i] + j


def from_batch(grid: list[list[object]], batch: torch.Tensor, lengths: list[int], pad, next_token=False):
    out = torch.full((len(grid), len(grid[0]) if grid else 0, *batch.shape[2:]), pad, dtype=batch.dtype)
    for r, c, i, column in _batch_cells(grid, lengths, batch.shape[1], next_token):
        out[r, c] = batch[i, column]
    return out


def scatter(grid, values: torch.Tensor, lengths: list[int], width: int, pad, out=None, next_token=False):
    if out is None:
        out = torch.full((len(lengths), width, *values.shape[2:]), pad, dtype=values.dtype)
    for r, c, i, column in _batch_cells(grid, lengths, width, next_token):
        out[i, column] = values[r, c]
    return out
