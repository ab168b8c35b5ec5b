"""How many CPUs this process may really use, for sizing the collation thread pool.

``os.cpu_count()`` reports the machine; a container limited by an affinity mask or a cgroup CPU
quota gets far less, and an oversized pool fights over those cores. Usable count:
``min(len(sched_getaffinity), ceil(tightest cgroup quota / period))`` on the path from this
process's cgroup to the root (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``;
rounded up: 1.5 CPUs keeps two threads partly busy). A missing, unreadable or malformed file
means "no quota", never an error. Reads a handful of small files: call once, not per batch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["collate_pool_size", "usable_cpu_count"]

DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_PROC_CGROUP = Path("/proc/self/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _affinity_count() -> int:
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):  # not on Linux
        return max(os.cpu_count() or 1, 1)


def _own_cgroups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's (v2 path, v1 cpu-controller path) from ``/proc/self/cgroup``."""
    text = _read(proc_cgroup)
    if not text:
        return None, None
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(mount: Path, cgroup_path: str | None) -> list[Path]:
    """Directories from the process's cgroup up to the mount root (root last), existing only.

    Inside a container the recorded path may be the host's (``/docker/<id>``) while the mount
    shows the container's own cgroup at its root: then only the root exists and is used.
    """
    relative = Path((cgroup_path or "/").lstrip("/"))
    chain = [mount / relative, *[mount / parent for parent in relative.parents]]
    seen: list[Path] = []
    for directory in chain:
        if directory.is_dir() and directory not in seen:
            seen.append(directory)
    return seen


def _quota(quota: str | None, period: str | None) -> float | None:
    """CPUs of a quota / period pair of texts; ``None`` when unlimited ("max", -1) or malformed."""
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _v2_quota(directory: Path) -> float | None:
    fields = (_read(directory / "cpu.max") or "").split()
    return _quota(*fields) if len(fields) == 2 else None


def _v1_quota(directory: Path) -> float | None:
    return _quota(_read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us"))


def cgroup_cpu_limit(
    *,
    cgroup_root: str | os.PathLike[str] = DEFAULT_CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = DEFAULT_PROC_CGROUP,
) -> float | None:
    """Tightest cgroup CPU quota in CPUs (e.g. 1.5), or ``None`` when there is none.

    cgroup v2 (unified hierarchy mounted at ``cgroup_root``) is tried first, then v1 (the ``cpu``
    controller at ``cgroup_root/cpu,cpuacct`` or ``cgroup_root/cpu``).
    """
    root = Path(cgroup_root)
    v2_path, v1_path = _own_cgroups(Path(proc_cgroup))
    quotas: list[float] = []
    if (root / "cgroup.controllers").exists() or (v2_path is not None and v1_path is None):
        quotas += [q for d in _ancestors(root, v2_path) if (q := _v2_quota(d)) is not None]
    if not quotas:
        for mount in (root / "cpu,cpuacct", root / "cpuacct,cpu", root / "cpu"):
            if mount.is_dir():
                quotas += [q for d in _ancestors(mount, v1_path) if (q := _v1_quota(d)) is not None]
                break
    return min(quotas) if quotas else None


def usable_cpu_count(
    *,
    cgroup_root: str | os.PathLike[str] = DEFAULT_CGROUP_ROOT,
    proc_cgroup: str | os.PathLike[str] = DEFAULT_PROC_CGROUP,
    affinity: int | None = None,
) -> int:
    """CPUs this process may use: ``min(affinity, ceil(cgroup quota))``, at least 1.

    ``affinity`` overrides ``len(os.sched_getaffinity(0))`` (for tests); the cgroup paths are
    injectable so tests can point them at fake files.
    """
    count = _affinity_count() if affinity is None else affinity
    limit = cgroup_cpu_limit(cgroup_root=cgroup_root, proc_cgroup=proc_cgroup)
    if limit is not None:
        count = min(count, math.ceil(limit))
    return max(count, 1)


def collate_pool_size(cap: int = 8, reserved: int = 1, *, usable: int | None = None) -> int:
    """Threads for collation: ``min(cap, usable - reserved)``, at least 1.

    ``reserved`` CPUs are left to the training loop's own thread; ``usable`` defaults to
    :func:`usable_cpu_count`.
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    if reserved < 0:
        raise ValueError(f"reserved must be >= 0, got {reserved}")
    usable = usable_cpu_count() if usable is None else usable
    return max(1, min(cap, usable - reserved))
