"""The fleet tier: N simulated hosts (daemons, each with its own cache and socket) against one Redis.

    python benchmark/fleet.py [--hosts 4] [--quick | --scale N] [--target c] [--workers W]
        [--fetches 200] [--json out.json] [--work-dir DIR]

Needs redis-server on PATH (started here on a loopback port, nothing saved).
Every mode runs on fresh caches, and the fleet on an empty Redis:

  single       one host, no tier: the zoo's cold build, the reference
  independent  N hosts, no tier, every host asking for the whole zoo at once:
               what a fleet pays today (N builds of every kernel)
  fleet        N hosts on one Redis, every host asking for the whole zoo at
               once: each kernel should compile once in the whole fleet
  serve_only   1 builder and N-1 serve-only hosts (--no-compile, read-only on
               the tier) on one Redis: the builder is sent the zoo (a prefetch,
               as prewarm sends it), then a strict agent on every serve-only
               host asks for the whole zoo at once. Every kernel is built once,
               on the builder; the serving hosts compile nothing and read
               everything through the tier
  fetch        the time to fetch one kernel from the tier onto a host that has
               none of it: the tier's read-through alone (one round trip for the
               index, one for the blobs, sha256 checks, the local publish with
               its fsyncs), in this process on a fresh local cache per round;
               and end to end, one GetKernel at a time on a fresh daemon

Walls run from the agents' first request to the last host holding every
kernel; daemons start before timing (a sidecar is up before agents come).
Hosts share this machine's CPUs, so `independent` shows N hosts' work on one
machine, and `fleet` the work of one host plus the tier's overhead.

Goals (the issue's, for 4 hosts and the quick CPU zoo on a 2-core machine):
fleet compiles == kernels; fleet wall <= 1.2x single; fetch p50 < 20 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import zoo  # noqa: E402  (benchmark/zoo.py, next to this file)
from devtools import redis_server  # noqa: E402
from devtools.launch import DaemonProcess, wait_serving  # noqa: E402
from proto.paths import socket_address  # noqa: E402

MODES = ("single", "independent", "fleet", "serve_only", "fetch")


class Bench:
    def __init__(self, args, specs: list):
        self.args, self.specs = args, specs
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="fleet-bench-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.seq = iter(range(1, 1 << 30))

    def daemons(self, n: int, *extra: str) -> list[DaemonProcess]:
        """n fresh daemons, started together and serving (not timed)."""
        out = []
        for _ in range(n):
            i = next(self.seq)
            flags = ["--target", self.specs[0]["target"], *extra]
            out.append(DaemonProcess(self.work / f"cache-{i}", *flags, workers=self.args.workers, log_path=self.work / f"daemon-{i}.log"))
        try:
            for d in out:
                d.start(wait=False)
            for d in out:
                wait_serving(socket_address(d.socket), 300, d.proc)
        except BaseException:
            stop_all(out)
            raise
        return out


def stop_all(daemons: list[DaemonProcess]) -> None:
    for d in daemons:
        d.stop()


def stats(d: DaemonProcess) -> dict:
    with d.client() as c:
        return c.stats()


def build_at_once(bench: Bench, hosts: list[DaemonProcess]) -> dict:
    """Every host's agent asks for the whole zoo at the same moment; timed to the last one done."""
    go = threading.Barrier(len(hosts) + 1)
    done: dict[int, float] = {}
    failures: list = []

    def agent(i: int) -> None:
        with hosts[i].client() as c:
            go.wait()
            results = c.prefetch(bench.specs, load=False)
            failures.extend(r for r in results if isinstance(r, Exception))
            done[i] = time.perf_counter()

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(hosts))]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if failures or len(done) != len(hosts):
        raise RuntimeError(f"{len(failures)} kernels failed, {len(hosts) - len(done)} hosts did not finish: {failures[:3]}")
    every = [stats(d) for d in hosts]
    total = lambda name: sum(s[name] for s in every)  # noqa: E731
    return {
        "hosts": len(hosts),
        "wall_s": max(done.values()) - start,
        "compiles": total("compiles"),
        "compiles_per_host": [s["compiles"] for s in every],
        "remote_hits": total("remote_hits"),
        "remote_lease_waits": total("remote_lease_waits"),
        "remote_errors": total("remote_errors"),
        "remote_bytes_out": total("remote_bytes_out"),
        "remote_bytes_in": total("remote_bytes_in"),
        "compile_seconds_sum": round(total("compile_seconds"), 3),
    }


def mode_single(bench: Bench, redis_proc) -> dict:
    hosts = bench.daemons(1)
    try:
        return build_at_once(bench, hosts)
    finally:
        stop_all(hosts)


def mode_independent(bench: Bench, redis_proc) -> dict:
    hosts = bench.daemons(bench.args.hosts)
    try:
        return build_at_once(bench, hosts)
    finally:
        stop_all(hosts)


def mode_fleet(bench: Bench, redis_proc) -> dict:
    with redis_proc.admin() as r:
        r.flushall()
    hosts = bench.daemons(bench.args.hosts, "--remote", redis_proc.url())
    try:
        return build_at_once(bench, hosts)
    finally:
        stop_all(hosts)


def wait_shared(redis_proc, n: int, timeout: float = 120) -> None:
    """Until the tier holds n entries and no lease (the write-behind done)."""
    with redis_proc.admin() as r:
        deadline = time.monotonic() + timeout
        while len(r.keys("ks:entry:*")) < n or r.keys("ks:lease:*"):
            if time.monotonic() > deadline:
                raise RuntimeError("the builder's uploads did not reach the tier")
            time.sleep(0.05)


def mode_serve_only(bench: Bench, redis_proc) -> dict:
    with redis_proc.admin() as r:
        r.flushall()
    (builder,) = bench.daemons(1, "--remote", redis_proc.url())
    servers: list[DaemonProcess] = []
    try:
        keying = ("--cuda-compiler-id", stats(builder)["cuda_compiler"]) if bench.specs[0]["target"] != "c" else ()
        servers = bench.daemons(bench.args.hosts - 1, "--remote", redis_proc.url(), "--remote-read-only", "--no-compile", *keying)
        start = time.perf_counter()
        with builder.client() as c:  # what `kernel-service prewarm` sends a builder
            built = c.prefetch(bench.specs, load=False)
        build_s = time.perf_counter() - start
        failures = [r for r in built if isinstance(r, Exception)]
        if failures:
            raise RuntimeError(f"{len(failures)} kernels failed on the builder: {failures[:3]}")
        wait_shared(redis_proc, len(bench.specs))
        shared_s = time.perf_counter() - start

        go = threading.Barrier(len(servers) + 1)
        done: dict[int, float] = {}
        errors: list = []

        def strict_agent(i: int) -> None:
            with servers[i].client(strict=True) as c:
                go.wait()
                errors.extend(r for r in c.prefetch(bench.specs, load=False) if isinstance(r, Exception))
                done[i] = time.perf_counter()

        threads = [threading.Thread(target=strict_agent, args=(i,)) for i in range(len(servers))]
        for t in threads:
            t.start()
        go.wait()
        served_from = time.perf_counter()
        for t in threads:
            t.join()
        if errors or len(done) != len(servers):
            raise RuntimeError(f"strict agents got {len(errors)} errors: {errors[:3]}")
        serve_s = max(done.values()) - served_from
        every = [stats(d) for d in servers]
        b = stats(builder)
    finally:
        stop_all([builder, *servers])
    return {
        "hosts": len(servers) + 1,
        "serve_only_hosts": len(servers),
        "builder_build_s": build_s,
        "builder_shared_s": shared_s,
        "serve_wall_s": serve_s,
        "builder_compiles": b["compiles"],
        "serving_compiles": sum(s["compiles"] for s in every),
        "serving_remote_hits": sum(s["remote_hits"] for s in every),
        "serving_not_ready": sum(s["not_ready"] for s in every),
        "serving_remote_errors": sum(s["remote_errors"] for s in every),
        "serving_bytes_in": sum(s["remote_bytes_in"] for s in every),
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def mode_fetch(bench: Bench, redis_proc) -> dict:
    """Read-through times, after putting the zoo in the tier with one host."""
    from compile_service.metrics import Metrics
    from compile_service.store import LocalStore
    from compile_service.store.remote import RedisTier
    from compile_service.store.tiered import with_fleet_tier

    with redis_proc.admin() as r:
        r.flushall()
    (writer,) = bench.daemons(1, "--remote", redis_proc.url())
    try:
        with writer.client() as c:
            kernels = c.prefetch(bench.specs)
        keys = {k.key: k.spec for k in kernels}
        with redis_proc.admin() as r:
            deadline = time.monotonic() + 60
            while sum(r.exists(f"ks:entry:{k}") for k in keys) < len(keys):  # the write-behind
                if time.monotonic() > deadline:
                    raise RuntimeError("the writer's uploads did not reach the tier")
                time.sleep(0.05)
    finally:
        stop_all([writer])

    # The tier's read-through alone: a fresh local cache per round, every kernel fetched once.
    tier_ms: list[float] = []
    size = 0
    rounds = max(1, -(-bench.args.fetches // len(keys)))
    for i in range(rounds):
        metrics = Metrics()
        store = with_fleet_tier(LocalStore(bench.work / f"fetch-{i}", metrics=metrics), RedisTier(redis_proc.url(), metrics=metrics), metrics)
        try:
            for key, spec in keys.items():
                start = time.perf_counter()
                claim = store.claims.claim(key, spec, wake=lambda: None)
                tier_ms.append((time.perf_counter() - start) * 1000)
                if claim.entry is None:
                    raise RuntimeError(f"kernel {key[:16]} was not read through: {claim}")
            size = metrics.counters()["remote_bytes_in"] / len(keys)
        finally:
            store.close()
            shutil.rmtree(bench.work / f"fetch-{i}", ignore_errors=True)

    # End to end on a fresh host: one GetKernel at a time, each read through by the daemon.
    (fresh,) = bench.daemons(1, "--remote", redis_proc.url())
    rpc_ms: list[float] = []
    try:
        with fresh.client() as c:
            for spec in bench.specs:
                start = time.perf_counter()
                (outcome,) = c.prefetch([spec], load=False)
                rpc_ms.append((time.perf_counter() - start) * 1000)
                if isinstance(outcome, Exception):
                    raise outcome
        s = stats(fresh)
        if s["compiles"] or s["remote_hits"] != len(bench.specs):
            raise RuntimeError(f"the fresh host compiled {s['compiles']} and fetched {s['remote_hits']} of {len(bench.specs)} kernels")
    finally:
        stop_all([fresh])
    return {
        "samples": len(tier_ms),
        "bytes_per_kernel": round(size),
        "p50_ms": statistics.median(tier_ms),
        "p99_ms": _percentile(tier_ms, 0.99),
        "max_ms": max(tier_ms),
        "get_kernel_samples": len(rpc_ms),
        "get_kernel_p50_ms": statistics.median(rpc_ms),
        "get_kernel_max_ms": max(rpc_ms),
    }


def goals(modes: dict, kernels: int) -> dict:
    out = {}
    fleet, single, fetch = modes.get("fleet", {}), modes.get("single", {}), modes.get("fetch", {})
    if "compiles" in fleet:
        out["fleet_compiles_once"] = {"value": fleet["compiles"], "goal": kernels, "met": fleet["compiles"] == kernels}
    if "wall_s" in fleet and "wall_s" in single:
        ratio = fleet["wall_s"] / single["wall_s"]
        out["fleet_wall_vs_single"] = {"value": round(ratio, 3), "goal": "<= 1.2", "met": ratio <= 1.2}
    so = modes.get("serve_only", {})
    if "serving_compiles" in so:
        once = so["builder_compiles"] == kernels and so["serving_compiles"] == 0 and so["serving_remote_hits"] == kernels * so["serve_only_hosts"]
        out["serve_only_never_compile"] = {
            "value": f"builder {so['builder_compiles']}, serving hosts {so['serving_compiles']}",
            "goal": f"builder {kernels}, serving hosts 0",
            "met": once,
        }
    if "p50_ms" in fetch:
        out["fetch_p50_ms"] = {"value": round(fetch["p50_ms"], 2), "goal": "< 20", "met": fetch["p50_ms"] < 20}
    return out


def table(report: dict) -> str:
    modes = report["modes"]
    lines = ["| mode | hosts | wall s | compiles | notes |", "| --- | --- | --- | --- | --- |"]
    for name in ("single", "independent", "fleet"):
        m = modes.get(name)
        if not m or "error" in m:
            continue
        notes = f"per host {m['compiles_per_host']}"
        if name == "fleet":
            notes += f"; {m['remote_hits']} read through, {m['remote_lease_waits']} lease waits, {m['remote_errors']} errors"
        lines.append(f"| {name} | {m['hosts']} | {m['wall_s']:.2f} | {m['compiles']} | {notes} |")
    so = modes.get("serve_only")
    if so and "error" not in so:
        lines.append(
            f"\nserve_only: 1 builder + {so['serve_only_hosts']} serve-only hosts: the builder built {so['builder_compiles']} in {so['builder_build_s']:.2f} s "
            f"(all in the tier at {so['builder_shared_s']:.2f} s); strict agents on every serve-only host got them all in {so['serve_wall_s']:.2f} s "
            f"({so['serving_remote_hits']} read through, {so['serving_compiles']} compiles, {so['serving_not_ready']} not ready, "
            f"{so['serving_bytes_in'] / 2**20:.1f} MiB in)"
        )
    f = modes.get("fetch")
    if f and "error" not in f:
        lines.append(
            f"\nfetch from the tier ({f['bytes_per_kernel'] / 1024:.0f} KiB a kernel): p50 {f['p50_ms']:.2f} ms, p99 {f['p99_ms']:.2f} ms "
            f"({f['samples']} fetches); GetKernel on a fresh host: p50 {f['get_kernel_p50_ms']:.1f} ms, max {f['get_kernel_max_ms']:.1f} ms"
        )
    lines.append("")
    for name, g in report["goals"].items():
        lines.append(f"goal {name}: {g['value']} (goal {g['goal']}) {'met' if g['met'] else 'NOT MET'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4, help="simulated hosts (default 4)")
    p.add_argument("--target", default="c", help="target of the zoo's kernels (default c: CPU kernels, any machine)")
    p.add_argument("--quick", action="store_true", help="the 6-kernel quick zoo (benchmark/zoo.py) instead of --scale units of 42")
    p.add_argument("--scale", type=int, default=1, help=f"zoo scale units of {zoo.UNIT} kernels, without --quick (default 1)")
    p.add_argument("--workers", type=int, help="compile workers per host (default: each daemon's own, the CPU quota)")
    p.add_argument("--fetches", type=int, default=200, help="read-throughs timed in the fetch mode (default 200)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--work-dir", help="where caches and logs go (default: a new temp dir, removed unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        p.error(f"unknown mode(s) {', '.join(sorted(set(modes) - set(MODES)))}; choose from {', '.join(MODES)}")
    if args.hosts < 1 or args.scale < 1 or args.fetches < 1 or (args.workers is not None and args.workers < 1):
        p.error("--hosts, --scale, --fetches and --workers must be at least 1")
    if not redis_server.available():
        p.error("redis-server is not on PATH (Debian: apt-get install redis-server)")

    from compile_service.cpus import usable_cpus

    specs = zoo.build_zoo(args.target, args.scale, quick=args.quick)
    bench = Bench(args, specs)
    print(f"fleet: {len(specs)} kernels, target {specs[0]['target']}, {args.hosts} hosts; work dir {bench.work}", file=sys.stderr)
    results, failed = {}, []
    redis_proc = redis_server.RedisProcess(log_path=bench.work / "redis.log").start()
    try:
        for mode in sorted(modes, key=MODES.index):
            print(f"fleet: {mode}...", file=sys.stderr)
            try:
                results[mode] = globals()[f"mode_{mode}"](bench, redis_proc)
            except Exception as exc:  # one broken mode should not throw away the others' minutes
                print(f"mode {mode} failed: {exc}", file=sys.stderr)
                failed.append(mode)
                results[mode] = {"error": str(exc)[-2000:]}
    finally:
        redis_proc.stop()
        if not (args.keep or args.work_dir):
            shutil.rmtree(bench.work, ignore_errors=True)
    report = {
        "target": specs[0]["target"],
        "kernels": len(specs),
        "quick": args.quick,
        "hosts": args.hosts,
        "workers": args.workers,
        "cpu_quota": usable_cpus(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "modes": results,
    }
    report["goals"] = goals(results, len(specs))
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
