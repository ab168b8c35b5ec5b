"""End-to-end checks of the data, Hugging Face and megatron-core replay paths on one CUDA GPU.

Run it on a machine with a GPU (sized to take about a minute; it stops itself, printing every
thread's stack, after ``--time-limit`` seconds, 170 by default)::

    .venv/bin/python scripts/gpu_check.py                  # every check on cuda:0
    .venv/bin/python scripts/gpu_check.py --only transfer,megatron --json results.json

``make setup`` installs the CPU build of torch into ``.venv``: there every check prints
``SKIP: no CUDA`` and the script exits 0. On a GPU machine, use a Python that already has a CUDA
build of torch plus transformers 5.x and lightning 2.5+ (check with ``python3 -c "import torch;
print(torch.cuda.is_available())"``); nothing of this checkout needs installing, the script puts
the checkout on ``sys.path`` itself::

    python3 scripts/gpu_check.py

Such images rarely hold megatron-core, or orjson and pybase64 (imported by the route wire codec).
Without network access there, download their wheels where pip reaches PyPI, matching the GPU
machine's Python (3.12 here), bring ``.whl/`` along and install them without dependencies
(megatron-core needs only torch, numpy and packaging)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        megatron-core==0.16.1 orjson==3.13.0 pybase64==1.5.1
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 scripts/gpu_check.py

Without megatron-core the ``megatron`` check reports SKIP. ``--device cpu`` runs the same checks on
the CPU wherever their meaning survives (pinning, copy bandwidth, Lightning's FSDP1 strategy and
the sync guard need CUDA), so the script is known to work before it meets a GPU.

Checks (one ``PASS`` / ``FAIL`` / ``SKIP`` line each, then a summary with figures; exit status 1
when any check fails):

* ``transfer``: trajectories -> ``ReplayBuffer`` -> ``R3DataModule`` (pinned buffer pool) ->
  ``transfer_batch_to_device`` with ``non_blocking`` copies. Host batches are pinned; device
  values equal a plain-loop reference, also after the pool rewrote the pinned buffers for later
  batches (each copy queued behind ``torch.cuda._sleep`` so a missing fence corrupts them); the
  pool reuses its buffers without a miss; the callback's layout + align + install runs with
  ``torch.cuda.set_sync_debug_mode("error")`` (no device->host sync) and the installed routes are
  the ones a forward uses. Figures: host->device copy GB/s, pinned vs pageable.
* ``hf``, ``hf-fsdp``, ``hf-fsdp2``: a tiny Qwen3-MoE trained by a real Lightning ``Trainer``
  (single device; Lightning's ``fsdp`` strategy; ``ModelParallelStrategy`` + ``fully_shard``)
  with ``R3DataModule`` and ``RouterReplayCallback``: every training forward uses exactly the
  engine's experts on every captured token and MoE layer (100%), routes are installed during each
  step and cleared after it, batches arrive pinned and on the device, the routers get updated.
* ``grpo``, ``grpo-bf16``, ``grpo-fsdp2``: the package's ``GRPOModule`` with HF activation
  checkpointing, trained by a Lightning ``Trainer`` (32-true; ``precision="bf16-true"``; the
  module's own FSDP2 sharding under ``ModelParallelStrategy``): every step after the first runs
  under ``torch.cuda.set_sync_debug_mode("error")`` (any device->host sync fails the check), batch
  float fields reach the step as float32, batches arrive pinned, the pool never misses, and the
  forwards use the engine's experts on every captured slot.
* ``megatron``: a megatron-core ``MoELayer`` (``TopKRouter`` + ``SequentialMLP``) with
  ``MegatronRouterReplay`` on packed, pinned routes aligned without a device->host sync: its
  output and router gradient equal an independent reference computed from the installed experts
  (native experts where the replay mask is False); megatron's MoE activation recompute
  (``REPLAY_BACKWARD``) gives the same gradients.
* ``step``: what R3 costs per training step (``benchmarks/bench_step.py``'s measurement): one
  Lightning fit alternating ``replay=r3`` and ``replay=off`` steps on one batch and weights, each
  step checked (r3 used every route expert, off replayed nothing), then the route work piece by
  piece. On CUDA the tiny and the mid-size MoE (8 layers, 64 experts, top-8, 4k tokens), whose r3
  step must stay below 1.01x its off step; on the CPU the tiny model, reported only.

The checks live in ``scripts/gpu_checks/``, one module per concept (``common`` holds what they
share).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE):  # the checkout's package without installing it, and gpu_checks/
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from gpu_checks.common import CheckFailed, Result, Skip, fmt, shutdown_process_group  # noqa: E402, F401
from gpu_checks.grpo import check_grpo  # noqa: E402
from gpu_checks.hf import check_hf  # noqa: E402
from gpu_checks.megatron import check_megatron, megatron_runtime  # noqa: E402, F401
from gpu_checks.step import check_step  # noqa: E402
from gpu_checks.transfer import check_transfer  # noqa: E402

RUNNERS: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "transfer": check_transfer,
    "hf": partial(check_hf, variant="single"),
    "hf-fsdp": partial(check_hf, variant="fsdp"),
    "hf-fsdp2": partial(check_hf, variant="fsdp2"),
    "grpo": partial(check_grpo, variant="single"),
    "grpo-bf16": partial(check_grpo, variant="bf16"),
    "grpo-fsdp2": partial(check_grpo, variant="fsdp2"),
    "megatron": check_megatron,
    "step": check_step,
}
CHECKS = tuple(RUNNERS)


# ------------------------------------------------------------------------------- driver
def _run(name: str, device: torch.device | None) -> Result:
    start = time.perf_counter()
    if device is None:
        return Result(name, "SKIP", "no CUDA")
    try:
        figures = RUNNERS[name](device)
    except Skip as skip:
        return Result(name, "SKIP", str(skip), time.perf_counter() - start)
    except Exception as error:  # every failure is reported; the remaining checks still run
        tail = traceback.format_exc(limit=-3).strip().splitlines()
        message = str(error).strip().splitlines()
        detail = type(error).__name__ + (f": {message[0]}" if message else "")
        print("\n".join(f"    {line}" for line in tail), flush=True)
        return Result(name, "FAIL", detail, time.perf_counter() - start)
    return Result(name, "PASS", "", time.perf_counter() - start, figures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default="auto", help="auto (cuda:0 if available, else skip everything), cuda[:N], or cpu"
    )
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {CHECKS}")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument(
        "--time-limit", type=float, default=170.0, help="abort (exit 1) after this many seconds"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        parser.error(f"--only: unknown checks {unknown}; choose from {CHECKS}")
    if args.device == "auto":
        device = torch.device("cuda", 0) if torch.cuda.is_available() else None
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cuda", "cpu"):
            parser.error(f"--device must be auto, cuda[:N] or cpu, got {args.device!r}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                device = None
            elif device.index is None:
                device = torch.device("cuda", 0)
    if args.time_limit > 0:  # a hung collective must not eat the machine's time
        faulthandler.dump_traceback_later(args.time_limit, exit=True)
    where = "no CUDA" if device is None else str(device)
    if device is not None and device.type == "cuda":
        where += f" ({torch.cuda.get_device_name(device)})"
    print(f"gpu_check: torch {torch.__version__} on {where}; checks {names}", flush=True)
    start = time.perf_counter()
    results = []
    for name in names:
        result = _run(name, device)
        print(result.line(), flush=True)
        results.append(result)
    faulthandler.cancel_dump_traceback_later()
    shutdown_process_group()
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    figures = {f"{r.name}.{k}": v for r in results for k, v in r.figures.items()}
    shown = " ".join(f"{k}={fmt(v)}" for k, v in figures.items())
    print(
        f"SUMMARY: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP "
        f"in {time.perf_counter() - start:.1f} s" + (f" | {shown}" if shown else ""),
        flush=True,
    )
    if args.json is not None:
        payload = {
            "device": None if device is None else str(device),
            "torch": torch.__version__,
            "results": [r.__dict__ for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
