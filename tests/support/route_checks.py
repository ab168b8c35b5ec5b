"""Checks that every captured route lands where the model reads its token, for any batch and layout.

Which token sits at which model-facing position comes from the plain-loop layouts of
``align_reference``; which trajectory a batch row holds is read from its tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import align_reference as ref
import numpy as np
import torch
from route_reference import MOE_LAYERS, PAD, E, K, L, Reference, Rollouts

from r3lightning.align.align import align_packed_token_metadata, build_replay_mask
from r3lightning.align.dummy import dummy_routes
from r3lightning.align.layout import TokenMetadataLayout, split_for_sequence_parallel
from r3lightning.data.batch import RolloutBatch
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.megatron.layout import MegatronParallelism, megatron_token_layout


def reference_rows(reference: Reference) -> np.ndarray:
    """The reference's captured rows in token order, ``[captured, L, K]``."""
    assert reference.rows is not None
    rows = [reference.rows[t] for t in range(len(reference.rows))]
    return np.stack(rows) if rows else np.empty((0, L, K), dtype=np.int64)


def valid_routes(rows: torch.Tensor) -> bool:
    """Experts in range and distinct within each row on every MoE layer (``[..., L, K]``)."""
    moe = rows[..., MOE_LAYERS, :].long()
    ordered = moe.sort(dim=-1).values
    return bool((moe >= 0).all() and (moe < E).all() and (ordered[..., 1:] != ordered[..., :-1]).all())


def references_of(batch: RolloutBatch, rollouts: Rollouts) -> list[Reference]:
    """Which trajectory each batch row holds, read from its real tokens alone."""
    by_tokens = {tuple(r.tokens): r for r in rollouts.references}
    out = []
    for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True):
        tokens = tuple(ids[mask].tolist())
        if tokens in by_tokens:
            out.append(by_tokens[tokens])
        else:
            assert tokens == (PAD,), f"batch row {tokens} is neither a rollout nor a placeholder"
            out.append(Reference([PAD], None))
    return out


def reference_grid(layout_spec: dict, lengths: list[int], width: int) -> list[list[object]]:
    if layout_spec["kind"] == "padded":
        return ref.padded_positions(
            lengths, width, layout_spec.get("pad_to_multiple", 1), layout_spec.get("side", "left")
        )
    return ref.packed_positions(
        lengths, layout_spec["pad_to_multiple"], layout_spec.get("cp_size", 1), layout_spec.get("cp_rank", 0)
    )


def build_layout(layout_spec: dict, batch: RolloutBatch) -> TokenMetadataLayout:
    kwargs = {k: v for k, v in layout_spec.items() if k != "kind"}
    if layout_spec["kind"] == "padded":
        return TokenMetadataLayout.padded(batch.attention_mask, **kwargs)
    return TokenMetadataLayout.packed(batch.lengths_host()[0], **kwargs)


@dataclass
class Aligned:
    layout: TokenMetadataLayout
    grid: list[list[object]]
    model_ids: torch.Tensor  # [*token_shape] the token the model reads at each position
    routes: torch.Tensor  # [*token_shape, L, K]
    mask: torch.Tensor  # [*token_shape] bool


def check_positions(aligned: Aligned, references: list[Reference], label: object) -> None:
    """Every position of ``aligned`` against the references (``grid`` says who sits where)."""
    grid = aligned.grid
    shape = (len(grid), len(grid[0]))
    assert tuple(aligned.model_ids.shape) == shape and tuple(aligned.mask.shape) == shape, label
    assert tuple(aligned.routes.shape) == (*shape, L, K), label
    ids, dense, replay = aligned.model_ids.tolist(), aligned.routes.long().numpy(), aligned.mask.tolist()
    for r, row in enumerate(grid):
        for c, cell in enumerate(row):
            where = f"{label} position ({r}, {c})"
            if cell is None:
                assert not replay[r][c], f"{where}: padding must route natively"
                continue
            i, t = cell
            reference = references[i]
            assert ids[r][c] == reference.tokens[t], f"{where}: the model reads the wrong token"
            if reference.rows is None:  # placeholder: its one dummy row is replayed
                assert replay[r][c], f"{where}: a placeholder's route row must be replayed"
            elif t in reference.rows:
                assert replay[r][c], f"{where}: captured token {t} of row {i} must be replayed"
                np.testing.assert_array_equal(
                    dense[r, c], reference.rows[t], err_msg=f"{where}: token {t} of row {i}"
                )
            else:
                assert not replay[r][c], f"{where}: uncaptured token {t} of row {i} must route natively"
    assert valid_routes(aligned.routes), f"{label}: some position holds invalid routes"


def align(batch: RolloutBatch, layout: TokenMetadataLayout, grid: list[list[object]]) -> Aligned:
    """The batch's routes, replay mask and tokens as ``layout`` puts them in front of the model."""
    routes = batch.routed_experts
    assert routes is not None
    dense = align_packed_token_metadata(routes, layout, pad=lambda n: dummy_routes(n, L, K, E))
    mask = build_replay_mask(routes, layout)
    assert layout.token_shape == (len(grid), len(grid[0]))
    return Aligned(layout, grid, layout.from_batch(batch.input_ids, pad=PAD), dense, mask)


def align_and_check(batch: RolloutBatch, references: list[Reference], layout_spec: dict) -> Aligned:
    """Align the batch's routes to one layout and check every position against the references."""
    lengths = batch.lengths_host()[0].tolist()
    aligned = align(
        batch, build_layout(layout_spec, batch), reference_grid(layout_spec, lengths, batch.width)
    )
    check_positions(aligned, references, layout_spec)
    return aligned


def model_inputs(aligned: Aligned) -> dict:
    layout = aligned.layout
    inputs = {"input_ids": aligned.model_ids, "position_ids": layout.position_ids, "use_cache": False}
    if layout.kind == "padded":
        inputs["attention_mask"] = layout.token_mask.long()
    # packed: no attention mask; the per-sequence position ids keep the sequences apart
    return inputs


def replay_and_check(model: torch.nn.Module, aligned: Aligned, references: list[Reference]) -> torch.Tensor:
    """Replay into the fp32 model, record in the same pass; returns the native routes of a plain pass."""
    inputs = model_inputs(aligned)
    with torch.no_grad():
        with replay_routes(model, aligned.routes, aligned.mask) as backend, record_routes(model) as recording:
            model(**inputs)
            stats = backend.routing_stats()  # cleared with the routes on exit
        with record_routes(model) as native_recording:
            model(**inputs)
    used = recording.routes.long()  # [*token_shape, L, K]
    assert tuple(used.shape) == tuple(aligned.routes.shape)
    assert bool((used[..., 0, :] == 0).all()), "the dense layer holds no routes"
    assert valid_routes(used)
    replayed = aligned.mask
    # 100%: every replayed position used exactly the aligned experts on every MoE layer
    assert torch.equal(used[replayed][:, MOE_LAYERS], aligned.routes.long()[replayed][:, MOE_LAYERS])
    expected_rows = torch.full((len(MOE_LAYERS),), int(replayed.sum()), dtype=torch.int64)
    assert torch.equal(stats["replayed_rows"], expected_rows)

    used_np = used.numpy()
    for r, row in enumerate(aligned.grid):
        for c, cell in enumerate(row):
            if cell is None or references[cell[0]].rows is None or cell[1] not in references[cell[0]].rows:
                continue
            i, t = cell
            np.testing.assert_array_equal(
                used_np[r, c, MOE_LAYERS], references[i].rows[t][MOE_LAYERS], err_msg=f"row {i} token {t}"
            )
    return native_recording.routes.long()


def agreement_at(
    native: torch.Tensor,
    aligned: Aligned,
    references: list[Reference],
    shift: int,
    only: Callable[[Reference], frozenset[int]] | None = None,
) -> float:
    """Fraction of (token, MoE layer) whose native fp32 expert set equals the server's for token
    ``t + shift``; over the tokens ``only(reference)`` when given."""
    hits = total = 0
    native_np = np.sort(native.numpy()[..., MOE_LAYERS, :], axis=-1)
    for r, row in enumerate(aligned.grid):
        for c, cell in enumerate(row):
            if cell is None or references[cell[0]].rows is None:
                continue
            i, t = cell
            server = references[i].rows.get(t + shift)
            if server is None or (only is not None and t not in only(references[i])):
                continue
            hits += int((native_np[r, c] == np.sort(server[MOE_LAYERS], axis=-1)).all(-1).sum())
            total += len(MOE_LAYERS)
    return hits / total


REPLAYED_LAYOUTS = (
    {"kind": "padded"},
    {"kind": "padded", "side": "right", "pad_to_multiple": 8},
    {"kind": "packed", "pad_to_multiple": 4},
)
CP_LAYOUTS = tuple({"kind": "packed", "pad_to_multiple": 8, "cp_size": 2, "cp_rank": r} for r in range(2))


def check_batch(
    batch: RolloutBatch, rollouts: Rollouts, model: torch.nn.Module
) -> list[tuple[Aligned, torch.Tensor]]:
    """Every layout of one batch: alignment against the references, replay in the fp32 model.
    Returns each replayed layout with the fp32 model's native routes ``[*token_shape, L, K]``."""
    references = references_of(batch, rollouts)
    captured = sum(0 if r.rows is None else len(r.rows) for r in references)
    placeholders = sum(r.rows is None for r in references)
    natives = []
    for layout_spec in REPLAYED_LAYOUTS:
        aligned = align_and_check(batch, references, layout_spec)
        assert int(aligned.mask.sum()) == captured + placeholders  # each captured row lands once
        native = replay_and_check(model, aligned, references)
        # The fp32 model's own routing follows the server's for the token at that very position
        # (bf16 vs fp32 flips a few); one token off it agrees no better than chance.
        agreement = agreement_at(native, aligned, references, 0)
        assert agreement > 0.8
        for shift in (-1, 1):
            assert agreement_at(native, aligned, references, shift) < agreement - 0.3
        natives.append((aligned, native))
    shards = [align_and_check(batch, references, spec) for spec in CP_LAYOUTS]
    check_covered_once(shards, references, captured + placeholders)
    for packed in (True, False):
        check_covered_once(megatron_ranks(batch, references, packed), references, captured + placeholders)
    return natives


def check_covered_once(shards: list[Aligned], references: list[Reference], replayed: int) -> None:
    """Across the ranks' shards every real token sits exactly once and every captured row lands once."""
    assert sum(int(s.mask.sum()) for s in shards) == replayed
    seen = [cell for s in shards for row in s.grid for cell in row if cell is not None]
    assert len(seen) == len(set(seen)) == sum(len(r.tokens) for r in references)


def megatron_ranks(batch: RolloutBatch, references: list[Reference], packed: bool) -> list[Aligned]:
    """What each TP x CP rank's routers see under megatron with sequence parallelism (TP = CP = 2
    packed, TP = 2 unpacked): the rank's layout, then its contiguous 1/TP of the sequence."""
    tp, cp = 2, 2 if packed else 1
    lengths = batch.lengths_host()[0].tolist()
    out = []
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            parallelism = MegatronParallelism(tp, tp_rank, cp, cp_rank, sequence_parallel=True)
            layout = megatron_token_layout(batch, packed=packed, parallelism=parallelism)
            if packed:
                grid = ref.packed_positions(lengths, 2 * tp * cp, cp, cp_rank)
            else:
                grid = ref.padded_positions(lengths, batch.width, tp, "right")
            whole = align(batch, layout, grid)
            share = len(grid[0]) // tp
            local = Aligned(
                layout,
                [row[tp_rank * share : (tp_rank + 1) * share] for row in grid],
                *(
                    split_for_sequence_parallel(t, tp, tp_rank)
                    for t in (whole.model_ids, whole.routes, whole.mask)
                ),
            )
            check_positions(local, references, f"megatron packed={packed} tp={tp_rank} cp={cp_rank}")
            out.append(local)
    return out
