"""`make demo`: a daemon on a private socket and cache, a small workload, a report.

Run from the repository as `python -m devtools.demo [--cpu-only] [--socket PATH] [--cache-dir DIR]`.

Starts a daemon in a temporary directory of its own (socket, cache and log; removed at the
end, so the demo changes nothing on the machine), or on --socket and --cache-dir when given
(using the daemon already answering there), prefetches a demo set of kernels (CPU kernels
that run here, plus sm_90a kernels cross-compiled when nvcc is present), asks for them again
from a fresh client (all hits), runs the CPU ones against torch, prints the daemon's counters
and stops what it started.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .launch import DaemonProcess, is_serving

CPU_SET = [
    {"kind": "gemm", "M": 64, "N": 96, "K": 128, "dtype": "float32", "target": "c"},
    {"kind": "gemm", "M": None, "N": 64, "K": 64, "dtype": "float32", "trans_b": True, "target": "c"},
    {"kind": "rmsnorm", "M": None, "N": 512, "dtype": "float32", "target": "c"},
    {"kind": "swiglu", "M": None, "N": 256, "dtype": "float32", "target": "c"},
    {"kind": "softmax", "M": None, "N": 300, "dtype": "float32", "target": "c"},
    {"kind": "attention", "batch": 1, "heads": 4, "kv_heads": 2, "seq_len": None, "head_dim": 32, "causal": True, "dtype": "float32", "target": "c"},
]
# Cross-compiled when nvcc is present (they cannot run without a GPU).
GPU_SET = [
    {"kind": "gemm", "M": None, "N": 4096, "K": 4096, "dtype": "float16", "trans_b": True, "target": "sm_90a"},
    {"kind": "rmsnorm", "M": None, "N": 4096, "dtype": "float16", "target": "sm_90a"},
]


def _label(spec) -> str:
    params = ", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("kind", "target"))
    return f"{spec['kind']}({params}) @ {spec['target']}"


def how_served(kernel: dict) -> str:
    """What happened to one kernel, from a Prefetch event's `kernel` (GetKernelResponse as a dict)."""
    outcome = kernel["outcome"].removeprefix("OUTCOME_").lower()
    shared = kernel.get("shared_build")
    routes = json.loads(kernel["artifact"]["abi_json"]).get("dispatch") if kernel.get("artifact") else None
    if routes:  # a router (KernelKind.dispatch): the builds of each range of a runtime size
        return f"{outcome} as a router over {len(routes['routes'])} builds by {routes['dim']} range"
    if shared:  # no compile of its own: published as a copy of the build that leaves its sizes to run time
        fixed = json.loads(kernel["artifact"]["abi_json"]).get("fixed", {})  # the sizes this copy fixes
        runtime = ", ".join(fixed)
        return f"{outcome} as a copy of the shared build with {runtime} at run time (that build took {shared['compile_seconds']:.2f}s)"
    if outcome == "hit":
        return f"hit (built earlier in {kernel['compile_seconds']:.2f}s)"
    return f"{outcome} (built in {kernel['compile_seconds']:.2f}s)"


def run_demo(cache_dir: str | None = None, socket: str | None = None, cpu_only: bool = False) -> int:
    import torch

    import client
    from kernels.reference import make_inputs, reference, tolerance

    specs = CPU_SET + (GPU_SET if shutil.which("nvcc") and not cpu_only else [])
    gpu = len(specs) - len(CPU_SET)
    # The demo's own directory, removed at the end: it leaves nothing on the machine (not the default cache or socket).
    private = Path(tempfile.mkdtemp(prefix="ks-demo-"))
    socket_path = Path(socket) if socket else private / "ks.sock"
    cache = Path(cache_dir) if cache_dir else private / "cache"
    # Measured on 2 cores: the daemon's start and 6 CPU kernels ~10 s; the sm_90a GEMM is a router of 8 builds.
    print(
        f"demo, about {10 + 5 * gpu} s on 2 cores: compiles {len(CPU_SET)} CPU kernels{f' and cross-compiles {gpu} sm_90a ones' if gpu else ''}, "
        f"then loads and runs the CPU ones again; socket {socket_path}, cache {cache}{'' if cache_dir else ' (removed at the end)'}"
    )
    daemon, ok = None, False
    try:
        if socket and is_serving(socket_path):
            print(f"using the kernel service already running at {socket_path}")
        else:
            # TMPDIR: its compilers' scratch files (TileLang leaves a source and a library per CPU build) go too.
            (private / "tmp").mkdir()
            daemon = DaemonProcess(cache, socket=socket_path, log_path=private / "daemon.log", env={"TMPDIR": str(private / "tmp")})
            print(f"starting kernel-service on {socket_path}")
            daemon.start()
        print(f"\nround 1: prefetch {len(specs)} kernels")
        t0 = time.perf_counter()

        def progress(done, total, event):
            label = _label(specs[event["index"]])
            if event["error_code"]:
                print(f"  [{done}/{total}] {label}: FAILED {event['error_code']}")
            else:
                print(f"  [{done}/{total}] {label}: {how_served(event['kernel'])}")

        results = client.connect(socket_path).prefetch(specs, progress=progress, load=False)
        print(f"  round 1 took {time.perf_counter() - t0:.2f}s")
        failed = [r for r in results if isinstance(r, Exception)]

        print("\nround 2: a fresh client asks for each CPU kernel again and runs it")
        fresh = client.connect(socket_path)
        for spec in CPU_SET:
            params = {k: v for k, v in spec.items() if k not in ("kind", "target")}
            t = time.perf_counter()
            kernel = fresh.get_kernel(spec["kind"], target=spec["target"], **params)
            ms = (time.perf_counter() - t) * 1e3
            inputs = make_inputs(spec["kind"], kernel.spec["params"])
            got, want = kernel(*inputs), reference(spec["kind"], kernel.spec["params"], inputs)
            close = torch.allclose(got, want, **tolerance("float32"))
            print(
                f"  {_label(spec)}: {kernel.outcome} in {ms:.1f} ms, max |error| vs torch {(got - want).abs().max().item():.1e}{'' if close else '  MISMATCH'}"
            )
            if not close:
                failed.append(spec)

        s = fresh.stats()
        print(
            f"\ndaemon stats: compiles={s['compiles']} derived={s['derived']} hits={s['hits']} misses={s['misses']} joined={s['joined']} failures={s['failures']} entries={s['entries']} workers={s['workers']}"
        )
        print("demo " + ("FAILED" if failed else "ok"))
        ok = not failed
        return 0 if ok else 1
    finally:
        if daemon is not None:
            daemon.stop()
            print("daemon stopped")
            if not ok:  # its log goes with the directory: show its end first
                print(f"the daemon's log ends:\n{daemon.log()[-3000:]}")
        shutil.rmtree(private, ignore_errors=True)
        print(f"removed {private}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.demo", description="start a daemon, ask it for a few kernels twice, run them, stop")
    parser.add_argument("--socket", help="Unix socket path (default: a private one, removed at the end); a daemon already answering there is used")
    parser.add_argument("--cache-dir", help="cache root (default: a private one, removed at the end)")
    parser.add_argument("--cpu-only", action="store_true", help="leave out the sm_90a kernels cross-compiled where nvcc is present")
    args = parser.parse_args(argv)
    return run_demo(args.cache_dir, args.socket, args.cpu_only)


if __name__ == "__main__":
    sys.exit(main())
