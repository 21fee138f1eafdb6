"""The main job: a daemon on the default socket and cache, a small workload, a report.

Starts a daemon (or uses the one already answering), prefetches a demo set of
kernels (CPU kernels that run here, plus sm_90a kernels cross-compiled when
nvcc is present), asks for them again from a fresh client (all hits), runs the
CPU ones against torch, prints the daemon's counters and stops what it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .paths import default_cache_dir, default_socket, socket_address

CPU_SET = [
    {"kind": "gemm", "M": 64, "N": 96, "K": 128, "dtype": "float32", "target": "c"},
    {"kind": "gemm", "M": None, "N": 64, "K": 64, "dtype": "float32", "trans_b": True, "target": "c"},
    {"kind": "rmsnorm", "M": None, "N": 512, "dtype": "float32", "target": "c"},
]
GPU_SET = [
    {"kind": "gemm", "M": None, "N": 4096, "K": 4096, "dtype": "float16", "trans_b": True, "target": "sm_90a"},
    {"kind": "rmsnorm", "M": None, "N": 4096, "dtype": "float16", "target": "sm_90a"},
]


def wait_serving(address: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Blocks until the daemon's health service says SERVING."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with status {proc.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"no healthy kernel service at {address} after {timeout:.0f}s")


def _is_serving(address: str) -> bool:
    try:
        wait_serving(address, 1.5)
        return True
    except TimeoutError:
        return False


def _reference(spec, inputs):
    import torch

    if spec["kind"] == "gemm":
        a, b = inputs
        return a @ (b.T if spec.get("trans_b") else b)
    x, w = inputs
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _inputs(spec):
    import torch

    g = torch.Generator().manual_seed(0)
    m = spec["M"] or 37  # a runtime row count for dynamic kernels
    if spec["kind"] == "gemm":
        b = (spec["N"], spec["K"]) if spec.get("trans_b") else (spec["K"], spec["N"])
        return torch.randn(m, spec["K"], generator=g), torch.randn(*b, generator=g)
    return torch.randn(m, spec["N"], generator=g), torch.randn(spec["N"], generator=g)


def _label(spec) -> str:
    params = ", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("kind", "target"))
    return f"{spec['kind']}({params}) @ {spec['target']}"


def run_demo(cache_dir: str | None = None, socket: str | None = None) -> int:
    import client

    socket_path = Path(socket) if socket else default_socket()
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    address = socket_address(socket_path)
    specs = CPU_SET + (GPU_SET if shutil.which("nvcc") else [])

    daemon = None
    if _is_serving(address):
        print(f"using the kernel service already running at {socket_path}")
    else:
        print(f"starting kernel-service on {socket_path} (cache {cache})")
        cmd = [sys.executable, "-m", "compile_service.cli", "serve", "--socket", str(socket_path), "--cache-dir", str(cache)]
        daemon = subprocess.Popen(cmd)
        wait_serving(address, 120, daemon)
    try:
        print(f"\nround 1: prefetch {len(specs)} kernels")
        t0 = time.perf_counter()

        def progress(done, total, event):
            spec = specs[event["index"]]
            if event.get("error_code"):
                print(f"  [{done}/{total}] {_label(spec)}: FAILED {event['error_code']}")
                return
            k = event["kernel"]
            outcome = k.get("outcome", "OUTCOME_HIT").removeprefix("OUTCOME_").lower()
            print(f"  [{done}/{total}] {_label(spec)}: {outcome} (built in {k.get('compile_seconds', 0):.2f}s)")

        results = client.connect(socket_path).prefetch(specs, progress=progress, load=False)
        print(f"  round 1 took {time.perf_counter() - t0:.2f}s")
        failed = [r for r in results if isinstance(r, Exception)]

        print("\nround 2: a fresh client asks for each kernel again")
        fresh = client.connect(socket_path)
        for spec in CPU_SET:
            params = {k: v for k, v in spec.items() if k not in ("kind", "target")}
            t = time.perf_counter()
            kernel = fresh.get_kernel(spec["kind"], target=spec["target"], **params)
            ms = (time.perf_counter() - t) * 1e3
            inputs = _inputs(spec)
            err = (kernel(*inputs) - _reference(spec, inputs)).abs().max().item()
            print(f"  {_label(spec)}: {kernel.outcome} in {ms:.1f} ms, max |error| vs torch {err:.2e}")
            if err > 1e-3:
                failed.append(spec)

        stats = fresh.stats()
        print(f"\ndaemon stats: compiles={stats['compiles']} hits={stats['hits']} misses={stats['misses']} joined={stats['joined']} failures={stats['failures']} entries={stats['entries']} workers={stats['workers']}")
        return 1 if failed else 0
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            print("daemon stopped")


if __name__ == "__main__":
    sys.exit(run_demo(*sys.argv[1:3]))
