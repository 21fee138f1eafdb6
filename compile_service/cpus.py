"""How many CPUs this process may really use: affinity and the cgroup CPU quota (memory: compile_service.memory).

os.cpu_count() reports the host's cores; a container limited by a cgroup quota
(cpu.max on v2, cpu.cfs_quota_us / cpu.cfs_period_us on v1) gets throttled if
it runs that many compile workers. TileLang sizes its pool by affinity only.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def own_cgroup_paths(proc_self_cgroup: Path) -> dict[str, str]:
    """Controller -> cgroup path of this process ("" for the v2 unified tree)."""
    paths = {}
    for line in (read_text(proc_self_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _quota_v2(cpu_max: str | None) -> float | None:
    # "max 100000" is unlimited; "150000 100000" is 1.5 CPUs.
    if not cpu_max:
        return None
    fields = cpu_max.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(quota_text: str | None, period_text: str | None) -> float | None:
    # A quota of -1 is unlimited.
    try:
        quota, period = int(quota_text or ""), int(period_text or "")
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"), proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota in CPUs (may be fractional), or None when unlimited or unknown.

    Looks at this process's own cgroup and then the mount root, since inside a
    container the cgroup namespace usually makes the root the process's own group.
    The smallest limit found wins, as the kernel enforces every level.
    """
    own = own_cgroup_paths(proc_self_cgroup)
    limits = []
    if (root / "cgroup.controllers").exists():  # v2, unified
        for rel in {own.get("", "/").lstrip("/"), ""}:
            limits.append(_quota_v2(read_text(root / rel / "cpu.max")))
    else:  # v1: the cpu controller may be mounted as cpu, cpu,cpuacct or cpuacct,cpu
        for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            base = root / mount
            if not base.is_dir():
                continue
            for rel in {own.get("cpu", "/").lstrip("/"), ""}:
                limits.append(_quota_v1(read_text(base / rel / "cpu.cfs_quota_us"), read_text(base / rel / "cpu.cfs_period_us")))
            break
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def usable_cpus(root: Path = Path("/sys/fs/cgroup"), proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """min(affinity, quota rounded up), at least 1."""
    cpus = affinity_cpus()
    quota = cgroup_quota(root, proc_self_cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)
