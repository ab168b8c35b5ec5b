"""Alignment: packed routes of a typical-RL batch expanded into the model-facing layouts.

A batch of ``B`` trajectories with lengths drawn from U[max/16, max] ("typical RL") carries
packed routes ``[sum(n_i - 1), 48, 8]`` int16 (the engine returns ``n - 1`` rows). Each arm is
``align_packed_token_metadata`` into one layout, built beforehand as at collate time:

- padded: ``TokenMetadataLayout.padded(attention_mask)`` -> ``[B, S, L, K]``;
- packed: ``TokenMetadataLayout.packed(lengths, pad_to_multiple=8)`` -> ``[1, T, L, K]``;
- CP shard: ``packed(..., pad_to_multiple=8, cp_size=2, cp_rank=0)`` -> ``[1, T/2, L, K]``.

Floor, per layout and in the same run: one ``index_copy_`` of exactly the rows that land in that
layout into a fresh ``torch.empty`` output (destination index and source rows precomputed); a
second reference adds the padding fill (``torch.full`` first). Usage:
``python benchmarks/bench_align.py [--quick]``.
"""

from __future__ import annotations

import argparse

import _common
import torch

from r3lightning.align.align import align_packed_token_metadata
from r3lightning.align.layout import TokenMetadataLayout
from r3lightning.packed import PackedTensor

NUM_LAYERS, TOP_K = 48, 8
TARGET_VS_FLOOR = 1.5


def typical_lengths(batch: int, max_len: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(max(2, max_len // 16), max_len + 1, (batch,), generator=generator)


def floor_plan(packed: PackedTensor, layout: TokenMetadataLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination positions, source rows) of the real rows in ``layout``, found by aligning
    row numbers instead of routes (outside the timed region)."""
    ids = PackedTensor.from_lengths(torch.arange(packed.num_rows), packed.lengths)
    where = align_packed_token_metadata(ids, layout, pad=-1).reshape(-1)  # [positions]
    dest = torch.nonzero(where >= 0).reshape(-1)
    rows = packed.values.index_select(0, where[dest]).contiguous()  # the rows this layout needs
    return dest, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized shapes (B=8, max 512)")
    args = parser.parse_args()
    # One intra-op thread: on a shared 2-core host OpenMP teams stall on descheduled partners
    # (small host index ops then take ~20x longer), and production collation runs beside training.
    torch.set_num_threads(1)
    batch, max_len, repeats = (8, 512, 3) if args.quick else (64, 4096, 11)

    lengths = typical_lengths(batch, max_len)  # [B] real tokens per trajectory
    captured = lengths - 1  # route rows per trajectory
    generator = torch.Generator().manual_seed(1)
    values = torch.randint(
        0, 128, (int(captured.sum()), NUM_LAYERS, TOP_K), dtype=torch.int16, generator=generator
    )
    packed = PackedTensor.from_lengths(values, captured)
    columns = torch.arange(max_len)
    attention_mask = columns[None, :] >= (max_len - lengths)[:, None]  # [B, S] left-padded

    layouts = {
        "padded [B, S]": TokenMetadataLayout.padded(attention_mask),
        "packed [1, T]": TokenMetadataLayout.packed(lengths, pad_to_multiple=8),
        "CP shard 0/2 [1, T/2]": TokenMetadataLayout.packed(lengths, pad_to_multiple=8, cp_size=2, cp_rank=0),
    }
    arms = {}
    for name, layout in layouts.items():
        dest, rows = floor_plan(packed, layout)
        positions = layout.num_positions
        expected = align_packed_token_metadata(packed, layout, pad=0).reshape(positions, -1)
        assert torch.equal(expected[dest].reshape(rows.shape), rows)

        def floor(dest=dest, rows=rows, positions=positions):
            return torch.empty(positions, NUM_LAYERS, TOP_K, dtype=torch.int16).index_copy_(0, dest, rows)

        def floor_pad(dest=dest, rows=rows, positions=positions):
            out = torch.full((positions, NUM_LAYERS, TOP_K), 0, dtype=torch.int16)
            return out.index_copy_(0, dest, rows)

        arms[(name, "align")] = lambda layout=layout: align_packed_token_metadata(packed, layout, pad=0)
        arms[(name, "floor")] = floor
        arms[(name, "floor+pad")] = floor_pad
    times = _common.time_arms(arms, repeats=repeats)
    build = _common.time_arms(
        {
            "padded": lambda: TokenMetadataLayout.padded(attention_mask),
            "packed": lambda: TokenMetadataLayout.packed(lengths, pad_to_multiple=8),
            "cp": lambda: TokenMetadataLayout.packed(lengths, pad_to_multiple=8, cp_size=2, cp_rank=0),
        },
        repeats=repeats,
    )

    row_bytes = NUM_LAYERS * TOP_K * 2
    print(
        f"# align: B={batch}, max_len={max_len}, lengths U[max/16, max], {packed.num_rows} route rows "
        f"({packed.num_rows * row_bytes / _common.MiB:.0f} MiB int16, rows of {NUM_LAYERS}x{TOP_K})"
    )
    print(f"# {_common.machine_line()}; median of {repeats}")
    table = []
    verdicts = []
    for (name, layout), key in zip(layouts.items(), ("padded", "packed", "cp"), strict=True):
        align, floor, floor_pad = (times[(name, arm)] for arm in ("align", "floor", "floor+pad"))
        out_mib = layout.num_positions * row_bytes / _common.MiB
        table.append(
            [
                name,
                f"{out_mib:.0f}",
                _common.ms(align),
                _common.ms(floor),
                _common.ms(floor_pad),
                _common.ratio(align, floor),
                _common.ratio(align, floor_pad),
                _common.ms(build[key]),
            ]
        )
        verdicts.append(
            f"{name}: {'met' if align <= TARGET_VS_FLOOR * floor else 'missed'} ({align / floor:.2f}x)"
        )
    _common.print_table(
        "Alignment into model-facing layouts",
        [
            "layout",
            "output MiB",
            "align ms",
            "floor ms (index_copy_)",
            "floor+pad ms",
            "align vs floor",
            "align vs floor+pad",
            "layout build ms (host, once per batch)",
        ],
        table,
    )
    print(f"\ntarget: align within {TARGET_VS_FLOOR}x of the index_copy_ floor: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
