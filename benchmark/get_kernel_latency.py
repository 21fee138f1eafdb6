"""Cold and warm `get_kernel` latency from a fresh agent process, and a correctness check.

    python benchmark/get_kernel_latency.py                 # target auto: the local GPU, else "c"
    python benchmark/get_kernel_latency.py --target sm_90a --no-run   # cross-compile only

Starts a daemon on a fresh cache, then for each kernel runs one fresh process
that asks for it cold (compiled on request) and another that asks for it warm
(served from the cache). Each reports the time from `get_kernel` to a loaded
callable (and the client's import time separately), runs the kernel at two
runtime sizes and compares it with the torch reference. On a GPU the kernel is
called on a side stream right behind a long busy-wait, so a kernel that did not
launch on the caller's current stream would read unwritten inputs and fail.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devtools.launch import DaemonProcess  # noqa: E402

CPU_SPECS = [
    {"kind": "gemm", "M": None, "N": 256, "K": 256, "dtype": "float32", "trans_b": True},
    {"kind": "rmsnorm", "M": None, "N": 1024, "dtype": "float32"},
]
GPU_SPECS = [
    {"kind": "gemm", "M": None, "N": 14336, "K": 4096, "dtype": "float16", "trans_b": True},
    {"kind": "gemm", "M": None, "N": 4096, "K": 4096, "dtype": "bfloat16", "trans_b": True, "bias": True, "act": "silu"},
    {"kind": "rmsnorm", "M": None, "N": 4096, "dtype": "float16"},
    {"kind": "rmsnorm", "M": None, "N": 4096, "dtype": "bfloat16"},
    {"kind": "swiglu", "M": None, "N": 14336, "dtype": "bfloat16"},
    {"kind": "softmax", "M": None, "N": 4096, "dtype": "float16"},
    {"kind": "attention", "batch": 1, "heads": 32, "kv_heads": 8, "seq_len": None, "head_dim": 128, "causal": True, "dtype": "bfloat16"},
    {"kind": "attention", "batch": None, "heads": 28, "kv_heads": 4, "seq_len": None, "head_dim": 128, "causal": False, "dtype": "float16"},
]

AGENT = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    t1 = time.perf_counter()
    import client
    from kernels.reference import make_inputs, reference, tolerance
    t2 = time.perf_counter()
    spec, target, run, sizes = json.loads(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", json.loads(sys.argv[5])
    c = client.connect(sys.argv[1])
    kind = spec.pop("kind")
    t3 = time.perf_counter()
    k = c.get_kernel(kind, target=target, **spec)
    t4 = time.perf_counter()
    out = {"torch_import_s": t1 - t0, "client_import_s": t2 - t1, "get_s": t4 - t3, "outcome": k.outcome, "checked": []}
    if run:
        device = "cpu" if k.abi["device"] == "cpu" else "cuda"
        p = k.spec["params"]
        for n in sizes:
            ins = make_inputs(kind, p, device, runtime={"M": n, "batch": 2, "seq_len": n})
            want = reference(kind, p, ins)
            if device == "cuda":
                # On a side stream, behind a busy-wait: a kernel launched on any
                # other stream than the caller's would read its inputs unwritten.
                side = torch.cuda.Stream()
                torch.cuda.synchronize()
                with torch.cuda.stream(side):
                    torch.cuda._sleep(200_000_000)
                    got = k(*[t * 1 for t in ins])
                side.synchronize()
            else:
                got = k(*ins)
            err = (got.float() - want.float()).abs().max().item()
            try:
                torch.testing.assert_close(got, want, **tolerance(p["dtype"]))
                ok = True
            except AssertionError:
                ok = False
            out["checked"].append({"runtime_size": n, "max_abs_err": err, "ok": ok})
    print(json.dumps(out))
    """
)


def agent(socket: Path, spec: dict, target: str, run: bool, sizes: list[int]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", AGENT, str(socket), json.dumps(spec), target, "1" if run else "0", json.dumps(sizes)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"agent failed for {spec}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="auto")
    parser.add_argument("--no-run", action="store_true", help="only load the kernels (for cross-compiled targets)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    import kernels

    target = str(kernels.parse_target(args.target))
    specs, sizes = (CPU_SPECS, [37, 300]) if target == "c" else (GPU_SPECS, [4096, 1000])
    daemon = DaemonProcess(Path(tempfile.mkdtemp(prefix="ks-latency-")) / "cache", "--target", target).start()
    socket = daemon.socket
    rows, failed = [], False
    try:
        print(f"target {target}; fresh cache {daemon.cache_dir}; daemon log {daemon.log_path}", file=sys.stderr)
        for spec in specs:
            cold = agent(socket, dict(spec), target, not args.no_run, sizes)
            warm = agent(socket, dict(spec), target, not args.no_run, sizes)
            ok = all(c["ok"] for c in cold["checked"] + warm["checked"])
            failed |= not ok or cold["outcome"] != "compiled" or warm["outcome"] != "hit"
            rows.append({"spec": spec, "cold": cold, "warm": warm, "ok": ok})
    finally:
        daemon.stop()
    print(f"{'kernel':<100} {'cold get':>9} {'warm get':>9} {'client import':>14} {'max err':>9}  check")
    for r in rows:
        label = ", ".join(f"{k}={v}" for k, v in r["spec"].items())
        errs = [c["max_abs_err"] for c in r["cold"]["checked"]]
        check = "-" if args.no_run else ("ok" if r["ok"] else "FAIL")
        print(
            f"{label:<100} {r['cold']['get_s'] * 1e3:>7.0f}ms {r['warm']['get_s'] * 1e3:>7.1f}ms {r['warm']['client_import_s'] * 1e3:>12.0f}ms "
            f"{max(errs) if errs else float('nan'):>9.2e}  {check}"
        )
    if args.json:
        args.json.write_text(json.dumps({"target": target, "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
