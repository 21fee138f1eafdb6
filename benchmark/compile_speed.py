"""Cold-build throughput, stampede and warm start: TileLang alone vs the kernel service.

    python benchmark/compile_speed.py [--target sm_90a|auto|c] [--scale 3] [--salt 0]
        [--workers N] [--processes 4] [--modes service,tilelang,...] [--quick]
        [--backend auto|nvcc|nvrtc|nvcc,nvrtc] [--json out.json] [--plot out.png] [--work-dir DIR]

Every mode builds the same zoo (benchmark/zoo.py: 42 kernels per scale unit)
on a fresh cache directory:

  baseline            pre-fix TileLang: min(32, cpu+4) threads calling
                      tilelang.compile, one process-wide lock around every
                      cache save
  tilelang            tilelang.par_compile as shipped in 0.1.15
  service             a fresh daemon; the zoo prefetched through the client
  service_under_load  the same, while 8 client threads hammer the daemon with
                      GetKernel of an already-built kernel
  stampede_tilelang   P agent processes start together, each par_compiles the
                      whole zoo into one shared TILELANG_CACHE_DIR
  stampede_service    the same P processes ask one fresh daemon instead
  warm_tilelang       a fresh process gets every kernel from a warm TileLang
                      disk cache (import tilelang, trace, tilelang.compile)
  warm_service        a fresh process gets every kernel from a warm daemon
                      (import client, get_kernel)
  from_serve          a fresh daemon started now, the zoo prefetched as soon as
                      it says SERVING: seconds from `serve` to SERVING, to the
                      first kernel and to all of them, its workers' start and
                      warm-up included (tilelang's own first/all figures count
                      from its process's start, `import tilelang` included)
  layer               a Llama-3-8B layer's 7 kernels (zoo.llama_layer: four
                      M=None GEMMs, rmsnorm, swiglu, causal attention) from a
                      fresh cache, the daemon up and warm, asked by a fresh
                      agent one get_kernel after another, then (another fresh
                      daemon) in one prefetch
  layer_from_serve    the same layer, one by one, the daemon started with the
                      agent: from the launch to the whole layer

--backend picks the daemon's CUDA device compiler (`serve --cuda-compiler`);
with several, every service mode runs once per backend, named `service:nvcc`,
`service:nvrtc` and so on, in the same run. TileLang modes always use nvcc,
TileLang's default.

Note on CUDA targets: zoo kernels that differ only in M share their device
code (M only sizes the grid). TileLang 0.1.15 and the daemon's workers both
keep device binaries keyed by device source, so the device compiler runs once
per distinct source; `device_compiles` in the results counts those runs. The
daemon goes further: on sm_90+ it serves every static M and N of one GEMM (K,
tiling), and every seq_len of one causal attention config, from the build that
leaves them to run time, so it lowers each once (54 builds and 90 copies,
counted as `derived`, for the 126-kernel zoo). So `compile_s_per_kernel` is
the builds' seconds over the zoo's kernels, `median_build_s` the median of the
builds it ran, `median_compile_s` the median over the zoo's kernels (copies
take milliseconds).

TileLang modes and agents run in child processes of this script (`_child`
role), so every one pays its own imports and starts with empty in-memory
caches, like a real agent. The parent never imports TileLang.

Cold walls exclude the import of TileLang (baseline, tilelang) and the start
of the daemon and its workers' warm-up (a sidecar is up before agents come:
`service` waits for every worker to be ready); both are reported apart, and
`from_serve` counts them. For the service's cold builds, `idle_s` says where
the workers' time went besides building, from each build's worker, start and
end (entry.json): `ramp` before a worker's first build, `between` its builds
(dispatch and publishing), `tail` after its last one until the batch ended.
Stampede walls include everything, from spawning the agents to the last one
holding every kernel; stampede_service also reports `build_wall_s`, from the
first agent's request to the last agent holding every kernel, which the goal
compares with one cold build (the agents' own start, importing torch and
making a CUDA context, is not the daemon's work). Warm times are measured inside the fresh process, from
its start (the parent's clock just before spawning it) and from after its
imports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import zoo  # noqa: E402
from devtools.launch import DaemonProcess  # noqa: E402  (benchmark/zoo.py, next to this file)

COLD_MODES = ("baseline", "tilelang", "service")
MODES = (
    "baseline",
    "tilelang",
    "service",
    "from_serve",
    "layer",
    "layer_from_serve",
    "stampede_tilelang",
    "stampede_service",
    "warm_tilelang",
    "warm_service",
    "service_under_load",
)
LOAD_THREADS = 8


# ----------------------------------------------------------------------------
# Child roles: each runs in a fresh process, prints "@" per kernel done and a
# final JSON line {"result": ...} on stdout; anything else goes to its log.


def _tilelang_setup():
    """Imports TileLang quietly and counts disk-cache misses (= compiles) and hits."""
    import logging

    import tilelang
    from tilelang.cache.kernel_cache import KernelCache

    logging.getLogger("tilelang").setLevel(logging.WARNING)
    counts = {"compiled": 0, "loaded": 0}
    lock = threading.Lock()
    load, cached = KernelCache._load_kernel_from_disk, KernelCache.cached

    # TileLang compiles exactly when its disk lookup misses.
    def counting_load(self, *args, **kwargs):
        kernel = load(self, *args, **kwargs)
        with lock:
            counts["compiled" if kernel is None else "loaded"] += 1
        return kernel

    # Every tilelang.compile (par_compile's too) goes through cached(): one progress tick each.
    def ticking_cached(self, *args, **kwargs):
        kernel = cached(self, *args, **kwargs)
        _tick()
        return kernel

    KernelCache._load_kernel_from_disk = counting_load
    KernelCache.cached = ticking_cached
    return tilelang, KernelCache, counts


def _trace(spec):
    """The PrimFunc and TileLang target of a zoo spec: what an agent using TileLang directly must do."""
    import kernels

    canon = kernels.canonicalize(spec["kind"], zoo.params_of(spec), spec["target"])
    return kernels.get_kind(spec["kind"]).build(dict(canon.params), canon.target), canon.target.tilelang_target()


def _tick():
    print("@", flush=True)


def child_tilelang_cold(specs, variant):
    """baseline / tilelang / one stampede_tilelang agent."""
    t_start = time.perf_counter()
    tilelang, KernelCache, counts = _tilelang_setup()
    import_s = time.perf_counter() - t_start
    start = time.perf_counter()
    traced = [_trace(s) for s in specs]
    if variant == "baseline":
        import concurrent.futures as cf

        # The pre-fix cache: every save serialized behind one process-wide lock.
        save, save_lock = KernelCache._save_kernel_to_disk, threading.Lock()

        def locked_save(self, *args, **kwargs):
            with save_lock:
                return save(self, *args, **kwargs)

        KernelCache._save_kernel_to_disk = locked_save
        workers = min(32, (os.cpu_count() or 1) + 4)  # the stdlib default it used
        with cf.ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(tilelang.compile, func, target=target) for func, target in traced]
            for f in futures:
                f.result()
    else:
        from tilelang.utils.device import get_available_cpu_count  # what par_compile sizes its pool by

        workers = min(len(specs), get_available_cpu_count())
        # par_compile takes one target for all funcs; group by target (one group in practice).
        by_target = {}
        for func, target in traced:
            by_target.setdefault(json.dumps(target, sort_keys=True), []).append(func)
        for target, funcs in by_target.items():
            tilelang.par_compile(funcs, target=json.loads(target))
    return {"wall_s": time.perf_counter() - start, "import_s": import_s, "workers": workers, "kernels": len(specs), **counts}


def child_tilelang_warm(specs, t0):
    _agent_preamble()
    t_import = time.perf_counter()
    tilelang, _, counts = _tilelang_setup()
    import kernels  # noqa: F401

    after_import = time.time()
    import_s = time.perf_counter() - t_import
    first = None
    got = 0
    for spec in specs:
        func, target = _trace(spec)
        kernel = tilelang.compile(func, target=target)
        got += callable(kernel)
        first = first or time.time()
    done = time.time()
    return _warm_result(t0, after_import, first, done, import_s, got, counts["compiled"])


def _agent_preamble():
    """What an inference agent already holds before it asks for kernels: torch, and on
    a GPU host a CUDA context. Done first in every agent, outside the import times."""
    import torch

    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")


def child_service_agent(specs, socket, t0, one_by_one):
    """One stampede_service agent (prefetch the whole zoo) or the warm_service process (get_kernel each)."""
    _agent_preamble()
    t_import = time.perf_counter()
    import client

    after_import = time.time()
    import_s = time.perf_counter() - t_import
    c = client.connect(socket)
    first = None
    got = 0
    if one_by_one:
        for spec in specs:
            kernel = c.get_kernel(spec["kind"], target=spec["target"], **zoo.params_of(spec))
            got += callable(kernel)
            first = first or time.time()
            _tick()
    else:

        def progress(done, total, event):
            nonlocal first
            first = first or time.time()
            _tick()

        results = c.prefetch(specs, progress=progress)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise RuntimeError(f"{len(errors)} kernels failed; first: {errors[0]}")
        got = sum(callable(r) for r in results)
    done = time.time()
    outcomes = {}
    for kernel in c._memo.values():  # the client memoizes what it loaded; outcome says how it was served
        outcomes[kernel.outcome] = outcomes.get(kernel.outcome, 0) + 1
    result = _warm_result(t0, after_import, first, done, import_s, got, outcomes.get("compiled", 0))
    return {**result, "outcomes": outcomes, "asked_at": after_import, "done_at": done}


def _warm_result(t0, after_import, first, done, import_s, got, compiled):
    return {
        "wall_s": done - t0,
        "first_s": first - t0,
        "all_s": done - t0,
        "import_s": import_s,
        "first_after_import_s": first - after_import,
        "all_after_import_s": done - after_import,
        "kernels": got,
        "compiled": compiled,
    }


def child_hammer(spec, socket, threads):
    """GetKernel of one built kernel in a loop on `threads` threads, raw RPCs (the client's
    memo would answer repeats without asking the daemon), until stdin closes."""
    import grpc

    import client.api as api
    import kernels
    from proto.kernelservice.v1 import kernel_service_pb2 as pb
    from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc

    request = pb.GetKernelRequest(spec=api.spec_to_proto(kernels.canonicalize(spec["kind"], zoo.params_of(spec), spec["target"])))
    stop = threading.Event()
    counts = [0] * threads
    errors = []

    def loop(i):
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            stub = pb_grpc.KernelServiceStub(channel)
            while not stop.is_set():
                try:
                    stub.GetKernel(request, timeout=60)
                    counts[i] += 1
                except grpc.RpcError as exc:
                    errors.append(str(exc.code()))
                    stop.set()

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    while sum(counts) < threads and not stop.is_set():
        time.sleep(0.01)
    print("ready", flush=True)
    sys.stdin.read()  # the parent closes our stdin when its measurement is over
    stop.set()
    for t in workers:
        t.join()
    wall = time.perf_counter() - start
    return {"requests": sum(counts), "requests_per_s": sum(counts) / wall, "errors": errors[:3]}


def child_main(argv):
    p = argparse.ArgumentParser(prog="compile_speed.py _child")
    p.add_argument("role", choices=("tilelang_cold", "tilelang_warm", "service_agent", "hammer"))
    p.add_argument("--specs", required=True)
    p.add_argument("--variant", default="tilelang")
    p.add_argument("--socket")
    p.add_argument("--t0", type=float, default=None)
    p.add_argument("--one-by-one", action="store_true")
    p.add_argument("--threads", type=int, default=LOAD_THREADS)
    a = p.parse_args(argv)
    specs = json.loads(Path(a.specs).read_text())
    t0 = a.t0 or time.time()
    if a.role == "tilelang_cold":
        result = child_tilelang_cold(specs, a.variant)
    elif a.role == "tilelang_warm":
        result = child_tilelang_warm(specs, t0)
    elif a.role == "service_agent":
        result = child_service_agent(specs, a.socket, t0, a.one_by_one)
    else:
        result = child_hammer(specs[0], a.socket, a.threads)
    print(json.dumps({"result": result}), flush=True)


# ----------------------------------------------------------------------------
# The parent: progress, children, daemons.


class Progress:
    """One line per mode on stderr: tqdm when installed, else plain lines every ~10%."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.n, self.lock = name, total, 0, threading.Lock()
        self.start = time.perf_counter()
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"{name:>18}", unit="kernel", file=sys.stderr, leave=True, dynamic_ncols=True)
        except ImportError:
            self.bar = None
            print(f"[{name}] 0/{total}", file=sys.stderr, flush=True)

    def update(self, n: int = 1):
        with self.lock:
            self.n += n
            if self.bar is not None:
                self.bar.update(n)
            elif self.n == self.total or self.n * 10 // self.total != (self.n - n) * 10 // self.total:
                print(f"[{self.name}] {self.n}/{self.total} ({time.perf_counter() - self.start:.1f}s)", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


class Child:
    """This script in `_child` mode, in a fresh process; stderr goes to a log file."""

    def __init__(self, run: Run, role: str, specs: list, env: dict | None = None, stdin=None, progress: Progress | None = None, **flags):
        self.log = run.work / f"{role}-{next(run.seq)}.log"
        spec_file = self.log.with_suffix(".specs.json")
        spec_file.write_text(json.dumps(specs))
        args = [sys.executable, str(Path(__file__).resolve()), "_child", role, "--specs", str(spec_file)]
        for name, value in flags.items():
            if value is True:
                args.append(f"--{name.replace('_', '-')}")
            elif value not in (None, False):
                args += [f"--{name.replace('_', '-')}", str(value)]
        self.progress, self.result, self.ready = progress, None, threading.Event()
        self.first_tick: float | None = None  # perf_counter of its first finished kernel
        self._log_file = open(self.log, "w")
        self.spawned = time.perf_counter()
        self.proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **(env or {})}, stdin=stdin, stdout=subprocess.PIPE, stderr=self._log_file, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("@"):
                self.first_tick = self.first_tick or time.perf_counter()
                if self.progress:
                    self.progress.update()
            elif line.startswith("ready"):
                self.ready.set()
            elif line.startswith('{"result"'):
                self.result = json.loads(line)["result"]

    def wait(self) -> dict:
        rc = self.proc.wait()
        self.ended = time.perf_counter()
        self._reader.join()
        self._log_file.close()
        if rc != 0 or self.result is None:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"child {self.log.stem} exited with status {rc}; the end of {self.log}:\n{tail}")
        return self.result


class Daemon(DaemonProcess):
    """A fresh `kernel-service serve`, started before timing (a sidecar is up before agents):
    `startup_s` until it said SERVING, `ready_s` until every worker had warmed up (waited
    for unless `ready=False`)."""

    def __init__(self, run: Run, cache_dir: Path, ready: bool = True):
        flags = ["--target", run.target, "--cuda-compiler", run.backend, *(["--workers", str(run.workers)] if run.workers else [])]
        super().__init__(cache_dir, *flags, log_path=run.work / f"daemon-{next(run.seq)}.log")
        self.launched = time.perf_counter()
        self.start()
        self.startup_s = time.perf_counter() - self.launched
        self.rpc = self.client()
        self.ready_s = self.wait_ready() if ready else None

    def wait_ready(self, timeout: float = 600) -> float:
        while (stats := self.rpc.stats())["workers_ready"] < stats["workers"]:
            if time.perf_counter() - self.launched > timeout:
                raise RuntimeError(f"workers not ready after {timeout:.0f}s; see {self.log_path}")
            time.sleep(0.05)
        return time.perf_counter() - self.launched


class Run:
    """What every mode shares: the zoo, the flags, a work directory, and the warm caches left by cold modes."""

    def __init__(self, args, specs: list):
        self.specs, self.target, self.workers, self.processes = specs, specs[0]["target"], args.workers, args.processes
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="compile-speed-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.seq = iter(range(1, 1 << 30))
        self.warm = {}  # "tilelang" / "service" / "service:nvrtc" -> a cache dir holding the whole zoo
        self.backend, self.suffix = "auto", ""  # the service modes' CUDA compiler, and ":name" when several run
        self.builds = _builds_needed(specs)  # (builds, copies) the daemon makes for the zoo
        self.layer = zoo.llama_layer(self.target)  # the layer modes' kernels

    def fresh_dir(self, name: str) -> Path:
        path = self.work / f"{name}-{next(self.seq)}"
        path.mkdir()
        return path


def _builds_needed(specs: list) -> tuple[int, int]:
    """How many builds the daemon runs for `specs`, and how many copies of a shared build it
    publishes: specs served by one shared build (KernelKind.shared_build) count it once."""
    import kernels

    builds, copies = set(), 0
    for s in specs:
        spec = kernels.canonicalize(s["kind"], zoo.params_of(s), s["target"])
        shared = kernels.get_kind(spec.kind).shared_build(spec)
        builds.add((shared[0] if shared else spec).to_json())
        copies += shared is not None
    return len(builds), copies


def _check_built(name: str, results: list) -> int:
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} of {len(results)} kernels failed; first: {errors[0]}")
    return len(results)


# ----------------------------------------------------------------------------
# The modes: each returns {wall_s, compiles, kernels, ...}.


def _device_compiles(binary_cache: Path) -> int:
    """Device binaries in a TileLang CUDA binary cache (keyed by device source): how many
    times the device compiler really ran. Zoo kernels that differ only in M share device
    code (M sizes the grid), so it runs fewer times than kernels are compiled."""
    return sum(1 for p in binary_cache.glob("*/cuda-binaries/*") if not p.parts[-3].startswith(".") and not p.name.startswith("."))


def _service_device_compiles(cache: Path) -> int:
    return sum(_device_compiles(d) for d in cache.glob("device-binaries/*"))


def _tilelang_cold(run: Run, name: str, variant: str) -> dict:
    cache = run.fresh_dir(name)
    progress = Progress(name, len(run.specs))
    try:
        child = Child(run, "tilelang_cold", run.specs, env={"TILELANG_CACHE_DIR": str(cache)}, progress=progress, variant=variant)
        r = child.wait()
    finally:
        progress.close()
    run.warm.setdefault("tilelang", cache)
    return {
        "wall_s": r["wall_s"],
        "compiles": r["compiled"],
        "kernels": r["kernels"],
        "workers": r["workers"],
        "import_s": r["import_s"],
        "device_compiles": _device_compiles(cache),
        # From the process's start, `import tilelang` included: the comparison for from_serve.
        "first_from_start_s": child.first_tick - child.spawned if child.first_tick else None,
        "all_from_start_s": child.ended - child.spawned,
    }


def mode_baseline(run: Run) -> dict:
    return _tilelang_cold(run, "baseline", "baseline")


def mode_tilelang(run: Run) -> dict:
    return _tilelang_cold(run, "tilelang", "tilelang")


def _median(values: list) -> float | None:
    return statistics.median(values) if values else None


def _builds(cache: Path) -> dict:
    """Over the builds the daemon ran (its entries less the copies of a shared build): the
    median seconds, overall and per kind, and the summed phases (trace, lower, device, link)."""
    metas = [json.loads(p.read_text()) for p in cache.glob("entries/*/*/entry.json")]
    builds = [m for m in metas if "shared_build" not in m]
    sums = {}
    for m in builds:
        for phase, seconds in m.get("phases", {}).items():
            sums[phase] = sums.get(phase, 0.0) + seconds
    kinds = sorted({m["spec"]["kind"] for m in builds})
    return {
        "build_seconds_sum": sum(m["compile_seconds"] for m in builds),
        "median_build_s": _median([m["compile_seconds"] for m in builds]),
        "median_build_s_by_kind": {k: _median([m["compile_seconds"] for m in builds if m["spec"]["kind"] == k]) for k in kinds},
        "phase_seconds_sum": sums,
    }


def _idle(cache: Path, began: float, ended: float) -> dict:
    """Where the workers' time went besides building, summed over workers (wall seconds, from
    the builds' worker, start and end): before each worker's first build (`ramp`), between its
    builds (`between`: dispatch, publishing), after its last until the batch ended (`tail`)."""
    by_worker: dict[int, list[tuple[float, float]]] = {}
    for p in cache.glob("entries/*/*/entry.json"):
        m = json.loads(p.read_text())
        if "shared_build" not in m and "worker" in m:
            by_worker.setdefault(m["worker"], []).append((m["created"] - m["compile_seconds"], m["created"]))
    idle = {"ramp": 0.0, "between": 0.0, "tail": 0.0, "workers_used": len(by_worker)}
    for builds in by_worker.values():
        builds.sort()
        idle["ramp"] += max(0.0, builds[0][0] - began)
        idle["between"] += sum(max(0.0, b[0] - a[1]) for a, b in zip(builds, builds[1:]))
        idle["tail"] += max(0.0, ended - builds[-1][1])
    return {k: round(v, 3) for k, v in idle.items()}


def _service_cold(run: Run, name: str, daemon: Daemon, t0: float | None = None) -> dict:
    """Prefetches the zoo from `daemon` (whose cache holds none of it) and times it; with `t0`
    (a perf_counter before the daemon was launched), also the first and last kernel from it."""
    progress = Progress(name, len(run.specs))
    seconds, times = [], []

    def on_event(done, total, event):
        seconds.append(event["kernel"]["compile_seconds"])
        times.append(time.perf_counter())
        progress.update()

    before = daemon.rpc.stats()
    began = time.time()
    start = time.perf_counter()
    try:
        results = daemon.rpc.prefetch(run.specs, progress=on_event, load=False)
    finally:
        progress.close()
    wall = time.perf_counter() - start
    idle = _idle(daemon.cache_dir, began, time.time())
    after = daemon.rpc.stats()
    workers = after["workers"]
    builds = _builds(daemon.cache_dir)
    return {
        "wall_s": wall,
        "compiles": after["compiles"] - before["compiles"],
        "derived": after["derived"] - before["derived"],
        "kernels": _check_built(name, results),
        "workers": workers,
        "startup_s": daemon.startup_s,
        "ready_s": daemon.ready_s,
        "idle_s": idle,
        **({"first_from_start_s": times[0] - t0, "all_from_start_s": times[-1] - t0} if t0 is not None and times else {}),
        "cuda_compiler": after["cuda_compiler"],
        "median_compile_s": _median([s for s in seconds if s > 0]),  # per zoo kernel: a copy's milliseconds count
        "device_compile_seconds_sum": after["device_compile_seconds"] - before["device_compile_seconds"],
        "device_compiles": _service_device_compiles(daemon.cache_dir),
        **builds,
        # 1.0 means every worker compiled all the time; start-up, queueing and request handling lower it.
        "parallel_efficiency": builds["build_seconds_sum"] / (workers * wall),
        "compile_s_per_kernel": builds["build_seconds_sum"] / len(results),
    }


def mode_service(run: Run) -> dict:
    cache = run.fresh_dir("service")
    with Daemon(run, cache) as daemon:
        result = _service_cold(run, "service" + run.suffix, daemon)
    run.warm.setdefault("service" + run.suffix, cache)
    return result


def mode_from_serve(run: Run) -> dict:
    """`serve` on a fresh cache, the zoo asked for as soon as it says SERVING: from the launch
    to SERVING (startup_s), to the first kernel and to all of them, warm-up in the background."""
    t0 = time.perf_counter()
    with Daemon(run, run.fresh_dir("from_serve"), ready=False) as daemon:
        result = _service_cold(run, "from_serve" + run.suffix, daemon, t0)
        result["ready_s"] = daemon.wait_ready()
    return result


def mode_service_under_load(run: Run) -> dict:
    with Daemon(run, run.fresh_dir("service_under_load")) as daemon:
        # The hot kernel: a zoo shape with rows no zoo kernel has (zoo rows start at 256).
        hot = {**run.specs[0], ("seq_len" if run.specs[0]["kind"] == "attention" else "M"): 128}
        daemon.rpc.get_kernel(hot["kind"], target=hot["target"], **zoo.params_of(hot))
        hammer = Child(run, "hammer", [hot], stdin=subprocess.PIPE, socket=daemon.socket, threads=LOAD_THREADS)
        try:
            if not hammer.ready.wait(120):
                raise RuntimeError(f"the hammer never got a hit; see {hammer.log}")
            result = _service_cold(run, "service_under_load" + run.suffix, daemon)
        finally:
            hammer.proc.stdin.close()
            load = hammer.wait()
    if load["errors"]:
        raise RuntimeError(f"hit requests failed during the cold build: {load['errors']}")
    return {**result, "load_threads": LOAD_THREADS, "hit_requests": load["requests"], "hit_requests_per_s": load["requests_per_s"]}


def _stampede(run: Run, name: str, make_agent) -> dict:
    """P agents spawned together; wall from the first spawn to the last agent holding every kernel."""
    progress = Progress(f"{name} x{run.processes}", run.processes * len(run.specs))
    start = time.perf_counter()
    agents = []
    try:
        agents = [make_agent(progress) for _ in range(run.processes)]
        results = [a.wait() for a in agents]
    finally:
        progress.close()
        for a in agents:  # after a failure, leave no agent behind
            if a.proc.poll() is None:
                a.proc.kill()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "kernels": min(r["kernels"] for r in results), "per_process": results}


def mode_stampede_tilelang(run: Run) -> dict:
    cache = run.fresh_dir("stampede_tilelang")
    env = {"TILELANG_CACHE_DIR": str(cache)}
    r = _stampede(run, "stampede_tilelang", lambda progress: Child(run, "tilelang_cold", run.specs, env=env, progress=progress, variant="tilelang"))
    r["device_compiles"] = _device_compiles(cache)  # at least; a binary two agents built at once is kept once
    r["per_process"] = [{"compiled": p["compiled"], "loaded": p["loaded"], "wall_s": p["wall_s"], "import_s": p["import_s"]} for p in r["per_process"]]
    return {**r, "compiles": sum(p["compiled"] for p in r["per_process"])}


def mode_stampede_service(run: Run) -> dict:
    with Daemon(run, run.fresh_dir("stampede_service")) as daemon:
        r = _stampede(run, "stampede_service" + run.suffix, lambda progress: Child(run, "service_agent", run.specs, progress=progress, socket=daemon.socket))
        stats = daemon.rpc.stats()
    # From the first agent's request to the last agent holding every kernel: what the
    # cold `service` wall measures too (the agents' own start-up, torch and a CUDA context, is not the daemon's).
    r["build_wall_s"] = max(p["done_at"] for p in r["per_process"]) - min(p["asked_at"] for p in r["per_process"])
    r["per_process"] = [{"outcomes": p["outcomes"], "wall_s": p["all_s"], "import_s": p["import_s"]} for p in r["per_process"]]
    return {
        **r,
        "compiles": stats["compiles"],
        "derived": stats["derived"],
        "builds_needed": run.builds,
        "joined": stats["joined"],
        "startup_s": daemon.startup_s,
    }


def _warm(run: Run, name: str, role: str, **flags) -> dict:
    progress = Progress(name, len(run.specs))
    try:
        r = Child(run, role, run.specs, progress=progress, t0=repr(time.time()), **flags).wait()
    finally:
        progress.close()
    return {**r, "compiles": r.pop("compiled")}


def mode_warm_tilelang(run: Run) -> dict:
    if "tilelang" not in run.warm:  # no cold TileLang mode ran: fill a cache first, untimed
        mode_tilelang(run)
    return _warm(run, "warm_tilelang", "tilelang_warm", env={"TILELANG_CACHE_DIR": str(run.warm["tilelang"])})


def mode_warm_service(run: Run) -> dict:
    if "service" + run.suffix not in run.warm:
        mode_service(run)
    with Daemon(run, run.warm["service" + run.suffix]) as daemon:
        return {**_warm(run, "warm_service" + run.suffix, "service_agent", socket=daemon.socket, one_by_one=True), "startup_s": daemon.startup_s}


def _layer_agent(run: Run, name: str, daemon: Daemon, t0: float, one_by_one: bool) -> dict:
    """A fresh agent process asks `daemon` for the Llama layer's kernels; times from `t0` (wall)."""
    progress = Progress(name, len(run.layer))
    try:
        r = Child(run, "service_agent", run.layer, progress=progress, socket=daemon.socket, t0=repr(t0), one_by_one=one_by_one).wait()
    finally:
        progress.close()
    stats = daemon.rpc.stats()
    return {**r, "compiles": stats["compiles"], "derived": stats["derived"]}


def mode_layer(run: Run) -> dict:
    """The Llama-3-8B layer (zoo.llama_layer) from a fresh cache, the daemon up and warm, as an
    agent asks for it: one get_kernel after another (wall_s, from the first request), and, from
    another fresh daemon, in one prefetch (prefetch_s)."""
    with Daemon(run, run.fresh_dir("layer")) as daemon:
        one = _layer_agent(run, "layer" + run.suffix, daemon, time.time(), one_by_one=True)
    with Daemon(run, run.fresh_dir("layer")) as daemon:
        batch = _layer_agent(run, "layer_prefetch" + run.suffix, daemon, time.time(), one_by_one=False)
    return {
        "wall_s": one["all_after_import_s"],
        "prefetch_s": batch["all_after_import_s"],
        "kernels": one["kernels"],
        "compiles": one["compiles"],
        "derived": one["derived"],
        "startup_s": daemon.startup_s,
        "ready_s": daemon.ready_s,
    }


def mode_layer_from_serve(run: Run) -> dict:
    """`serve` on a fresh cache and an agent started with it, asking for the layer one kernel
    after another: wall_s from the launch to the agent holding the whole layer."""
    t0 = time.time()
    with Daemon(run, run.fresh_dir("layer_from_serve"), ready=False) as daemon:
        r = _layer_agent(run, "layer_from_serve" + run.suffix, daemon, t0, one_by_one=True)
    return {**r, "wall_s": r["all_s"], "startup_s": daemon.startup_s}


# ----------------------------------------------------------------------------
# Report.


SERVICE_MODES = ("service", "from_serve", "layer", "layer_from_serve", "service_under_load", "stampede_service", "warm_service")
NVRTC_PER_KERNEL_GOAL_S, NVRTC_WALL_GOAL_S = 0.5, 6.0  # issue 7, for the 126-kernel zoo on the 16-core H200 host


def goals(modes: dict, suffixes=("",)) -> dict:
    """The targets this benchmark exists to check, as measured (None: a needed mode did not run).
    With several backends, each service goal is checked per backend (`suffix` ":nvrtc")."""

    def get(mode, field):
        return modes.get(mode, {}).get(field)

    out = {}
    for sx in suffixes:
        service = "service" + sx
        if get(service, "wall_s") and get("tilelang", "wall_s"):
            ratio = get("tilelang", "wall_s") / get(service, "wall_s")
            out[f"{service}_vs_tilelang_speedup"] = {"value": ratio, "goal": ">= 1.0", "met": ratio >= 1.0}
        if get(service, "parallel_efficiency") is not None:
            eff = get(service, "parallel_efficiency")
            out[f"{service}_parallel_efficiency"] = {"value": eff, "goal": ">= 0.9", "met": eff >= 0.9}
        if get(service, "cuda_compiler") and get(service, "cuda_compiler").startswith("nvrtc") and get(service, "compile_s_per_kernel") is not None:
            # Per kernel, the build seconds spread over the kernels they served: a copy of a shared
            # build (median_compile_s counts its milliseconds) must not make the goal trivial.
            per_kernel, wall = get(service, "compile_s_per_kernel"), get(service, "wall_s")
            out[f"{service}_compile_s_per_kernel"] = {
                "value": per_kernel,
                "goal": f"<= {NVRTC_PER_KERNEL_GOAL_S}",
                "met": per_kernel <= NVRTC_PER_KERNEL_GOAL_S,
            }
            if get(service, "kernels") == 126 and get(service, "workers") >= 16:  # the goal's setting
                out[f"{service}_cold_wall_s"] = {"value": wall, "goal": f"< {NVRTC_WALL_GOAL_S} (126 kernels, 16 cores)", "met": wall < NVRTC_WALL_GOAL_S}
        serve = "from_serve" + sx
        if get(serve, "startup_s") is not None:
            out[f"{serve}_serving_s"] = {"value": get(serve, "startup_s"), "goal": "< 1.0", "met": get(serve, "startup_s") < 1.0}
        stampede = "stampede_service" + sx
        if get(stampede, "wall_s"):
            st = modes[stampede]
            builds, copies = st["builds_needed"]
            once = st["compiles"] == builds and st["derived"] == copies
            out[f"{stampede}_compiles_once"] = {"value": st["compiles"], "goal": f"== {builds} (and {copies} copies)", "met": once}
            if get(service, "wall_s"):
                ratio = st["build_wall_s"] / get(service, "wall_s")
                out[f"{stampede}_vs_one_cold_build"] = {"value": ratio, "goal": "<= 1.15", "met": ratio <= 1.15}
        if get(service, "wall_s") and get("service_under_load" + sx, "wall_s"):
            ratio = get(service, "wall_s") / get("service_under_load" + sx, "wall_s")  # throughput under load / idle
            out[f"{service}_throughput_under_load"] = {"value": ratio, "goal": ">= 0.9", "met": ratio >= 0.9}
        warm = "warm_service" + sx
        if get(warm, "all_after_import_s") is not None:  # goals set for the GPU host
            w = modes[warm]
            out[f"{warm}_all_after_import_s"] = {"value": w["all_after_import_s"], "goal": "< 1.0", "met": w["all_after_import_s"] < 1.0}
            out[f"{warm}_first_after_import_s"] = {"value": w["first_after_import_s"], "goal": "< 0.2", "met": w["first_after_import_s"] < 0.2}
    return out


def run_is_cpu(report: dict) -> bool:
    return report["target"] == "c"


def table(report: dict) -> str:
    modes = report["modes"]
    rows = [("mode", "wall s", "kernels", "compiles", "kernels/s", "notes")]
    for name, m in modes.items():
        if "error" in m:
            rows.append((name, "FAILED", "-", "-", "-", m["error"].strip().splitlines()[-1][:120]))
            continue
        notes = []
        if "workers" in m:
            notes.append(f"{m['workers']} workers")
        if "parallel_efficiency" in m:
            notes.append(f"efficiency {m['parallel_efficiency']:.2f}")
        if "import_s" in m and name in ("baseline", "tilelang"):
            notes.append(f"+{m['import_s']:.1f}s import")
        if "startup_s" in m:
            notes.append(f"SERVING in {m['startup_s']:.2f}s" + (f", workers ready in {m['ready_s']:.1f}s" if m.get("ready_s") else ""))
        if m.get("first_from_start_s") is not None:
            notes.append(f"from start: first kernel {m['first_from_start_s']:.2f}s, all {m['all_from_start_s']:.2f}s")
        if "idle_s" in m:
            i = m["idle_s"]
            notes.append(f"idle worker-s: ramp {i['ramp']:.1f}, between {i['between']:.1f}, tail {i['tail']:.1f}")
        if "prefetch_s" in m:
            notes.append(f"one by one {m['wall_s']:.2f}s, in one prefetch {m['prefetch_s']:.2f}s")
        if "first_s" in m:
            notes.append(f"first {m['first_s']:.2f}s ({m['first_after_import_s']:.2f}s after import), all after import {m['all_after_import_s']:.2f}s")
        if "cuda_compiler" in m and not run_is_cpu(report):
            notes.append(m["cuda_compiler"])
        if m.get("derived"):
            notes.append(f"+{m['derived']} copies of shared builds")
        if m.get("median_build_s") is not None:
            notes.append(
                f"{m['compile_s_per_kernel']:.2f}s/kernel ({m['build_seconds_sum']:.0f}s of builds / {m['kernels']}), median build {m['median_build_s']:.2f}s"
            )
        if "device_compiles" in m and not run_is_cpu(report):
            notes.append(f"device code compiled {m['device_compiles']}x")
        if "hit_requests_per_s" in m:
            notes.append(f"{m['hit_requests_per_s']:.0f} hits/s served")
        if "per_process" in m and name == "stampede_tilelang":
            notes.append("compiled per process " + "/".join(str(p["compiled"]) for p in m["per_process"]))
        if "loadavg_1m" in m:
            notes.append("load {:.1f}->{:.1f}".format(*m["loadavg_1m"]))
        service = "service" + name[len(name.split(":")[0]) :]  # the same backend's cold build
        if "build_wall_s" in m:
            notes.append(f"{m['build_wall_s']:.2f}s from the first request")
        if name.startswith("stampede") and "wall_s" in modes.get(service, {}):
            notes.append(f"{m.get('build_wall_s', m['wall_s']) / modes[service]['wall_s']:.2f}x {service}")
        rows.append((name, f"{m['wall_s']:.2f}", str(m["kernels"]), str(m["compiles"]), f"{m['kernels'] / m['wall_s']:.2f}", "; ".join(notes)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r[:5], widths))) + "  " + r[5] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    head = f"zoo: {report['kernels']} kernels, target {report['target']}, cpu quota {report['cpu_quota']}, {report['processes']} agent processes"
    tail = [f"goal {g}: {v['value']:.3g} (want {v['goal']}) {'MET' if v['met'] else 'MISSED'}" for g, v in report["goals"].items()]
    return "\n".join([head, *lines, *tail])


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install '.[bench]'); no plot written", file=sys.stderr)
        return
    modes = {name: m for name, m in report["modes"].items() if "error" not in m}
    names = list(modes)[::-1]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.5))
    colors = ["tab:blue" if "service" in n else "tab:gray" for n in names]
    bars = ax.barh(names, [modes[n]["wall_s"] for n in names], color=colors)
    for bar, n in zip(bars, names):
        m = modes[n]
        ax.annotate(f" {m['wall_s']:.1f}s, {m['compiles']} compiles", (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    ax.set_xlabel("wall seconds (lower is better)")
    ax.set_title(f"{report['kernels']} kernels, target {report['target']}, {report['cpu_quota']} CPUs")
    ax.margins(x=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        child_main(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--target",
        help="sm_90a cross-compiles CUDA kernels on a CPU-only host; auto = this host's GPU (else c); c = CPU kernels (default sm_90a; c with --quick)",
    )
    p.add_argument("--scale", type=int, default=3, help=f"zoo scale units of {zoo.UNIT} kernels (default 3 = {3 * zoo.UNIT})")
    p.add_argument("--salt", type=int, default=0, help="shifts every M so this run shares no kernel with runs of other salts")
    p.add_argument("--workers", type=int, help="daemon compile workers (default: the daemon's own, the CPU quota)")
    p.add_argument("--processes", type=int, help="agent processes in the stampede modes (default 4; 2 with --quick)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument(
        "--backend",
        default="auto",
        help="the daemon's CUDA compiler: auto, nvcc, nvrtc, or a list (nvcc,nvrtc) to run every service mode once per backend (default auto)",
    )
    p.add_argument("--quick", action="store_true", help="a 6-kernel zoo on target c (unless --target is given), 2 agents: a smoke test for CI")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG bar chart here (needs matplotlib)")
    p.add_argument("--work-dir", help="where caches and logs go (default: a new temp dir, removed unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (caches and child logs)")
    args = p.parse_args(argv)
    # --quick is a smoke test for CI on small machines: a 6-kernel CPU zoo, two agents.
    if args.target is None:
        args.target = "c" if args.quick else "sm_90a"
    if args.processes is None:
        args.processes = 2 if args.quick else 4
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if not backends or set(backends) - {"auto", "nvcc", "nvrtc"} or len(set(backends)) != len(backends):
        p.error(f"--backend {args.backend!r}: give auto, nvcc or nvrtc, or a list of distinct ones")
    if args.scale < 1 or args.processes < 1 or (args.workers is not None and args.workers < 1):
        p.error("--scale, --processes and --workers must be at least 1")

    from compile_service.cpus import usable_cpus

    specs = zoo.build_zoo(args.target, args.scale, args.salt, args.quick)
    run = Run(args, specs)
    print(f"compile_speed: {len(specs)} kernels, target {run.target}, modes {', '.join(modes)}; work dir {run.work}", file=sys.stderr)
    results, failed = {}, []

    def so_far() -> dict:
        out = {
            "target": run.target,
            "scale": args.scale,
            "salt": args.salt,
            "quick": args.quick,
            "kernels": len(specs),
            "processes": args.processes,
            "backends": backends,
            "cpu_quota": usable_cpus(),
            "cpu_count": os.cpu_count(),
            "host": platform.node(),
            "python": platform.python_version(),
            "modes": results,
        }
        out["goals"] = goals(results, [f":{b}" for b in backends] if len(backends) > 1 else [""])
        return out

    try:
        for mode in sorted(modes, key=MODES.index):  # cold modes first: warm modes reuse their caches
            for backend in backends if mode in SERVICE_MODES else [None]:
                if backend:
                    run.backend, run.suffix = backend, (f":{backend}" if len(backends) > 1 else "")
                name = mode + (run.suffix if backend else "")
                load_before = os.getloadavg()[0]
                try:
                    results[name] = globals()[f"mode_{mode}"](run)
                    # Other work on the host skews every number; the load average shows whether there was any.
                    results[name]["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
                except Exception as exc:  # one broken mode should not throw away the others' minutes
                    print(f"mode {name} failed: {exc}", file=sys.stderr)
                    failed.append(name)
                    results[name] = {"error": str(exc)[-2000:]}
                if args.json:  # after every mode: a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps(so_far(), indent=2))
    finally:
        if not (args.keep or args.work_dir):
            shutil.rmtree(run.work, ignore_errors=True)
    report = so_far()
    print(table(report))
    if args.plot:
        plot(report, args.plot)
    if failed:
        print(f"failed modes: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
