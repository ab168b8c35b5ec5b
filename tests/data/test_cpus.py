import os

import pytest

from r3lightning.data.cpus import cgroup_cpu_limit, collate_pool_size, usable_cpu_count


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def v2(tmp_path):
    """A fake cgroup v2 tree: the process sits in /job/worker."""
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu memory\n")
    (root / "job" / "worker").mkdir(parents=True)
    proc = tmp_path / "proc_cgroup"
    write(proc, "0::/job/worker\n")
    return root, proc


def count(root, proc, affinity=16):
    return usable_cpu_count(cgroup_root=root, proc_cgroup=proc, affinity=affinity)


def test_v2_quota_is_rounded_up_and_capped_by_affinity(v2):
    root, proc = v2
    write(root / "job" / "worker" / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_limit(cgroup_root=root, proc_cgroup=proc) == 1.5
    assert count(root, proc) == 2
    assert count(root, proc, affinity=1) == 1


def test_v2_tightest_ancestor_wins(v2):
    root, proc = v2
    write(root / "job" / "worker" / "cpu.max", "max 100000\n")
    write(root / "job" / "cpu.max", "400000 100000\n")
    write(root / "cpu.max", "600000 100000\n")
    assert count(root, proc) == 4


@pytest.mark.parametrize("text", ["max 100000", "", "garbage", "1 2 3", "-5 100000", "100000 0", "\xff"])
def test_v2_unlimited_or_garbage_means_no_quota(v2, text):
    root, proc = v2
    write(root / "job" / "worker" / "cpu.max", text)
    assert cgroup_cpu_limit(cgroup_root=root, proc_cgroup=proc) is None
    assert count(root, proc, affinity=5) == 5


def test_v2_missing_files_mean_no_quota(tmp_path):
    root = tmp_path / "nothing"
    assert count(root, tmp_path / "missing", affinity=3) == 3
    write(tmp_path / "proc", "0::/gone/away\n")
    write(root / "cgroup.controllers", "cpu\n")
    assert count(root, tmp_path / "proc", affinity=3) == 3


def test_v2_container_with_host_path_uses_the_mount_root(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu\n")
    write(root / "cpu.max", "250000 100000\n")
    write(tmp_path / "proc", "0::/kubepods/pod123/abc\n")  # not visible inside the container
    assert count(root, tmp_path / "proc") == 3


@pytest.mark.parametrize("mount", ["cpu,cpuacct", "cpu"])
def test_v1_cfs_quota(tmp_path, mount):
    root = tmp_path / "cgroup"
    group = root / mount / "docker" / "abc"
    write(group / "cpu.cfs_quota_us", "300000\n")
    write(group / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "proc", "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_limit(cgroup_root=root, proc_cgroup=tmp_path / "proc") == 3.0
    assert count(root, tmp_path / "proc") == 3


@pytest.mark.parametrize(
    ("quota", "period"), [("-1", "100000"), ("oops", "100000"), ("200000", ""), ("200000", "0")]
)
def test_v1_unlimited_or_garbage_means_no_quota(tmp_path, quota, period):
    root = tmp_path / "cgroup"
    write(root / "cpu" / "cpu.cfs_quota_us", quota)
    write(root / "cpu" / "cpu.cfs_period_us", period)
    write(tmp_path / "proc", "3:cpu:/\n")
    assert count(root, tmp_path / "proc", affinity=7) == 7


def test_v1_quota_on_the_mount_root_when_the_path_is_the_host_path(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "50000")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000")
    write(tmp_path / "proc", "4:cpu,cpuacct:/host/only/path\n")
    assert count(root, tmp_path / "proc") == 1  # half a CPU still rounds up to one


def test_this_machine():
    usable = usable_cpu_count()
    assert 1 <= usable <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("usable", "cap", "reserved", "expected"),
    [(16, 8, 1, 8), (4, 8, 1, 3), (2, 8, 1, 1), (1, 8, 1, 1), (1, 8, 0, 1), (6, 8, 0, 6), (64, 4, 2, 4)],
)
def test_collate_pool_size(usable, cap, reserved, expected):
    assert collate_pool_size(cap, reserved, usable=usable) == expected


def test_collate_pool_size_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"cap must be an int >= 1, got 0"):
        collate_pool_size(0, usable=4)
    with pytest.raises(ValueError, match=r"reserved must be an int >= 0, got -1"):
        collate_pool_size(4, -1, usable=4)
    assert 1 <= collate_pool_size() <= 8
