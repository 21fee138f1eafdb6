"""GetKernel under load: many client threads hammering a daemon with cache hits.

    python benchmark/hit_load.py                      # 32 threads, 50,000 hits, then the eviction run
    python benchmark/hit_load.py --requests 100000 --json out.json

Starts a daemon on a fresh cache (target "c"), builds a working set of small
CPU kernels, then runs two phases over the Unix socket, each with `--threads`
client threads (one channel each) issuing `--requests` GetKernel calls in total:

  hits   every request is a cache hit; reports throughput, p50/p99 latency, errors.
  evict  the daemon restarted on the same cache with --max-entries smaller than
         the working set and --evict-min-age 0: most requests go to a hot set,
         a few to cold kernels, which were evicted and compile again, evicting
         others meanwhile. Latency here includes those compiles.
  floor  the same client load against a gRPC server process that answers every
         GetKernel with one canned reply (a real hit's, recorded first) and does
         nothing else: what Python gRPC alone costs on this machine, side by side.
  direct the same hits as the client makes them: no RPC; the key computed from the
         fingerprint the daemon reports once, the entry found and its record
         checked on disk (client.loader.find_published), its directory's mtime
         set for eviction. The daemon's GetKernel counters must not move.
         `--direct-processes P` spreads the threads over P processes (agents are
         processes; one process measures its own GIL as much as the path).

Every answer is checked to be the kernel asked for (its canonical spec); every
`--check-every`-th answer's library is also read and verified like a loader
does (owner, mode, size, sha256). An entry evicted between the answer and the
check is counted apart ("gone"), not as wrong: with a min-age of 0 nothing
protects it, which is what --evict-min-age is for.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

import kernels  # noqa: E402
from client.api import spec_to_proto  # noqa: E402
from client.errors import CorruptArtifact  # noqa: E402
from client.loader import find_published, read_verified  # noqa: E402
from proto import keys  # noqa: E402
from devtools.launch import DaemonProcess  # noqa: E402
from proto.kernelservice.v1 import kernel_service_pb2 as pb  # noqa: E402
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc  # noqa: E402

KINDS = ("rmsnorm", "softmax", "swiglu")


def working_set(n: int, base: int) -> list[kernels.CanonicalSpec]:
    return [kernels.canonicalize(KINDS[i % 3], {"M": None, "N": base + 8 * i, "dtype": "float32"}, "c") for i in range(n)]


def _summary(lat: list[float], wall: float, requests: int, threads: int, tally: dict, errors: list) -> dict:
    lat = sorted(lat)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else float("nan")

    return {
        "requests": requests,
        "threads": threads,
        "seconds": round(wall, 3),
        "throughput_rps": round(requests / wall, 1),
        "p50_ms": round(pct(0.50), 3),
        "p99_ms": round(pct(0.99), 3),
        "max_ms": round(lat[-1] * 1e3, 3) if lat else None,
        **tally,
        "error_samples": errors[:5],
    }


def direct_hits(cache_root: str, fingerprint: dict, spec_jsons: list[str], threads: int, per_thread: list[int], check_every: int, start, out) -> None:
    """One process of the direct phase: `threads` threads finding entries on disk as the client does."""
    import random as random_

    expected = [json.loads(s) for s in spec_jsons]
    root = Path(cache_root)
    latencies: list[list[float]] = [[] for _ in range(threads)]
    tally = {"errors": 0, "wrong": 0, "checked": 0, "gone": 0}
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(threads + 1)

    def worker(t: int) -> None:
        rng = random_.Random(t)
        key_of: dict[str, str] = {}  # the client memoizes keys per spec
        mine, local = latencies[t], dict.fromkeys(tally, 0)
        barrier.wait()
        for n in range(per_thread[t]):
            i = rng.randrange(len(spec_jsons))
            t0 = time.perf_counter()
            text = spec_jsons[i]
            key = key_of.get(text)
            if key is None:
                key = key_of[text] = keys.cache_key(text, keys.toolchain(fingerprint, expected[i]["kind"], "c"))
            found = find_published(root, key, expected[i], os.getuid())
            if found is not None:
                try:
                    os.utime(found.path)
                except OSError:
                    found = None
            mine.append(time.perf_counter() - t0)
            if found is None:
                local["errors"] += 1
                with lock:
                    errors.append(f"no entry found for {text}")
            elif found.meta["spec"] != expected[i]:
                local["wrong"] += 1
            elif n % check_every == 0:
                try:
                    read_verified(found.path / found.library, found.library_sha256, found.library_size, owner=os.getuid())
                    local["checked"] += 1
                except CorruptArtifact as exc:
                    local["wrong"] += 1
                    with lock:
                        errors.append(f"wrong artifact: {exc}")
        with lock:
            for k, v in local.items():
                tally[k] += v

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    start.wait()  # every process starts together
    barrier.wait()
    for th in pool:
        th.join()
    out.put({"latencies": [x for part in latencies for x in part], "tally": tally, "errors": errors[:5]})


def run_direct(address: str, specs, threads: int, processes: int, requests: int, check_every: int) -> dict:
    with grpc.insecure_channel(address) as channel:  # the one RPC: what the client asks once
        info = pb_grpc.KernelServiceStub(channel).GetServiceInfo(pb.GetServiceInfoRequest(), timeout=30)
    fingerprint = json.loads(info.key_fingerprint_json)
    per_thread = [requests // threads + (i < requests % threads) for i in range(threads)]
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(processes + 1), ctx.Queue()
    share = [threads // processes + (p < threads % processes) for p in range(processes)]
    procs, first = [], 0
    for p in range(processes):
        mine = per_thread[first : first + share[p]]
        first += share[p]
        args = (info.cache_dir, fingerprint, [s.to_json() for s in specs], share[p], mine, check_every, start, out)
        procs.append(ctx.Process(target=direct_hits, args=args))
        procs[-1].start()
    start.wait()
    t0 = time.perf_counter()
    parts = [out.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for proc in procs:
        proc.join(30)
    tally = {k: sum(part["tally"][k] for part in parts) for k in parts[0]["tally"]}
    lat = [x for part in parts for x in part["latencies"]]
    result = _summary(lat, wall, requests, threads, tally, [e for part in parts for e in part["errors"]])
    result["processes"] = processes
    return result


def run_phase(address: str, specs, pick, threads: int, requests: int, check_every: int) -> dict:
    """`pick(rng)` chooses the index of the spec each request asks for."""
    requests_by_spec = [pb.GetKernelRequest(spec=spec_to_proto(s)) for s in specs]
    expected = [json.loads(s.to_json()) for s in specs]
    per_thread = [requests // threads + (i < requests % threads) for i in range(threads)]
    latencies: list[list[float]] = [[] for _ in range(threads)]
    tally = {"errors": 0, "wrong": 0, "checked": 0, "gone": 0}
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(threads + 1)

    def worker(t: int) -> None:
        rng = random.Random(t)
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.KernelServiceStub(channel)
        stub.GetServiceInfo(pb.GetServiceInfoRequest(), timeout=30)  # connect before timing
        mine = latencies[t]
        local = {"errors": 0, "wrong": 0, "checked": 0, "gone": 0}
        start.wait()
        for n in range(per_thread[t]):
            i = pick(rng)
            t0 = time.perf_counter()
            try:
                reply = stub.GetKernel(requests_by_spec[i], timeout=120)
            except grpc.RpcError as err:
                local["errors"] += 1
                with lock:
                    errors.append(f"{err.code().name}: {err.details()}")
                continue
            mine.append(time.perf_counter() - t0)
            a = reply.artifact
            if json.loads(a.canonical_spec) != expected[i]:
                local["wrong"] += 1
            elif n % check_every == 0:
                try:
                    read_verified(Path(a.entry_dir) / a.library, a.library_sha256, a.library_size, owner=os.getuid())
                    local["checked"] += 1
                except CorruptArtifact as exc:
                    gone = not (Path(a.entry_dir) / a.library).exists()
                    local["gone" if gone else "wrong"] += 1
                    if not gone:
                        with lock:
                            errors.append(f"wrong artifact: {exc}")
        channel.close()
        with lock:
            for k, v in local.items():
                tally[k] += v

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in pool:
        th.join()
    wall = time.perf_counter() - t0
    return _summary([x for part in latencies for x in part], wall, requests, threads, tally, errors)


class CannedServicer(pb_grpc.KernelServiceServicer):
    """Answers GetKernel with one recorded reply: a servicer with no work of its own."""

    def __init__(self, reply: bytes):
        self.reply = pb.GetKernelResponse.FromString(reply)

    def GetKernel(self, request, context):
        return self.reply

    def GetServiceInfo(self, request, context):
        return pb.ServiceInfo()


def serve_canned(socket: str, reply: bytes, ready) -> None:
    """The floor phase's server process: the daemon's gRPC setup (thread pool size, and nice 10
    for every thread, which yields the CPU to the load generator as it would to compiles)."""
    os.nice(10)  # before gRPC starts: its threads inherit it
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    pb_grpc.add_KernelServiceServicer_to_server(CannedServicer(reply), server)
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    ready.set()
    server.wait_for_termination()


def stats(address: str) -> dict:
    with grpc.insecure_channel(address) as channel:
        s = pb_grpc.KernelServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=30)
    return {name: getattr(s, name, 0) for name in ("hits", "misses", "invalid", "compiles", "evictions", "entries", "corrupt", "failures")}


def delta(before: dict, after: dict) -> dict:
    """Counters over the phase; `entries` as it stands at the end."""
    return {k: v if k == "entries" else v - before[k] for k, v in after.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--requests", type=int, default=50_000, help="GetKernel calls per phase (default 50000)")
    parser.add_argument("--kernels", type=int, default=8, help="working set of the hit phase (default 8)")
    parser.add_argument("--hot", type=int, default=6, help="eviction phase: hot kernels (default 6)")
    parser.add_argument("--cold", type=int, default=6, help="eviction phase: cold kernels, asked rarely (default 6)")
    parser.add_argument("--max-entries", type=int, default=8, help="eviction phase budget, below hot + cold (default 8)")
    parser.add_argument("--cold-fraction", type=float, default=0.002, help="eviction phase: share of requests for cold kernels (default 0.002)")
    parser.add_argument("--check-every", type=int, default=50, help="verify the library of every Nth answer per thread (default 50)")
    parser.add_argument("--no-evict", action="store_true", help="skip the eviction phase")
    parser.add_argument("--no-floor", action="store_true", help="skip the canned-reply gRPC floor phase")
    parser.add_argument(
        "--direct-processes",
        default="1,4",
        help="direct phase: processes the threads are spread over, a comma-separated list to run it once per count (default 1,4)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    if args.max_entries >= args.hot + args.cold:
        parser.error("--max-entries must be smaller than --hot + --cold for eviction to happen")

    results = {}
    with tempfile.TemporaryDirectory(prefix="hit-load-") as tmp:
        cache, socket = Path(tmp) / "cache", Path(tmp) / "ks.sock"
        address = f"unix:{socket}"

        daemon = DaemonProcess(cache, "--target", "c", socket=socket, workers=2).start()
        try:
            specs = working_set(args.kernels, 16)
            with grpc.insecure_channel(address) as channel:  # build the working set
                list(pb_grpc.KernelServiceStub(channel).Prefetch(pb.PrefetchRequest(specs=[spec_to_proto(s) for s in specs]), timeout=600))
            before = stats(address)
            results["hits"] = run_phase(address, specs, lambda rng: rng.randrange(len(specs)), args.threads, args.requests, args.check_every)
            results["hits"]["daemon"] = delta(before, stats(address))
            for count in [int(p) for p in args.direct_processes.split(",") if p.strip()]:
                before = stats(address)
                name = "direct" if count == 1 else f"direct_{count}p"
                results[name] = run_direct(address, specs, args.threads, count, args.requests, args.check_every)
                results[name]["daemon"] = delta(before, stats(address))  # hits and misses must not move: no GetKernel
            with grpc.insecure_channel(address) as channel:  # the floor's canned reply: a real hit
                reply = pb_grpc.KernelServiceStub(channel).GetKernel(pb.GetKernelRequest(spec=spec_to_proto(specs[0])), timeout=60)
        finally:
            daemon.stop()

        if not args.no_floor:
            floor_socket = Path(tmp) / "floor.sock"
            ctx = multiprocessing.get_context("spawn")
            ready = ctx.Event()
            server = ctx.Process(target=serve_canned, args=(str(floor_socket), reply.SerializeToString(), ready), daemon=True)
            server.start()
            try:
                if not ready.wait(60):
                    raise RuntimeError("the floor server did not start")
                results["floor"] = run_phase(f"unix:{floor_socket}", specs[:1], lambda rng: 0, args.threads, args.requests, args.check_every)
                results["floor"]["daemon"] = None
            finally:
                server.terminate()
                server.join(10)

        if not args.no_evict:
            hot, cold = working_set(args.hot, 16), working_set(args.cold, 16 + 8 * args.hot + 512)
            budget = ["--max-entries", str(args.max_entries), "--evict-min-age", "0"]
            daemon = DaemonProcess(cache, "--target", "c", *budget, socket=socket, workers=2).start()  # evicts the hit phase's leftovers at start
            try:
                both = hot + cold
                with grpc.insecure_channel(address) as channel:
                    list(pb_grpc.KernelServiceStub(channel).Prefetch(pb.PrefetchRequest(specs=[spec_to_proto(s) for s in hot]), timeout=600))
                before = stats(address)

                def pick(rng):
                    return len(hot) + rng.randrange(len(cold)) if rng.random() < args.cold_fraction else rng.randrange(len(hot))

                results["evict"] = run_phase(address, both, pick, args.threads, args.requests, args.check_every)
                results["evict"]["daemon"] = delta(before, stats(address))
                results["evict"]["budget"] = {"max_entries": args.max_entries, "evict_min_age": 0, "working_set": len(both)}
            finally:
                daemon.stop()

    cols = ("requests", "threads", "seconds", "throughput_rps", "p50_ms", "p99_ms", "max_ms", "errors", "wrong", "checked", "gone")
    print(f"{'phase':<10} " + " ".join(f"{c:>14}" for c in cols) + "   daemon")
    for phase, r in results.items():
        d = r["daemon"]
        counters = f"compiles={d['compiles']} evictions={d['evictions']} hits={d['hits']} entries={d['entries']}" if d else "(no daemon: canned replies)"
        print(f"{phase:<10} " + " ".join(f"{r[c]!s:>14}" for c in cols) + f"   {counters}")
        for sample in r["error_samples"]:
            print(f"       error: {sample}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 1 if any(r["errors"] or r["wrong"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
