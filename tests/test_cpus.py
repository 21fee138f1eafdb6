"""CPU quota detection against fake cgroup trees."""

from pathlib import Path

import pytest

from compile_service import cpus


def tree(tmp_path: Path, files: dict[str, str], own: str = "0::/\n") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(own)
    return root, proc


@pytest.mark.parametrize(
    "files, own, quota",
    [
        ({"cgroup.controllers": "cpu", "cpu.max": "150000 100000\n"}, "0::/\n", 1.5),
        ({"cgroup.controllers": "cpu", "cpu.max": "max 100000\n"}, "0::/\n", None),
        ({"cgroup.controllers": "cpu"}, "0::/\n", None),  # no cpu.max at all
        ({"cgroup.controllers": "cpu", "cpu.max": "garbage"}, "0::/\n", None),
        # v2, the process in a nested group with a tighter limit than the root
        ({"cgroup.controllers": "cpu", "cpu.max": "400000 100000", "kube/pod1/cpu.max": "50000 100000"}, "0::/kube/pod1\n", 0.5),
        # v1: cpu,cpuacct mount, quota over period
        ({"cpu,cpuacct/cpu.cfs_quota_us": "300000", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, "2:cpu,cpuacct:/\n", 3.0),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, "1:cpu:/\n", None),  # unlimited
        ({"cpu/cpu.cfs_quota_us": "250000"}, "1:cpu:/\n", None),  # period file missing
        ({"cpu/docker/abc/cpu.cfs_quota_us": "200000", "cpu/docker/abc/cpu.cfs_period_us": "100000"}, "1:cpu:/docker/abc\n", 2.0),
        ({}, "", None),  # no cgroup filesystem
    ],
)
def test_cgroup_quota(tmp_path, files, own, quota):
    root, proc = tree(tmp_path, files, own)
    assert cpus.cgroup_quota(root, proc) == quota


def test_usable_cpus_rounds_quota_up_and_never_exceeds_affinity(tmp_path, monkeypatch):
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 16)
    root, proc = tree(tmp_path, {"cgroup.controllers": "cpu", "cpu.max": "150000 100000"})
    assert cpus.usable_cpus(root, proc) == 2  # 1.5 CPUs -> 2 workers
    root2, proc2 = tree(tmp_path / "b", {"cgroup.controllers": "cpu", "cpu.max": "6400000 100000"})
    assert cpus.usable_cpus(root2, proc2) == 16  # quota 64 > affinity 16
    root3, proc3 = tree(tmp_path / "c", {"cgroup.controllers": "cpu", "cpu.max": "1000 100000"})
    assert cpus.usable_cpus(root3, proc3) == 1  # at least one
