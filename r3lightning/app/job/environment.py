"""What a run's rows depend on besides its config. The one place that builds it: demos, scripts,
benchmarks and the job's summary print `environment_line` of `environment`."""

from __future__ import annotations

import platform
from collections.abc import Mapping
from pathlib import Path

__all__ = ["environment", "environment_line"]


def environment() -> dict[str, str]:
    """What a run's rows depend on besides its config, read from this process and machine.

    Two machines with one CPU model string may still dispatch torch's kernels differently
    (``AVX2``, ``AVX512``), and so differ in their float results: the capability is recorded
    beside the model.

    Returns:
        Strings: the versions of ``torch``, ``transformers`` and ``lightning`` (keyed by those
        names), ``threads`` (torch's intra-op threads), ``cpu`` (the CPU model) and
        ``capability`` (torch's CPU capability).
    """
    import lightning
    import torch
    import transformers

    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    model = (line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    cpu = next(model, platform.processor() or platform.machine())
    versions = {m.__name__: m.__version__ for m in (torch, transformers, lightning)}
    capability = torch.backends.cpu.get_cpu_capability()
    return {**versions, "threads": str(torch.get_num_threads()), "cpu": cpu, "capability": capability}


def environment_line(env: Mapping[str, str]) -> str:
    """The environment as one line: the one that ends ``summary.txt`` and heads ``config.yaml``.

    Args:
        env: What `environment` returned.

    Returns:
        ``environment: torch ..., transformers ..., lightning ..., N intra-op threads, CPU ...``.
    """
    versions = ", ".join(f"{name} {env[name]}" for name in ("torch", "transformers", "lightning"))
    cpu = f"CPU {env['cpu']}, torch CPU capability {env.get('capability', 'unknown')}"
    return f"environment: {versions}, {env['threads']} intra-op threads, {cpu}"
