"""The benchmarks run end to end at CI size (``--quick``) and print their tables.

Timings are not asserted (the machine is shared); each benchmark checks its own arms agree on
the values before timing them, so a zero exit also means the arms computed the same thing.
"""

from __future__ import annotations

import pytest
from python_process import REPO, run_python

CASES = {
    "bench_async.py": [
        "### Rollouts ahead of training: 4 steps",
        "| max_staleness=0 | ",
        "| max_staleness=2 | ",
        "max_staleness=1: ",
        "torch CPU capability",
    ],
    "bench_engine.py": [
        "### Engine throughput: demo step",
        "| batch-invariant, tile 64 (default)",
        "target: batch-invariant serving",
    ],
    "bench_wire.py": [
        "### Wire decode of one response",
        "| pybase64.b64decode of the payload (floor)",
        "target:",
    ],
    "bench_multiturn.py": [
        "### Multi-turn route bytes per turn",
        "| 4    | 192              | 97              | 959             | 480            | 4.97x",
        "| incremental | 959                 | 0.47",
        "resending every row sends 2.80x the rows",
    ],
    "bench_align.py": [
        "### Alignment into model-facing layouts",
        "| padded [B, S]",
        "| CP shard 0/2 [1, T/2]",
    ],
    "bench_scale.py": [
        "### Per rank, measured",
        "| per-rank  | 2     | 3.0",
        "| broadcast | 2     | 6.0",
        "target: per-rank route bytes = global / 2 within 5%: met",
        "### Projection: 8 trajectories of 32k tokens per rank",
    ],
    "bench_server.py": [
        "### /health while 4 generate bodies of 4.0 MiB arrive",
        "| decode on the event loop",
        "| RolloutServer, decoder thread",
        "| RolloutServer, default cap",
    ],
    "bench_step.py": [
        "SIMULATED engine disagreement 10% of expert slots",
        "### R3 step vs off step: tiny",
        "### R3 step vs off step: mid",
        "| r3 (replay=r3: routes aligned, installed, replayed)",
        "### Route work, each piece alone: mid",
        "| layout + align",
        "target: r3 step <= 1.02x the off step on the CPU: tiny ",
    ],
    "bench_collate.py": [
        "### U[max/16, max] typical RL",
        "| packed pool",
        "| collator reused pool",
        "| floor: copy into touched buffer",
        "packed / padded peak memory <= 0.55:",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_quick_run_prints_its_table(script):
    done = run_python(REPO, str(REPO / "benchmarks" / script), "--quick", OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    for expected in CASES[script]:
        assert expected in done.stdout, f"{expected!r} missing from:\n{done.stdout}"
    header = next(
        line for line in done.stdout.splitlines() if line.startswith("| arm") or line.startswith("| layout")
    )
    assert header.count("|") >= 4
