"""Collation of a global batch's routes: padded rectangle vs packed, serial vs thread pool.

``B`` trajectories of ``n_i`` tokens carry captured routes ``[n_i - 1, 48, 8]`` int16 (separate
host tensors, as in the replay buffer). Arms, timed side by side in one run, fresh output
buffers on every iteration (so first-touch page faults count), ``torch`` at 1 intra-op thread so
parallelism comes only from the arm's own pool:

- padded serial / pool: one ``[B, max_len, 48, 8]`` rectangle, each row written once (padding
  zeroed, routes copied at the row's left-padded token positions);
- packed serial / pool: one ``[sum(n_i - 1), 48, 8]`` buffer plus int32 offsets (``PackedTensor``);
- ``RolloutCollator`` fresh: the project's collator (token fields too), fresh buffers;
- ``RolloutCollator`` reused pool: same, its buffer pool with leases released after each batch
  (steady state; a plain ``torch.empty`` allocator stands in for pinned memory on a CPU host);
- floors: one contiguous copy of the real-row bytes into a fresh buffer and into a touched one.

Peak resident memory of each arm is measured in its own child process (growth of the peak RSS
over the process's peak after building the inputs) next to the computed output bytes and the
real-row floor. Usage: ``python benchmarks/bench_collate.py [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common
import torch

from r3lightning.data.collate import PinnedBufferPool, RolloutCollator
from r3lightning.data.cpus import usable_cpu_count
from r3lightning.packed import PackedTensor
from r3lightning.ragged import offsets_from_lengths
from r3lightning.rollout.trajectory import Trajectory

NUM_LAYERS, TOP_K, NUM_EXPERTS = 48, 8, 512  # ids up to 511: int16 routes
ROW_BYTES = NUM_LAYERS * TOP_K * 2
PROMPT_TOKENS = 16
DISTRIBUTIONS = {  # name -> lower bound of U[low, max] as a fraction of max_len
    "uniform (all max)": 1.0,
    "U[max/2, max]": 1 / 2,
    "U[max/16, max] typical RL": 1 / 16,
    "U[max/64, max] heavy tail": 1 / 64,
}
TYPICAL = "U[max/16, max] typical RL"
MEMORY_ARMS = ("padded pool", "packed pool", "collator reused pool")


def shapes(quick: bool) -> tuple[int, int, int]:
    """(batch, max_len, timing repeats)."""
    return (16, 1024, 3) if quick else (256, 8192, 3)


def make_trajectories(distribution: str, batch: int, max_len: int, seed: int = 0) -> list[Trajectory]:
    generator = torch.Generator().manual_seed(seed)
    low = max(PROMPT_TOKENS + 1, int(max_len * DISTRIBUTIONS[distribution]))
    lengths = torch.randint(low, max_len + 1, (batch,), generator=generator)
    # distinct experts per row (the route check refuses repeats): top_k evenly spaced experts
    # shifted by a random offset per (row, layer)
    offset = torch.randint(0, NUM_EXPERTS, (max_len, NUM_LAYERS, 1), generator=generator)
    source = ((torch.arange(TOP_K) * (NUM_EXPERTS // TOP_K) + offset) % NUM_EXPERTS).to(torch.int16)
    trajectories = []
    for n in lengths.tolist():
        trajectories.append(
            Trajectory(
                torch.ones(PROMPT_TOKENS, dtype=torch.int64),
                torch.ones(n - PROMPT_TOKENS, dtype=torch.int64),
                routed_experts=source[: n - 1].clone(),  # its own storage, like a buffered rollout
            )
        )
    return trajectories


class Arms:
    """The collation arms over one list of trajectories."""

    def __init__(self, trajectories: list[Trajectory], threads: int) -> None:
        self.routes = [t.routed_experts for t in trajectories]
        self.trajectories = trajectories
        self.lengths = torch.tensor([t.num_tokens for t in trajectories])
        self.rows = torch.tensor([r.shape[0] for r in self.routes])
        self.width = int(self.lengths.max())
        self.threads = threads
        self.executor = ThreadPoolExecutor(threads)
        self.fresh = RolloutCollator(num_threads=threads)
        self.pooled = RolloutCollator(
            num_threads=threads, pin_memory=PinnedBufferPool(1, allocator=_plain_empty)
        )

    def _chunks(self) -> list[range]:
        count = len(self.routes)
        return [
            range(count * k // self.threads, count * (k + 1) // self.threads) for k in range(self.threads)
        ]

    def _run(self, fill, parallel: bool) -> None:
        if parallel:
            for future in [self.executor.submit(fill, chunk) for chunk in self._chunks()]:
                future.result()
        else:
            fill(range(len(self.routes)))

    def padded(self, parallel: bool) -> torch.Tensor:
        out = torch.empty(len(self.routes), self.width, NUM_LAYERS, TOP_K, dtype=torch.int16)

        def fill(rows: range) -> None:
            for i in rows:
                start = self.width - int(self.lengths[i])
                end = start + self.routes[i].shape[0]
                out[i, :start].zero_()
                out[i, start:end].copy_(self.routes[i])
                out[i, end:].zero_()

        self._run(fill, parallel)
        return out

    def packed(self, parallel: bool) -> PackedTensor:
        cu = offsets_from_lengths(self.rows)
        offsets = cu.tolist()
        out = torch.empty(offsets[-1], NUM_LAYERS, TOP_K, dtype=torch.int16)

        def fill(rows: range) -> None:
            for i in rows:
                out[offsets[i] : offsets[i + 1]].copy_(self.routes[i])

        self._run(fill, parallel)
        return PackedTensor(out, cu, cu_seqlens_host=cu)

    def collator_reused(self):
        batch = self.pooled(self.trajectories)
        batch.release()  # the trainer hands the buffers back once its copy is issued
        return batch

    def table(self) -> dict:
        return {
            "padded serial": lambda: self.padded(False),
            "padded pool": lambda: self.padded(True),
            "packed serial": lambda: self.packed(False),
            "packed pool": lambda: self.packed(True),
            "collator fresh": lambda: self.fresh(self.trajectories),
            "collator reused pool": self.collator_reused,
        }


def _plain_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Pool allocator on a CPU host: touched once, like pinned pages are at allocation."""
    return torch.zeros(shape, dtype=dtype)


def memory_child(arm: str, distribution: str, quick: bool) -> None:
    """Print the arm's peak-RSS growth (bytes) as JSON; runs in its own process."""
    torch.set_num_threads(1)
    batch, max_len, _ = shapes(quick)
    arms = Arms(make_trajectories(distribution, batch, max_len), usable_cpu_count())
    run = arms.table()[arm]
    gc.collect()
    before = _common.reset_peak_rss()
    result = run()
    if arm == "collator reused pool":  # steady state: the second batch reuses the first's buffers
        del result
        result = run()
    print(json.dumps({"peak_growth": _common.peak_rss() - before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized shapes (B=16, max 1024)")
    parser.add_argument("--memory-child", nargs=2, metavar=("ARM", "DIST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(*args.memory_child, quick=args.quick)
        return
    torch.set_num_threads(1)
    batch, max_len, repeats = shapes(args.quick)
    threads = usable_cpu_count()
    print(
        f"# collate: B={batch}, max_len={max_len}, routes [n-1, {NUM_LAYERS}, {TOP_K}] int16, "
        f"pool of {threads} threads"
    )
    print(f"# {_common.machine_line()}; median of {repeats} after 1 warm-up")
    summary = {}
    for distribution in DISTRIBUTIONS:
        trajectories = make_trajectories(distribution, batch, max_len)
        arms = Arms(trajectories, threads)
        real_rows = int(arms.rows.sum())
        floor_bytes = real_rows * ROW_BYTES
        source = torch.ones(floor_bytes, dtype=torch.uint8)
        touched = torch.zeros(floor_bytes, dtype=torch.uint8)
        packed = arms.packed(False)
        assert packed.values.nbytes == floor_bytes
        # the arms agree: route row t sits at token t, so the last column is padding
        padded = arms.padded(True)
        assert torch.equal(packed.to_padded(max_len=arms.width - 1), padded[:, :-1])
        assert not padded[:, -1].any()
        del padded
        del packed
        timed = {
            **arms.table(),
            "floor: copy into fresh buffer": lambda source=source: torch.empty_like(source).copy_(source),
            "floor: copy into touched buffer": lambda source=source, touched=touched: touched.copy_(source),
        }
        times = _common.time_arms(timed, repeats=repeats)
        del source, touched, trajectories
        arms.executor.shutdown()

        computed = {
            "padded": batch * arms.width * ROW_BYTES,
            "packed": floor_bytes + (batch + 1) * 4,
        }
        script = Path(__file__).resolve()
        flags = ["--quick"] if args.quick else []
        measured = {}
        if distribution == TYPICAL or not args.quick:  # each child pays a fresh interpreter's start
            for arm in MEMORY_ARMS:
                reply = _common.run_child(script, ["--memory-child", arm, distribution, *flags])
                measured[arm] = reply["peak_growth"]
        best_padded = min(times["padded serial"], times["padded pool"])
        touched_floor = times["floor: copy into touched buffer"]
        rows = []
        for name, seconds in times.items():
            kind = (
                "padded" if name.startswith("padded") else "packed" if not name.startswith("floor") else None
            )
            rows.append(
                [
                    name,
                    _common.ms(seconds),
                    _common.ratio(best_padded, seconds),
                    _common.ratio(seconds, touched_floor),
                    f"{computed[kind] / _common.GiB:.3f}" if kind else f"{floor_bytes / _common.GiB:.3f}",
                    f"{measured[name] / _common.GiB:.3f}" if name in measured else "",
                ]
            )
        _common.print_table(
            f"{distribution}: {real_rows} real rows, floor {floor_bytes / _common.GiB:.3f} GiB",
            [
                "arm",
                "median ms",
                "speed-up vs best padded",
                "time vs touched-copy floor",
                "computed GiB",
                "peak RSS growth GiB",
            ],
            rows,
        )
        best_packed = min(times["packed serial"], times["packed pool"], times["collator fresh"])
        summary[distribution] = {
            "speedup": best_padded / best_packed,
            "memory_ratio": measured["packed pool"] / max(measured["padded pool"], 1) if measured else None,
            "reused_vs_floor": times["collator reused pool"] / touched_floor,
            "fresh_vs_touched_floor": times["floor: copy into fresh buffer"] / touched_floor,
        }

    typical = summary[TYPICAL]
    print("\ntargets (typical RL):")
    print("- packed bytes == real-row bytes (+ offsets): met (asserted for every distribution)")
    for label, value, limit, better in (
        ("packed / padded peak memory <= 0.55", typical["memory_ratio"], 0.55, "low"),
        ("best fresh packed >= 2.3x faster than best padded", typical["speedup"], 2.3, "high"),
        ("reused-pool collator <= 1.5x the touched-copy floor", typical["reused_vs_floor"], 1.5, "low"),
    ):
        ok = value <= limit if better == "low" else value >= limit
        print(f"- {label}: {value:.2f} -> {'met' if ok else 'missed'}")
    print(f"- (fresh-buffer copy / touched-buffer copy: {typical['fresh_vs_touched_floor']:.2f}x)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
