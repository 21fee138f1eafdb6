"""How much memory compiles may use, and how many builds fit in it at once.

The limit: the cgroup memory limit (v2 `memory.max`, v1 `memory.limit_in_bytes`) or the host's
MemAvailable, whichever is smaller, unless one is given (--memory-limit). Each kernel kind's
builds are measured in the worker (its peak resident memory while building, and that of any
compiler subprocess) and the largest peak is remembered per kind; a kind not yet measured
counts as DEFAULT_PEAK, on the safe side. The pool takes as many workers as the CPUs allow and
the limit holds at DEFAULT_PEAK each; then a build starts only while the peaks of the builds
running and its own fit the limit: one that would not waits for others to end. One build always
runs, whatever its peak, so nothing waits forever.

The sibling rule for CPUs is compile_service.cpus.
"""

from __future__ import annotations

import contextlib
import resource
import threading
from pathlib import Path

from .cpus import own_cgroup_paths, read_text

DEFAULT_PEAK = 1 << 30  # a build of a kind not measured yet: a worker with NVRTC's headers peaks at hundreds of MB
_V1_UNLIMITED = 1 << 60  # v1 reports "no limit" as a page-rounded 2**63 - 1


def _limit_v2(text: str | None) -> int | None:
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None


def _limit_v1(text: str | None) -> int | None:
    value = _limit_v2(text)
    return value if value is not None and value < _V1_UNLIMITED else None


def cgroup_limit(root: Path = Path("/sys/fs/cgroup"), proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The cgroup memory limit in bytes, or None when unlimited or unknown: this process's own
    group and the mount root (a container's namespace makes them one), the smallest wins."""
    own = own_cgroup_paths(proc_self_cgroup)
    limits = []
    if (root / "cgroup.controllers").exists():  # v2, unified
        for rel in {own.get("", "/").lstrip("/"), ""}:
            limits.append(_limit_v2(read_text(root / rel / "memory.max")))
    elif (root / "memory").is_dir():
        for rel in {own.get("memory", "/").lstrip("/"), ""}:
            limits.append(_limit_v1(read_text(root / "memory" / rel / "memory.limit_in_bytes")))
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's MemAvailable in bytes, or None when unknown."""
    for line in (read_text(meminfo) or "").splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            with contextlib.suppress(ValueError, IndexError):
                return int(value.split()[0]) * 1024
    return None


def memory_limit(root: Path = Path("/sys/fs/cgroup"), proc_self_cgroup: Path = Path("/proc/self/cgroup"), meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The memory compiles may use: min(cgroup limit, MemAvailable); None when neither is known."""
    known = [v for v in (cgroup_limit(root, proc_self_cgroup), mem_available(meminfo)) if v is not None]
    return min(known) if known else None


def pool_size(cpus: int, limit: int | None) -> int:
    """Workers for `cpus` CPUs within `limit` bytes: as many as hold a build of DEFAULT_PEAK, at least 1."""
    return cpus if limit is None else max(1, min(cpus, limit // DEFAULT_PEAK))


def describe_limit(limit: int | None, source: str, workers: int) -> str:
    """The choice in words, for the daemon's start-up line."""
    if limit is None:
        return "no memory limit known: builds are bounded by the workers only"
    at_default = max(1, min(workers, limit // DEFAULT_PEAK))
    return (
        f"memory limit {limit / (1 << 30):.2f} GiB ({source or 'default'}): builds start while their kinds' measured peaks fit it, "
        f"{at_default} at once at {DEFAULT_PEAK >> 20} MiB each before any is measured"
    )


class BuildMemory:
    """Admits builds while their kinds' peaks fit `limit` (None: no limit); remembers each kind's peak."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self._peaks: dict[str, int] = {}  # kind -> the largest peak measured
        self._reserved = 0  # bytes the running builds' peaks add up to
        self._running = 0
        self.most_running = 0  # the most builds that ran at once since start
        self._changed = threading.Condition()

    def peak(self, kind: str) -> int:
        """What a build of `kind` is counted as: its largest measured peak, else DEFAULT_PEAK."""
        with self._changed:
            return self._peaks.get(kind, DEFAULT_PEAK)

    def peaks(self) -> dict[str, int]:
        with self._changed:
            return dict(self._peaks)

    def largest_peak(self) -> int:
        """The largest peak measured of one build of any kind (0 before any)."""
        with self._changed:
            return max(self._peaks.values(), default=0)

    def builds_at_once(self, workers: int) -> int:
        """How many builds fit the limit at the largest peak measured (DEFAULT_PEAK before any
        measurement), between 1 and `workers`."""
        if self.limit is None:
            return workers
        return max(1, min(workers, self.limit // (self.largest_peak() or DEFAULT_PEAK)))

    def record(self, kind: str, peak: int) -> None:
        if peak > 0:
            with self._changed:
                self._peaks[kind] = max(peak, self._peaks.get(kind, 0))

    @contextlib.contextmanager
    def admit(self, kind: str):
        """Holds a share of the limit for one build of `kind` while the block runs, waiting until it fits."""
        with self._changed:
            need = self._peaks.get(kind, DEFAULT_PEAK)
            while self.limit is not None and self._running and self._reserved + need > self.limit:
                self._changed.wait()
            self._reserved += need
            self._running += 1
            self.most_running = max(self.most_running, self._running)
        try:
            yield
        finally:
            with self._changed:
                self._reserved -= need
                self._running -= 1
                self._changed.notify_all()


# ----- measured in the worker


def _peak_rss() -> int:
    """This process's peak resident memory (VmHWM) in bytes; 0 when unknown."""
    for line in (read_text(Path("/proc/self/status")) or "").splitlines():
        if line.startswith("VmHWM:"):
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> None:
    """Starts VmHWM again from the current RSS (Linux: clear_refs 5); where that is refused the
    lifetime peak is reported, which only errs high."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def measured(fn, *args) -> tuple[object, int]:
    """(fn(*args), the peak resident bytes while it ran): the worker's own, plus the largest
    compiler subprocess's when one ran past every earlier one (they run beside the worker)."""
    _reset_peak()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = fn(*args)
    peak = _peak_rss()
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if after > children:
        peak += after * 1024
    return result, peak
