"""TileLang's own API, alone against through the daemon (issue #46), every part side by side in one run.

    PYTHONPATH=$PWD python benchmark/tilelang_cache.py [--small] [--target auto] [--processes 4]
        [--rounds 3] [--scale 3] [--parts cold,warm,par_compile,speed] [--json out.json] [--plot out.png]

An engine's code here is TileLang's API and nothing else: each process traces its kernels (the
zoo's kinds' PrimFuncs, as an engine's own factories would make them) and calls
`tilelang.compile` on each, one after another, or `tilelang.par_compile` on a batch. "tilelang"
runs it as is; "service" runs the very same code in processes started with
KERNEL_SERVICE_TILELANG=1, beside a daemon whose workers are up (a sidecar is up before agents).

  cold         (a) `--processes` K processes (tensor-parallel ranks) start at once and compile the
               same 8 cold kernels; TileLang's share one fresh TILELANG_CACHE_DIR, the service
               ones one fresh daemon. Also one process alone, TileLang's, the yardstick. Reports
               compiles (TileLang: its disk-cache misses, summed over processes; the service: the
               daemon's compiles), wall (from the launch to the last process's last kernel, and
               the kernels' part after imports), CPU seconds (the processes, and the daemon's
               process tree).
  warm         (b) a fresh process, once the caches are warm: seconds from its launch to its
               first kernel and to all 8, TileLang's own disk cache against the daemon's,
               alternated for `--rounds` rounds (medians).
  par_compile  (c) one process par_compiles the cold-build zoo's PrimFuncs (benchmark/zoo.py,
               42 x `--scale`: 126 by default), timed around the call alone.
  speed        (d) in one process, each kernel from TileLang's own cache and through the daemon:
               device time (TileLang's do_bench) and host time per call (back-to-back calls,
               perf_counter), alternated for `--rounds` rounds, medians; on the CPU the call's wall
               time stands for both.

`--small` runs on the CPU (target "c", float32, smaller shapes; CI runs it). Goals (on the GPU,
issue #46): cold service compiles = the kernels, kernels' wall <= 1.15x one TileLang process;
warm ratios <= 1.0; par_compile <= 0.2x; device time within 3%, host time <= 1.0x.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmark"))

import zoo  # noqa: E402

PARTS = ("cold", "warm", "par_compile", "speed")


def kernel_set(target: str) -> list[dict]:
    """The 8 kernels every engine process of the cold and warm parts compiles: static shapes of a
    Llama-3-8B-like layer (CPU: small ones, float32)."""
    import kernels

    cpu = kernels.parse_target(target).is_cpu
    dt = "float32" if cpu else "float16"
    m, h, f = (64, 128, 256) if cpu else (4096, 4096, 14336)
    tiles = {"block_M": 32, "block_N": 32, "block_K": 32} if cpu else {"block_M": 128, "block_N": 256, "block_K": 64, "num_stages": 3, "threads": 256}
    specs = [
        {"kind": "gemm", "M": m, "N": f, "K": h, "trans_b": True, "dtype": dt, **tiles},
        {"kind": "gemm", "M": m, "N": h + 2 * (h // 4), "K": h, "trans_b": True, "dtype": dt, **tiles},
        {
            "kind": "attention",
            "batch": 1,
            "heads": 4 if cpu else 32,
            "kv_heads": 1 if cpu else 8,
            "head_dim": 32 if cpu else 128,
            "seq_len": m,
            "causal": True,
            "dtype": dt,
        },
        {"kind": "rmsnorm", "M": m, "N": h, "dtype": dt},
        {"kind": "layernorm", "M": m, "N": h, "dtype": dt},
        {"kind": "swiglu", "M": m, "N": f, "dtype": dt},
        {"kind": "softmax", "M": m, "N": h, "dtype": dt},
        {"kind": "rmsnorm", "M": m, "N": f, "dtype": dt},
    ]
    for spec in specs:
        spec["target"] = str(kernels.parse_target(target))
        canon = kernels.canonicalize(spec["kind"], zoo.params_of(spec), spec["target"])
        assert not kernels.get_kind(spec["kind"]).scratch(dict(canon.params)), spec  # TileLang's call takes no workspaces
    return specs


# ----------------------------------------------------------------------------- child processes


def _trace(spec: dict):
    """(PrimFunc, tilelang.compile's keyword arguments) of a spec, as an engine's factory makes it."""
    import kernels
    from compile_service.build.compiler import _build_options

    canon = kernels.canonicalize(spec["kind"], zoo.params_of(spec), spec["target"])
    kind = kernels.get_kind(spec["kind"])
    func, outputs, options = _build_options(kind.build(dict(canon.params), canon.target), kind, dict(canon.params))
    return func, {"out_idx": list(outputs), "target": canon.target.tilelang_target(), **options}


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child_engine(args) -> dict:
    """One engine process: imports, then tilelang.compile of each kernel in turn."""
    import logging

    import tilelang
    from tilelang.cache.kernel_cache import KernelCache

    import kernels  # noqa: F401

    logging.getLogger("tilelang").setLevel(logging.WARNING)
    imported = time.time()
    misses = []
    load = KernelCache._load_kernel_from_disk

    def counting(self, *a, **k):  # TileLang compiles exactly when its disk lookup misses
        kernel = load(self, *a, **k)
        misses.append(kernel is None)
        return kernel

    KernelCache._load_kernel_from_disk = counting
    specs = json.loads(Path(args.kernels).read_text())
    ready = []
    with warnings.catch_warnings(record=True) as warned:  # the service's: a kernel compiled here instead
        warnings.simplefilter("always")
        for spec in specs:
            func, options = _trace(spec)
            tilelang.compile(func, **options)
            ready.append(time.time())
    import client.tilelang

    return {
        "import_s": imported - args.t0,
        "first_s": ready[0] - args.t0,
        "all_s": ready[-1] - args.t0,
        "kernels_s": ready[-1] - imported,
        "compiled": sum(misses),
        "cpu_s": _cpu_self(),
        "served": client.tilelang.installed() is not None,
        "warnings": sorted({str(w.message)[:300] for w in warned if w.category is client.tilelang.TileLangCacheWarning}),
    }


def child_par(args) -> dict:
    import logging

    import tilelang

    logging.getLogger("tilelang").setLevel(logging.WARNING)
    traced = [_trace(spec) for spec in json.loads(Path(args.kernels).read_text())]
    funcs, target = [f for f, _ in traced], traced[0][1]["target"]
    start = time.perf_counter()
    built = tilelang.par_compile(funcs, target=target)
    return {"wall_s": time.perf_counter() - start, "kernels": len(funcs), "built": sum(k is not None for k in built)}


def child_speed(args) -> dict:
    """Each kernel twice in this process: TileLang's own (its warm disk cache), then through the
    daemon (installed here); both called on the same inputs."""
    import logging

    import tilelang

    import client
    import kernels
    from kernels.reference import make_inputs

    logging.getLogger("tilelang").setLevel(logging.WARNING)
    specs = json.loads(Path(args.kernels).read_text())
    cuda = not kernels.parse_target(specs[0]["target"]).is_cpu
    device = "cuda" if cuda else "cpu"
    traced = [_trace(spec) for spec in specs]
    own = [tilelang.compile(func, **options) for func, options in traced]
    client.install_tilelang_cache(args.socket)
    served = [tilelang.compile(func, **options) for func, options in traced]
    client.uninstall_tilelang_cache()
    out = []
    for spec, mine, theirs in zip(specs, own, served):
        canon = kernels.canonicalize(spec["kind"], zoo.params_of(spec), spec["target"])
        inputs = make_inputs(spec["kind"], dict(canon.params), device=device)
        sides = {"tilelang": lambda k=mine: k(*inputs), "service": lambda k=theirs: k(*inputs)}
        same = _same(sides["tilelang"](), sides["service"]())
        device_us, host_us = {k: [] for k in sides}, {k: [] for k in sides}
        for r in range(args.rounds):
            for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:  # alternated: drift cancels
                device_us[name].append(_device_us(sides[name], cuda))
                host_us[name].append(_host_us(sides[name], cuda))
        med = {f"{what}_{k}": statistics.median(v[k]) for what, v in (("device", device_us), ("host", host_us)) for k in sides}
        out.append(
            {
                "kernel": zoo.label(spec),
                **med,
                "device_ratio": med["device_service"] / med["device_tilelang"],
                "host_ratio": med["host_service"] / med["host_tilelang"],
                "same_output": same,
                "same_source": mine.get_kernel_source() == theirs.get_kernel_source(),
            }
        )
    return {"kernels": out}


def _same(a, b) -> bool:
    import torch

    a, b = (x if isinstance(x, (list, tuple)) else [x] for x in (a, b))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _device_us(fn, cuda: bool) -> float:
    if cuda:
        from tilelang.profiler import do_bench

        return do_bench(fn, warmup=25, rep=100, backend="event") * 1e3
    return _host_us(fn, cuda, calls=50)


def _host_us(fn, cuda: bool, calls: int = 200) -> float:
    """Median seconds of one call, back to back (fewer calls than a launch queue holds)."""
    import torch

    for _ in range(10):
        fn()
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


CHILDREN = {"engine": child_engine, "par": child_par, "speed": child_speed}


def child_main(argv) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=CHILDREN)
    p.add_argument("--kernels", required=True)
    p.add_argument("--t0", type=float, default=0.0)
    p.add_argument("--socket")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    print(json.dumps({"result": CHILDREN[args.role](args)}), flush=True)
    return 0


# ----------------------------------------------------------------------------- the parent


class Run:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="tilelang-cache-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.seq = iter(range(1, 1 << 30))
        self.target = "c" if args.small else args.target
        self.kernels = self._write("kernels", kernel_set(self.target))
        self.zoo = self._write("zoo", zoo.build_zoo(self.target, scale=args.scale, quick=args.small))

    def _write(self, name: str, value) -> Path:
        path = self.work / f"{name}.json"
        path.write_text(json.dumps(value))
        return path

    def fresh(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-{next(self.seq)}-", dir=self.work))

    def spawn(self, role: str, env: dict, **flags) -> subprocess.Popen:
        argv = [sys.executable, str(Path(__file__).resolve()), "_child", role]
        for name, value in flags.items():
            argv += [f"--{name}", str(value)]
        log = open(self.work / f"{role}-{next(self.seq)}.log", "w")
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), **env}
        proc = subprocess.Popen(argv, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=log, text=True)
        proc.log = log
        return proc

    def daemon(self):
        from devtools.launch import DaemonProcess

        d = DaemonProcess(self.fresh("daemon-cache"), "--target", self.target, log_path=self.work / f"daemon-{next(self.seq)}.log")
        d.start()
        d.wait_workers_ready()
        return d


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    proc.log.close()
    lines = [line for line in out.splitlines() if line.startswith('{"result"')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"a child failed (status {proc.returncode}); see {proc.log.name}:\n{Path(proc.log.name).read_text()[-3000:]}")
    return json.loads(lines[-1])["result"]


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and every live descendant (the daemon, its zygote and workers)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
            except (OSError, IndexError, ValueError):
                continue
    mine, grew = {pid}, True
    while grew:
        more = {p for p, (parent, _) in stats.items() if parent in mine} - mine
        grew, mine = bool(more), mine | more
    return sum(stats[p][1] for p in mine if p in stats) / os.sysconf("SC_CLK_TCK")


def _engines(run: Run, count: int, env: dict) -> tuple[list[dict], float]:
    t0 = time.time()
    procs = [run.spawn("engine", env, kernels=run.kernels, t0=t0) for _ in range(count)]
    results = [result(p) for p in procs]
    return results, time.time() - t0


def _summary(results: list[dict], wall: float) -> dict:
    return {
        "processes": len(results),
        "wall_s": wall,
        "kernels_wall_s": max(r["kernels_s"] for r in results),
        "import_s": statistics.median(r["import_s"] for r in results),
        "cpu_s": sum(r["cpu_s"] for r in results),
        "per_process": results,
    }


def part_cold(run: Run, report: dict) -> None:
    k = run.args.processes
    one, wall = _engines(run, 1, {"TILELANG_CACHE_DIR": str(run.fresh("tilelang-one"))})
    report["cold_tilelang_1"] = {**_summary(one, wall), "compiles": sum(r["compiled"] for r in one)}
    run.tilelang_cache = run.fresh("tilelang-shared")
    many, wall = _engines(run, k, {"TILELANG_CACHE_DIR": str(run.tilelang_cache)})
    report[f"cold_tilelang_{k}"] = {**_summary(many, wall), "compiles": sum(r["compiled"] for r in many)}
    d = run.daemon()
    before = tree_cpu_s(d.proc.pid)
    served, wall = _engines(
        run, k, {"KERNEL_SERVICE_TILELANG": "1", "KERNEL_SERVICE_SOCKET": str(d.socket), "TILELANG_CACHE_DIR": str(run.fresh("tilelang-unused"))}
    )
    stats = d.client().stats()
    assert all(r["served"] for r in served), "KERNEL_SERVICE_TILELANG=1 did not install"
    report[f"cold_service_{k}"] = {
        **_summary(served, wall),
        "compiles": stats["compiles"],
        "daemon_cpu_s": tree_cpu_s(d.proc.pid) - before,
        "tilelang_compiles_in_processes": sum(r["compiled"] for r in served),
    }
    report[f"cold_service_{k}"]["cpu_s"] += report[f"cold_service_{k}"]["daemon_cpu_s"]
    run.daemon_warm = d  # the warm part asks it again


def part_warm(run: Run, report: dict) -> None:
    if not hasattr(run, "daemon_warm"):
        part_cold(run, {})
    d = run.daemon_warm
    sides = {
        "tilelang": {"TILELANG_CACHE_DIR": str(run.tilelang_cache)},
        "service": {"KERNEL_SERVICE_TILELANG": "1", "KERNEL_SERVICE_SOCKET": str(d.socket), "TILELANG_CACHE_DIR": str(run.fresh("tilelang-unused"))},
    }
    got = {name: [] for name in sides}
    compiles = d.client().stats()["compiles"]
    for r in range(run.args.rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            got[name].append(_engines(run, 1, sides[name])[0][0])
    assert d.client().stats()["compiles"] == compiles, "a warm engine compiled"
    out = {}
    for name, results in got.items():
        out[name] = {what: statistics.median(r[what] for r in results) for what in ("first_s", "all_s", "import_s", "kernels_s")}
        out[name]["compiled"] = sum(r["compiled"] for r in results)
        out[name]["rounds"] = results
    out["first_ratio"] = out["service"]["first_s"] / out["tilelang"]["first_s"]
    out["all_ratio"] = out["service"]["all_s"] / out["tilelang"]["all_s"]
    out["after_import_ratio"] = (out["service"]["all_s"] - out["service"]["import_s"]) / (out["tilelang"]["all_s"] - out["tilelang"]["import_s"])
    report["warm"] = out


def part_par_compile(run: Run, report: dict) -> None:
    own = result(run.spawn("par", {"TILELANG_CACHE_DIR": str(run.fresh("tilelang-par"))}, kernels=run.zoo))
    d = getattr(run, "daemon_warm", None) or run.daemon()  # its workers warm; the zoo's kernels are not in its cache
    before = d.client().stats()["compiles"]
    served = result(
        run.spawn(
            "par",
            {"KERNEL_SERVICE_TILELANG": "1", "KERNEL_SERVICE_SOCKET": str(d.socket), "TILELANG_CACHE_DIR": str(run.fresh("tilelang-unused"))},
            kernels=run.zoo,
        )
    )
    compiles = d.client().stats()["compiles"] - before
    if d is not getattr(run, "daemon_warm", None):
        d.stop()
    report["par_compile"] = {"tilelang": own, "service": {**served, "compiles": compiles}, "ratio": served["wall_s"] / own["wall_s"]}


def part_speed(run: Run, report: dict) -> None:
    if not hasattr(run, "daemon_warm"):
        part_cold(run, {})
    d = run.daemon_warm
    got = result(run.spawn("speed", {"TILELANG_CACHE_DIR": str(run.tilelang_cache)}, kernels=run.kernels, socket=d.socket, rounds=run.args.rounds))
    kernels_ = got["kernels"]
    report["speed"] = {
        "kernels": kernels_,
        "device_ratio_max": max(k["device_ratio"] for k in kernels_),
        "device_ratio_min": min(k["device_ratio"] for k in kernels_),
        "host_ratio_median": statistics.median(k["host_ratio"] for k in kernels_),
        "same_output": all(k["same_output"] for k in kernels_),
        "same_source": all(k["same_source"] for k in kernels_),
    }


def goals(report: dict, k: int) -> dict:
    out = {}
    if f"cold_service_{k}" in report:
        one, served = report["cold_tilelang_1"], report[f"cold_service_{k}"]
        out["cold: service compiles each kernel once"] = served["compiles"] == 8 and served["tilelang_compiles_in_processes"] == 0
        out["cold: kernels' wall <= 1.15x one TileLang process"] = served["kernels_wall_s"] <= 1.15 * one["kernels_wall_s"]
    if "warm" in report:
        out["warm: first kernel ratio <= 1.0"] = report["warm"]["first_ratio"] <= 1.0
        out["warm: whole set ratio <= 1.0"] = report["warm"]["all_ratio"] <= 1.0
    if "par_compile" in report:
        out["par_compile <= 0.2x"] = report["par_compile"]["ratio"] <= 0.2
    if "speed" in report:
        s = report["speed"]
        out["device time within 3%"] = s["device_ratio_max"] <= 1.03 and s["device_ratio_min"] >= 0.97
        out["host time per call <= 1.0x"] = s["host_ratio_median"] <= 1.0
        out["same source and output"] = s["same_source"] and s["same_output"]
    return out


def table(report: dict, k: int) -> str:
    lines = [f"target {report['target']}, {k} processes"]
    for name in ("cold_tilelang_1", f"cold_tilelang_{k}", f"cold_service_{k}"):
        if name in report:
            r = report[name]
            lines.append(
                f"  {name:<18} compiles {r['compiles']:>3}  wall {r['wall_s']:6.2f} s  kernels {r['kernels_wall_s']:6.2f} s  import {r['import_s']:5.2f} s  CPU {r['cpu_s']:7.1f} s"
            )
    if "warm" in report:
        w = report["warm"]
        for side in ("tilelang", "service"):
            lines.append(f"  warm {side:<13} first {w[side]['first_s']:6.3f} s  all {w[side]['all_s']:6.3f} s  (import {w[side]['import_s']:.3f} s)")
        lines.append(f"  warm ratios        first {w['first_ratio']:.3f}  all {w['all_ratio']:.3f}  after import {w['after_import_ratio']:.3f}")
    if "par_compile" in report:
        p = report["par_compile"]
        lines.append(
            f"  par_compile {p['tilelang']['kernels']} kernels: TileLang {p['tilelang']['wall_s']:.2f} s, service {p['service']['wall_s']:.2f} s "
            f"({p['service']['compiles']} compiles): {p['ratio']:.3f}x"
        )
    if "speed" in report:
        for kern in report["speed"]["kernels"]:
            lines.append(
                f"  {kern['kernel']:<28} device {kern['device_tilelang']:9.1f} / {kern['device_service']:9.1f} us ({kern['device_ratio']:.3f})  "
                f"host {kern['host_tilelang']:7.1f} / {kern['host_service']:7.1f} us ({kern['host_ratio']:.3f})  same {kern['same_source'] and kern['same_output']}"
            )
    for name in (f"cold_service_{k}",):
        for text in sorted({w for r in report.get(name, {}).get("per_process", []) for w in r["warnings"]}):
            lines.append(f"  warning in a service process: {text}")
    for goal, met in report["goals"].items():
        lines.append(f"  [{'met' if met else 'NOT MET'}] {goal}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = {}
    k = report["processes"]
    if f"cold_service_{k}" in report:
        bars["cold kernels wall\n(service K / TileLang 1)"] = report[f"cold_service_{k}"]["kernels_wall_s"] / report["cold_tilelang_1"]["kernels_wall_s"]
    if "warm" in report:
        bars["warm first"] = report["warm"]["first_ratio"]
        bars["warm all"] = report["warm"]["all_ratio"]
    if "par_compile" in report:
        bars["par_compile"] = report["par_compile"]["ratio"]
    if "speed" in report:
        bars["device time (max)"] = report["speed"]["device_ratio_max"]
        bars["host time (median)"] = report["speed"]["host_ratio_median"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(list(bars), list(bars.values()))
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_ylabel("service / TileLang alone")
    ax.set_title(f"TileLang's API through the daemon, target {report['target']}")
    plt.xticks(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        return child_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help='the CPU form: target "c", float32, small shapes, the quick zoo')
    p.add_argument("--target", default="auto", help="the kernels' target (default auto: this host's GPU)")
    p.add_argument("--processes", type=int, default=4, help="engine processes of the cold part (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds of the warm and speed parts (default 3)")
    p.add_argument("--scale", type=int, default=3, help="the par_compile part's zoo: 42 kernels per unit (default 3: 126)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--plot", help="write a bar chart of the ratios here (PNG)")
    p.add_argument("--work-dir", help="where caches and logs go (default: a new temporary directory)")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part {unknown[0]!r}; parts are {', '.join(PARTS)}")
    if args.processes < 1 or args.rounds < 1 or args.scale < 1:
        p.error("--processes, --rounds and --scale take positive numbers")
    run = Run(args)
    report = {"target": run.target, "processes": args.processes, "work_dir": str(run.work)}
    try:
        for part in parts:
            print(f"[{part}] ...", file=sys.stderr, flush=True)
            globals()[f"part_{part}"](run, report)
    finally:
        if hasattr(run, "daemon_warm"):
            run.daemon_warm.stop()
    report["goals"] = goals(report, args.processes)
    print(table(report, args.processes))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
