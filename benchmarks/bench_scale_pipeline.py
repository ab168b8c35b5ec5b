"""Rollouts on many ranks, the pipeline axis: routes sliced to the layers a rank holds.

The global batch of ``bench_scale.py`` (``--groups`` GRPO groups of ``--group-size`` trajectories
of ``--tokens`` tokens; 48 layers x top-8 of 128 experts, uint8, from the same loopback engine) on
a fixed ``--world`` of gloo processes, split into PP pipeline stages x DP data-parallel ranks for
every PP in ``--pp``. Ranks are numbered as megatron-core's default order puts them with TP = CP =
1: stage ``rank // DP``, data-parallel rank ``rank % DP``; a stage holds the contiguous block of
layers megatron-core gives it on an even split, ``[stage * 48 / PP, (stage + 1) * 48 / PP)``.

Every rank collects its data-parallel shard of the global batch with a ``RolloutCollector`` whose
route schema keeps its block (``RouteSchema(layers=)``), spread over its stage's data-parallel
group: the stages of one data-parallel rank request the same groups (the seeds are a function of
step and group, so they hold the same trajectories) and each keeps its own columns; the engine
answers each group once per stage, every layer on the wire. The rank then draws its batches from
``R3DataModule(options=DataOptions(layers=block, shard=False))``. Per rank: route bytes in the
buffer, route bytes of the collated batches (``routed_experts`` values and offsets: what a step
moves host-to-device), peak RSS growth over a step (collection and collation; the largest of the
steps after a warm-up; glibc returns freed buffers at once, ``MALLOC_MMAP_THRESHOLD_``), each
against ``global route bytes / DP x layers held / 48``.

Checked on every run: each batch's ``route_layers`` is its stage's block and its routes equal the
engine's known routes on those columns (recomputed by plain numpy indexing); the stages of one
data-parallel rank hold the same trajectories; the data-parallel ranks of every stage hold the
whole global batch. A projection then gives per-rank route bytes per step for Qwen3-30B-A3B and
DeepSeek-V3 at 64 and 512 ranks.

Usage: ``python benchmarks/bench_scale_pipeline.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import _common
import _rollout_ranks
from _rollout_ranks import EXPERTS, LAYERS, ROUTE_BYTES_PER_TOKEN, TOP_K

# name: (decoder layers, leading dense layers, top_k, experts, {PP: layers on stage 0 when uneven})
MODELS = {
    "Qwen3-30B-A3B": (48, 0, 8, 128, {}),
    "DeepSeek-V3": (61, 3, 8, 256, {4: 16, 8: 5}),
}
PROJECTION_TOKENS, PROJECTION_PER_RANK = 32768, 8  # bench_scale.py's projection: 8 per rank of 32k


def stage_layers(num_layers: int, pp: int, stage: int, first: int | None = None) -> tuple[int, ...]:
    """Decoder layers of pipeline stage ``stage`` of ``pp`` as megatron-core places them: contiguous,
    ``num_layers / pp`` each, or ``first`` on stage 0 and the rest split evenly over the others
    (its ``num_layers_in_first_pipeline_stage``)."""
    if first is None:
        if num_layers % pp:
            raise ValueError(f"{num_layers} layers do not split evenly over {pp} stages")
        size = num_layers // pp
        return tuple(range(stage * size, (stage + 1) * size))
    if pp < 2 or (num_layers - first) % (pp - 1):
        raise ValueError(f"{num_layers - first} layers do not split evenly over {pp - 1} stages")
    rest = (num_layers - first) // (pp - 1)
    start = 0 if stage == 0 else first + (stage - 1) * rest
    return tuple(range(start, first if stage == 0 else start + rest))


# ---------------------------------------------------------------------------- one rank


def rank_main(rank: int, world: int, url: str, pps: list[int], args: dict, out_dir: str) -> None:
    import torch.distributed as dist

    for pp in pps:
        dp = world // pp
        # every rank joins every new_group, in one order; a stage's ranks form its DP group
        groups = [dist.new_group(list(range(s * dp, (s + 1) * dp))) for s in range(pp)]
        result = run_steps(rank, pp, dp, url, args, groups[rank // dp])
        Path(out_dir, f"{pp}_{rank}.json").write_text(json.dumps(result))


def run_steps(rank: int, pp: int, dp: int, url: str, args: dict, dp_group) -> dict:
    """This rank's steps at ``pp`` stages x ``dp`` data-parallel ranks; its figures."""
    from types import SimpleNamespace

    import torch

    from r3lightning import ReplayBuffer
    from r3lightning.align.layout import TokenMetadataLayout
    from r3lightning.data.datamodule import DataOptions, R3DataModule
    from r3lightning.replay.backend import widen_routes
    from r3lightning.replay.batch_fields import host_attention_mask
    from r3lightning.replay.modes import align_routes

    block = stage_layers(LAYERS, pp, rank // dp)
    # what the callback's backend knows of the model: its routers are the stage's layers
    stage = SimpleNamespace(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, moe_layers=block)
    collector = _rollout_ranks.collector(url, args, layers=block, process_group=dp_group)
    buffer = ReplayBuffer(num_experts=EXPERTS, layers=block)
    data = R3DataModule(buffer, args["batch_size"], shuffle=False, collate_threads=1, pin_memory=False,
                        options=DataOptions(shard=False, layers=block))  # fmt: skip
    # [tokens - 1, held, K]: the reference cut, plain numpy indexing of the engine's routes
    reference = torch.from_numpy(_rollout_ranks.known_routes(args["tokens"] - 1)[:, list(block)])
    prompts = _rollout_ranks.prompts(args["groups"])
    growths, times = [], []
    for step in range(args["steps"] + 1):  # step 0 warms up
        base, start = _rollout_ranks.start_step(buffer)
        collector.collect(prompts, step=step, buffer=buffer)
        elapsed = time.perf_counter() - start
        h2d, batches = 0, 0
        device = {"sliced": 0, "widened": 0}  # the largest batch's aligned routes and mask
        for batch in data.train_dataloader():  # each batch dropped before the next, as in training
            routes = batch.routed_experts
            h2d += routes.values.nbytes + routes.cu_seqlens.nbytes
            batches += 1
            assert batch.route_layers == block, (batch.route_layers, block)
            assert all(torch.equal(routes[i], reference) for i in range(len(batch))), "batch columns"
            # on device: the callback's aligned routes [B, S, held, K] (what install is given now)
            # and, for comparison, the widened copy [B, S, 48, K] the callback installed before
            layout = TokenMetadataLayout.padded(host_attention_mask(batch))
            aligned, mask = align_routes(routes, layout, stage, block)
            widened = widen_routes(aligned, block, LAYERS)
            assert torch.equal(widened[..., list(block), :], aligned), "widened columns"
            device["sliced"] = max(device["sliced"], aligned.nbytes + mask.nbytes)
            device["widened"] = max(device["widened"], widened.nbytes + mask.nbytes)
            del batch, routes, aligned, mask, widened
        growth = _common.peak_rss() - base
        if step > 0:
            growths.append(growth)
            times.append(elapsed)
    assert all(t.route_layers == block and torch.equal(t.routed_experts, reference) for t in buffer)
    return {
        "rank": rank,
        "pp": pp,
        "dp": dp,
        "stage": rank // dp,
        "layers": list(block),
        "host_bytes": sum(t.routed_experts.nbytes for t in buffer),
        "h2d_bytes": h2d,
        "device_sliced_bytes": device["sliced"],
        "device_widened_bytes": device["widened"],
        "batches": batches,
        "rss_growth": max(growths),
        "collect_s": statistics.median(times),
        "held": _rollout_ranks.held(buffer),
    }


def run_plans(pps: list[int], world: int, url: str, args: dict, out_dir: str) -> dict[int, list[dict]]:
    """The PP sizes ``pps`` one after the other in one set of ``world`` fresh processes."""
    _rollout_ranks.launch(rank_main, world, url, pps, args, out_dir)
    return {pp: [json.loads(Path(out_dir, f"{pp}_{r}.json").read_text()) for r in range(world)] for pp in pps}


# ---------------------------------------------------------------------------- report


def check_placement(rows: dict[int, list[dict]], trajectories: int) -> None:
    """Stages of one data-parallel rank hold the same trajectories; every stage's data-parallel
    ranks together hold the global batch, the same one at every PP."""
    batches = set()
    for pp, ranks in rows.items():
        dp = len(ranks) // pp
        for d in range(dp):
            assert len({tuple(map(tuple, ranks[s * dp + d]["held"])) for s in range(pp)}) == 1, (pp, d)
        for s in range(pp):
            union = sorted(tuple(h) for r in ranks[s * dp : (s + 1) * dp] for h in r["held"])
            assert len(set(union)) == trajectories, (pp, s, len(set(union)))
            batches.add(tuple(union))
    assert len(batches) == 1, "the global batch differs between PP sizes"


def measured_table(rows: dict[int, list[dict]], global_bytes: int) -> list[list]:
    table = []
    for pp, ranks in rows.items():
        for r in ranks:
            formula = global_bytes / r["dp"] * len(r["layers"]) / LAYERS
            table.append(
                [
                    pp,
                    r["dp"],
                    r["rank"],
                    r["stage"],
                    f"{r['layers'][0]}-{r['layers'][-1]}",
                    f"{formula / _common.MiB:.1f}",
                    f"{r['host_bytes'] / _common.MiB:.1f}",
                    f"{r['host_bytes'] / formula:.4f}",
                    f"{r['h2d_bytes'] / _common.MiB:.1f}",
                    f"{r['h2d_bytes'] / formula:.4f}",
                    f"{r['rss_growth'] / _common.MiB:.0f}",
                    f"{r['rss_growth'] / formula:.2f}",
                    f"{global_bytes / r['dp'] / _common.MiB:.1f}",
                    _common.ms(r["collect_s"]),
                ]
            )
    return table


def device_ratio(row: dict) -> float:
    return row["device_sliced_bytes"] / row["device_widened_bytes"]


def device_table(rows: dict[int, list[dict]]) -> list[list]:
    table = []
    for pp, ranks in rows.items():
        for r in ranks:
            table.append(
                [
                    pp,
                    r["rank"],
                    r["stage"],
                    f"{r['layers'][0]}-{r['layers'][-1]}",
                    f"{r['device_widened_bytes'] / _common.MiB:.2f}",
                    f"{r['device_sliced_bytes'] / _common.MiB:.2f}",
                    f"{device_ratio(r):.4f}",
                    f"{len(r['layers']) / LAYERS:.4f}",
                ]
            )
    return table


def projection_table(ranks_list: tuple[int, ...], pps: tuple[int, ...]) -> list[list]:
    """Per-rank route bytes per step (host = host-to-device: each trajectory trained once a step)
    at ``PROJECTION_PER_RANK`` trajectories of ``PROJECTION_TOKENS`` tokens per rank, TP = CP = 1."""
    rows = []
    for name, (num_layers, dense, top_k, experts, first) in MODELS.items():
        assert experts <= 256  # uint8 ids: one byte per (token, layer, slot)
        per_layer = (PROJECTION_TOKENS - 1) * top_k  # bytes of one trajectory on one layer
        for ranks in ranks_list:
            global_layer = PROJECTION_PER_RANK * ranks * per_layer
            for pp in pps:
                dp = ranks // pp
                blocks = [stage_layers(num_layers, pp, s, first.get(pp)) for s in range(pp)]
                moe = max(sum(layer >= dense for layer in b) for b in blocks)  # the busiest stage
                whole, sliced = global_layer / dp * num_layers, global_layer / dp * moe
                rows.append(
                    [
                        name,
                        ranks,
                        f"{pp} x {dp}",
                        "/".join(str(len(b)) for b in blocks)
                        if first.get(pp)
                        else f"{pp} x {len(blocks[0])}",
                        f"{global_layer * num_layers / _common.GiB:.1f}",
                        f"{num_layers} / {moe}",
                        f"{whole / _common.GiB:.3f}",
                        f"{sliced / _common.GiB:.3f}",
                        f"{sliced / whole:.3f}",
                    ]
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI size: 2 ranks, PP = 1 and 2 in one run")
    parser.add_argument("--world", type=int, default=None, help="gloo processes (PP x DP)")
    parser.add_argument("--pp", type=int, nargs="+", default=None, help="pipeline sizes dividing --world")
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per trajectory")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None, help="trajectories per batch and rank")
    parsed = parser.parse_args()
    quick = parsed.quick
    world = parsed.world or (2 if quick else 4)
    pps = parsed.pp or ([1, 2] if quick else [1, 2, 4])
    args = {
        "groups": parsed.groups or (4 if quick else 16),
        "group_size": parsed.group_size,
        "tokens": parsed.tokens or (1024 if quick else 8192),
        "steps": parsed.steps or (1 if quick else 2),
        "batch_size": parsed.batch_size or (4 if quick else 8),
    }
    if bad := [pp for pp in pps if world % pp or LAYERS % pp or args["groups"] % (world // pp)]:
        raise SystemExit(f"--pp {bad}: PP must divide --world, 48 layers and DP must divide --groups")
    trajectories = args["groups"] * args["group_size"]
    global_bytes = trajectories * (args["tokens"] - 1) * ROUTE_BYTES_PER_TOKEN
    print(f"# Rollouts on many ranks, the pipeline axis ({_common.machine_line()})")
    print(
        f"{world} ranks = PP x DP for PP in {pps}; global batch: {args['groups']} groups x "
        f"{args['group_size']} = {trajectories} trajectories of {args['tokens']} tokens, routes "
        f"[{args['tokens'] - 1}, {LAYERS}, {TOP_K}] uint8: {global_bytes / _common.MiB:.1f} MiB per step; "
        f"batches of {args['batch_size']}; {args['steps']} step(s) after a warm-up"
        + (", every PP in one set of processes" if quick else ", each PP in fresh processes")
    )
    with tempfile.TemporaryDirectory() as tmp, _rollout_ranks.engine(args["tokens"]) as url:
        rows: dict[int, list[dict]] = {}
        for group in [pps] if quick else [[pp] for pp in pps]:
            rows.update(run_plans(group, world, url, args, tmp))
    check_placement(rows, trajectories)
    print(
        "check: every batch's route_layers is its stage's block and its routes equal the engine's "
        "on those columns; stages of one DP rank hold the same trajectories: ok"
    )

    _common.print_table(
        "Per rank, measured (formula = global route bytes / DP x layers held / 48)",
        ["PP", "DP", "rank", "stage", "layers", "formula MiB", "host route MiB", "host / formula",
         "H2D route MiB", "H2D / formula", "peak RSS growth MiB", "RSS / formula",
         "wire MiB (every layer = unsliced)", "collect ms"],
        measured_table(rows, global_bytes),
    )  # fmt: skip
    every = [r for ranks in rows.values() for r in ranks]
    for key, slack, name in (("host_bytes", 0.0, "host"), ("h2d_bytes", 0.001, "H2D")):
        worst = max(abs(r[key] / (global_bytes / r["dp"] * len(r["layers"]) / LAYERS) - 1) for r in every)
        print(
            f"target: {name} route bytes per rank = formula"
            f"{f' within {slack:.1%}' if slack else ' exactly'}: {'met' if worst <= slack else 'missed'}"
            f" (worst {worst:.2e})"
        )

    _common.print_table(
        "Per rank, device route bytes of the largest batch: aligned routes [B, S, layers, 8] uint8 "
        "and the replay mask, as installed before (widened to 48 layers) and now (the held layers)",
        ["PP", "rank", "stage", "layers", "widened (before) MiB", "sliced (now) MiB", "now / before",
         "layers held / 48"],
        device_table(rows),
    )  # fmt: skip
    worst = max(abs(device_ratio(r) - len(r["layers"]) / LAYERS) for r in every)
    print(
        f"target: device route bytes now / before = layers held / 48 within 1%: {'met' if worst <= 0.01 else 'missed'}"
    )

    _common.print_table(
        f"Projection: {PROJECTION_PER_RANK} trajectories of {PROJECTION_TOKENS // 1024}k tokens per rank, "
        "per-rank route bytes per step (host = H2D)",
        ["model", "ranks", "PP x DP", "stage layers", "global route GiB", "layers held (all / sliced)",
         "GiB per rank, all layers", "GiB per rank, sliced", "sliced / all"],
        projection_table((64, 512), (1, 4, 8)),
    )  # fmt: skip


if __name__ == "__main__":
    main()
