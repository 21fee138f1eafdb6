"""The daemon's one metrics object: counters, histograms, and probes read when asked.

The stats RPC, the CLI and the Prometheus endpoint (compile_service.exporter) all
read this object; the counters' and probes' names are the proto's `Stats` fields
(proto.wire.STATS_FIELDS), which are their one definition.

The counters are totals since the last `kernel-service zero-stats`: the daemon
keeps them in `<cache root>/stats.json` (saved every SAVE_EVERY seconds and at
stop) and a restarted daemon goes on from there. Histograms and probes describe
the running daemon only.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .fsutil import write_json_atomic

log = logging.getLogger(__name__)

# The fleet tier's (store.tiered, store.remote); zero on a daemon without --remote.
REMOTE_COUNTERS = (
    "remote_hits",
    "remote_misses",
    "remote_bytes_in",
    "remote_bytes_out",
    "remote_lease_waits",
    "remote_takeovers",
    "remote_errors",
    "remote_corrupt",
)
COUNTERS = (
    "compiles",
    "hits",  # GetKernel's, and clients' direct hits as they report them
    "direct_hits",  # of hits, those clients found in the cache themselves (ReportUsage)
    "misses",
    "failures",
    "failures_cached",
    "joined",
    "derived",
    "invalid",
    "corrupt",
    "evictions",
    "not_ready",
    "compile_timeouts",
    "local_compiles",
    *REMOTE_COUNTERS,
)
SECONDS = ("compile_seconds", "device_compile_seconds")
STATS_FILE = "stats.json"
SAVE_EVERY = 30.0  # seconds between saves of the counters while the daemon runs

# Histograms: name -> (its label, bucket upper bounds in seconds).
COMPILE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
REQUEST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
HISTOGRAMS = {
    "compile_duration_seconds": ("kind", COMPILE_BUCKETS),  # one per compile (not per copy of a shared build)
    "compile_phase_duration_seconds": ("phase", COMPILE_BUCKETS),  # trace, lower, device, link of each compile
    "request_duration_seconds": ("outcome", REQUEST_BUCKETS),  # GetKernel, from arrival to answer: hit, compiled, joined, or the error code
}


class Histogram:
    """Cumulative-bucket counts per label value, Prometheus-style."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.series: dict[str, list] = {}  # label value -> [counts per bucket (+Inf last), sum]

    def observe(self, label: str, value: float) -> None:
        counts, _ = series = self.series.setdefault(label, [[0] * (len(self.buckets) + 1), 0.0])
        counts[bisect.bisect_left(self.buckets, value)] += 1
        series[1] += value

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        """label -> (cumulative counts per bucket, +Inf last, sum)."""
        out = {}
        for label, (counts, total) in self.series.items():
            running, cumulative = 0, []
            for c in counts:
                running += c
                cumulative.append(running)
            out[label] = (cumulative, total)
        return out


class Metrics:
    def __init__(self):
        self._values: dict[str, float] = {}
        self._histograms: dict[str, Histogram] = {}
        self._probes: dict[str | tuple[str, ...], Callable[[], object]] = {}
        self._lock = threading.Lock()
        self.zero()

    def add(self, **deltas) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta  # KeyError on a name that is no counter: a bug, loud

    def observe(self, name: str, label: str, value: float) -> None:
        with self._lock:
            self._histograms[name].observe(label, value)

    def observe_compile(self, kind: str, seconds: float, phases: dict[str, float]) -> None:
        with self._lock:
            self._histograms["compile_duration_seconds"].observe(kind, seconds)
            for phase, value in phases.items():
                self._histograms["compile_phase_duration_seconds"].observe(phase, value)

    def probe(self, name: str | tuple[str, ...], read: Callable[[], object]) -> None:
        """A value computed when the metrics are read (queue depth, uptime); a tuple of names
        takes a tuple of values from one read (cache entries and bytes, from one walk)."""
        self._probes[name] = read

    def probes(self, **reads: Callable[[], object]) -> None:
        for name, read in reads.items():
            self.probe(name, read)

    def names(self) -> set[str]:
        """Every name read() returns, without reading the probes (some walk the cache)."""
        names = set(self.counters())
        for name in self._probes:
            names.update(name if isinstance(name, tuple) else (name,))
        return names

    def counters(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def histograms(self) -> dict[str, dict[str, tuple[list[int], float]]]:
        with self._lock:
            return {name: h.snapshot() for name, h in self._histograms.items()}

    def read(self) -> dict[str, object]:
        """Every counter and probe by name."""
        out = self.counters()
        for name, read in self._probes.items():
            if isinstance(name, tuple):
                out.update(zip(name, read()))
            else:
                out[name] = read()
        return out

    # ----- counters that survive a restart
    def zero(self) -> None:
        """Every counter and histogram back to zero, counting from now (`zero-stats`)."""
        with self._lock:
            self._values = {**dict.fromkeys(COUNTERS, 0), **dict.fromkeys(SECONDS, 0.0), "stats_since": time.time()}
            self._histograms = {name: Histogram(buckets) for name, (_, buckets) in HISTOGRAMS.items()}

    def load(self, path: Path) -> None:
        """Goes on from the counters a previous daemon saved at `path` (a missing or damaged file: from zero)."""
        try:
            saved = json.loads(Path(path).read_text())
            # A counter the previous daemon did not keep (an older release) starts at zero; the rest go on.
            values = {name: type(default)(saved.get(name, default)) for name, default in self.counters().items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("counters in %s unreadable (%s); counting from zero", path, exc)
            return
        with self._lock:
            self._values = values

    def save(self, path: Path) -> None:
        try:
            write_json_atomic(Path(path), self.counters())
        except OSError as exc:  # the counters are housekeeping: never fatal
            log.warning("cannot save the counters to %s: %s", path, exc)


def ignore(**deltas) -> None:
    """A drop-in for Metrics.add where a request is the service's own (not counted)."""
