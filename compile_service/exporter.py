"""The Prometheus endpoint (`serve --metrics-address HOST:PORT`): a view of the one Metrics object.

Nothing is counted here: every scrape reads compile_service.metrics.Metrics,
the object the stats RPC reads too, so the two never disagree.

It is served on the daemon's gRPC event loop, bounded: at most MAX_CONNECTIONS
at once (at the cap, the one that has waited longest for its request is closed
to make room, so idle connections cannot lock a scraper out), READ_TIMEOUT
seconds to send a request head of at most MAX_REQUEST bytes, WRITE_TIMEOUT to
take the answer, one request per connection. An idle or slow scraper holds no
thread and cannot keep the daemon from stopping.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CONTENT_TYPE_LATEST, ProcessCollector, generate_latest
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .metrics import COUNTERS, HISTOGRAMS, SECONDS, Metrics

PREFIX = "kernel_service_"
# Stats fields that are a value now (not totals), with their help text.
GAUGES = {
    "in_flight": "Compiles running or queued",
    "running": "Compiles running in workers",
    "queued": "Compiles waiting for a worker",
    "workers": "Size of the compile pool",
    "workers_ready": "Workers started and warmed up (before any warm-up: started)",
    "entries": "Entries in the cache",
    "bytes": "Bytes the cache keeps (entries, blobs, device binaries)",
    "inductor_entries": "Files in the shared torch.compile directory",
    "inductor_bytes": "Bytes in the shared torch.compile directory",
    "uptime_seconds": "Seconds since the daemon started",
    "cpu_quota": "CPUs the daemon may use",
    "memory_limit": "Bytes of memory the compile workers may use (0: unknown)",
    "memory_builds": "Builds that fit the memory limit at once, at the largest peak measured",
    "most_builds_running": "The most builds that ran at once since start",
    "build_peak_bytes": "The largest peak resident memory of one build",
    "remote_read_only": "1 when the host reads the fleet tier but never writes it",
}
# Gauges exported under a name that says their unit; the Stats field's own name stays one more
# release as a deprecated alias of the same value (docs/operations.md#observability).
NAMED_WITH_UNITS = {"bytes": "cache_bytes", "memory_limit": "memory_limit_bytes"}
REMOTE_STATES = ("off", "up", "down")  # Stats.remote_state: one series per state, 1 for the current one
HISTOGRAM_HELP = {
    "compile_duration_seconds": "Wall seconds of each compile, by kernel kind",
    "compile_phase_duration_seconds": "Seconds of each compile's phases (trace, lower, device, link)",
    "request_duration_seconds": "GetKernel latency, from arrival to answer, by outcome (hit, compiled, joined, or the error code)",
}


class _Collector:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        values = self.metrics.read()
        for name in (*COUNTERS, *SECONDS):
            family = CounterMetricFamily(PREFIX + name, f"Total {name.replace('_', ' ')} since stats_since (kernel-service stats)")
            family.add_metric([], values[name])
            yield family
        for name, help_text in GAUGES.items():
            if name in NAMED_WITH_UNITS:
                new_name = PREFIX + NAMED_WITH_UNITS[name]
                yield GaugeMetricFamily(new_name, help_text, value=values[name])
                help_text = f"Deprecated: {new_name}, whose value it repeats; removed in the next release"
            yield GaugeMetricFamily(PREFIX + name, help_text, value=values[name])
        state = GaugeMetricFamily(PREFIX + "remote_state", "The fleet tier's state (off: no tier; down: unreachable, the host goes on alone)", labels=["state"])
        for name in REMOTE_STATES:
            state.add_metric([name], 1.0 if values["remote_state"] == name else 0.0)
        yield state
        for name, series in self.metrics.histograms().items():
            label, buckets = HISTOGRAMS[name]
            family = HistogramMetricFamily(PREFIX + name, HISTOGRAM_HELP[name], labels=[label])
            bounds = [*(str(b) for b in buckets), "+Inf"]
            for value, (cumulative, total) in sorted(series.items()):
                family.add_metric([value], list(zip(bounds, cumulative)), total)
            yield family


MAX_CONNECTIONS = 64
READ_TIMEOUT = 5.0  # seconds
WRITE_TIMEOUT = 10.0  # seconds
MAX_REQUEST = 8192  # bytes of request line and headers


def _answer(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


class MetricsEndpoint:
    """The endpoint's asyncio server and its open connections (close() ends them all)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._reading: dict[asyncio.Task, None] = {}  # those still waiting for their request, oldest first

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= MAX_CONNECTIONS:
            if not self._reading:  # all busy answering: this one waits for none of them
                writer.close()
                return
            oldest = next(iter(self._reading))
            del self._reading[oldest]
            oldest.cancel()  # its finally closes it
        task = asyncio.current_task()
        self._connections.add(task)
        self._reading[task] = None
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            self._reading.pop(task, None)
            method, path = (head.split(b"\r\n", 1)[0].split(b" ") + [b"", b""])[:2]
            if method not in (b"GET", b"HEAD"):
                reply = _answer("405 Method Not Allowed", b"")
            elif path.split(b"?", 1)[0] not in (b"/metrics", b"/"):
                reply = _answer("404 Not Found", b"not found: try /metrics\n")
            else:  # the probes read the disk (cache usage): not on the loop
                body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, self.registry)
                reply = _answer("200 OK", b"" if method == b"HEAD" else body, CONTENT_TYPE_LATEST)
            writer.write(reply)
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # too slow, too long, or gone: the connection is closed
        finally:
            self._connections.discard(task)
            self._reading.pop(task, None)
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._connections):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._connections, return_exceptions=True)


async def serve_metrics(metrics: Metrics, address: str) -> MetricsEndpoint:
    """Serves /metrics on `address` ("host:port", checked by config.tcp_address) on the running
    event loop; returns the endpoint (close() stops it). Raises OSError when it cannot listen."""
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    ProcessCollector(registry=registry)  # the daemon process's process_* metrics (memory, CPU, open files), on Linux
    endpoint = MetricsEndpoint(registry)
    endpoint.server = await asyncio.start_server(endpoint._serve, host.strip("[]"), int(port), limit=MAX_REQUEST, reuse_address=True)
    return endpoint
