"""The Prometheus endpoint (`serve --metrics-address HOST:PORT`): a view of the one Metrics object.

Nothing is counted here: every scrape reads compile_service.metrics.Metrics,
the object the stats RPC reads too, so the two never disagree.
"""

from __future__ import annotations

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .metrics import COUNTERS, HISTOGRAMS, SECONDS, Metrics

PREFIX = "kernel_service_"
# Stats fields that are a value now (not totals), with their help text.
GAUGES = {
    "in_flight": "Compiles running or queued",
    "running": "Compiles running in workers",
    "queued": "Compiles waiting for a worker",
    "workers": "Size of the compile pool",
    "workers_ready": "Workers started and warmed up",
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


def serve_metrics(metrics: Metrics, address: str):
    """Serves /metrics on `address` ("host:port", checked by config.tcp_address) in a thread;
    returns the HTTP server (shutdown() stops it)."""
    host, _, port = address.rpartition(":")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    server = start_http_server(int(port), host.strip("[]"), registry)
    return server[0] if isinstance(server, tuple) else server
