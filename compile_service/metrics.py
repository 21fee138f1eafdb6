"""The daemon's one metrics object: counters, plus probes read when asked.

The stats RPC, the CLI and any exporter read `read()`; its names are the
proto's `Stats` fields (proto.wire.STATS_FIELDS), which are their one
definition. Counters start at zero with each daemon.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

COUNTERS = ("compiles", "hits", "misses", "failures", "failures_cached", "joined", "derived", "invalid", "corrupt", "evictions")
SECONDS = ("compile_seconds", "device_compile_seconds")


class Metrics:
    def __init__(self):
        self._values: dict[str, float] = {**dict.fromkeys(COUNTERS, 0), **dict.fromkeys(SECONDS, 0.0)}
        self._probes: dict[str | tuple[str, ...], Callable[[], object]] = {}
        self._lock = threading.Lock()

    def add(self, **deltas) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta  # KeyError on a name that is no counter: a bug, loud

    def probe(self, name: str | tuple[str, ...], read: Callable[[], object]) -> None:
        """A value computed when the metrics are read (queue depth, uptime); a tuple of names
        takes a tuple of values from one read (cache entries and bytes, from one walk)."""
        self._probes[name] = read

    def probes(self, **reads: Callable[[], object]) -> None:
        for name, read in reads.items():
            self.probe(name, read)

    def counters(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def read(self) -> dict[str, object]:
        """Every counter and probe by name."""
        out = self.counters()
        for name, read in self._probes.items():
            if isinstance(name, tuple):
                out.update(zip(name, read()))
            else:
                out[name] = read()
        return out


def ignore(**deltas) -> None:
    """A drop-in for Metrics.add where a request is the service's own (not counted)."""
