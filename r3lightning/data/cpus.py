"""How many CPUs this process may really use (affinity mask, cgroup v1 / v2 quotas up to the root),
for sizing the collation threads; an unreadable or malformed file means "no quota". Call once."""

from __future__ import annotations

import math
import os
from pathlib import Path

from r3lightning.checks import check_int

__all__ = ["collate_pool_size", "usable_cpu_count"]

DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_PROC_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _own_cgroups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's (v2 path, v1 cpu-controller path) from ``/proc/self/cgroup``."""
    v2 = v1 = None
    for parts in (line.split(":", 2) for line in _read(proc_cgroup).splitlines()):
        if len(parts) == 3 and parts[:2] == ["0", ""]:
            v2 = parts[2]
        elif len(parts) == 3 and "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _ancestors(mount: Path, cgroup_path: str | None) -> list[Path]:
    """Existing directories from the process's cgroup up to the mount root."""
    # in a container the recorded path may be the host's: then only the mount root exists
    relative = Path((cgroup_path or "/").lstrip("/"))
    chain = [mount / relative, *[mount / parent for parent in relative.parents]]
    return [directory for directory in dict.fromkeys(chain) if directory.is_dir()]


def _quota(directory: Path, *, v2: bool) -> float | None:
    """CPUs of ``directory``'s quota; ``None`` when unlimited ("max", -1), missing or malformed."""
    if v2:
        fields = _read(directory / "cpu.max").split()
    else:
        fields = [_read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")]
    try:
        quota, period = (int(text) for text in fields)
    except ValueError:  # not two integers
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_limit(
    *,
    cgroup_root: str | os.PathLike[str] = DEFAULT_CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = DEFAULT_PROC_CGROUP,
) -> float | None:
    """The tightest cgroup CPU quota of this process, in CPUs (e.g. 1.5): v2 ``cpu.max`` first, then
    v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, over its cgroup and their ancestors.

    Args:
        cgroup_root: Where the cgroup file systems are mounted.
        proc_cgroup: This process's cgroup file.

    Returns:
        The quota, or None when unlimited or unknown.
    """
    root = Path(cgroup_root)
    v2_path, v1_path = _own_cgroups(Path(proc_cgroup))
    quotas: list[float] = []
    if (root / "cgroup.controllers").exists() or (v2_path is not None and v1_path is None):
        found = (_quota(d, v2=True) for d in _ancestors(root, v2_path))
        quotas = [q for q in found if q is not None]
    mounts = [m for m in (root / "cpu,cpuacct", root / "cpuacct,cpu", root / "cpu") if m.is_dir()]
    if not quotas and mounts:
        found = (_quota(d, v2=False) for d in _ancestors(mounts[0], v1_path))
        quotas = [q for q in found if q is not None]
    return min(quotas, default=None)


def usable_cpu_count(
    *,
    cgroup_root: str | os.PathLike[str] = DEFAULT_CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = DEFAULT_PROC_CGROUP,
    affinity: int | None = None,
) -> int:
    """CPUs this process may use: ``min(len(os.sched_getaffinity(0)), ceil(cgroup quota))``, >= 1.

    Args:
        cgroup_root, proc_cgroup: As for `cgroup_cpu_limit`.
        affinity: The CPUs of the affinity mask (None: read it).
    """
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not on Linux
            affinity = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root=cgroup_root, proc_cgroup=proc_cgroup)
    return max(affinity if limit is None else min(affinity, math.ceil(limit)), 1)


def collate_pool_size(cap: int = 8, reserved: int = 1, *, usable: int | None = None) -> int:
    """Threads for collation: ``min(cap, usable_cpu_count() - reserved)``, at least 1.

    Args:
        cap: The most threads.
        reserved: CPUs left to the training loop.
        usable: The usable CPUs (None: `usable_cpu_count`).

    Raises:
        ValueError: ``cap`` below 1 or ``reserved`` below 0.
    """
    check_int("cap", cap)
    check_int("reserved", reserved, 0)
    usable = usable_cpu_count() if usable is None else usable
    return max(1, min(cap, usable - reserved))
