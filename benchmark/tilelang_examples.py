"""TileLang's own examples, run unchanged, alone and with KERNEL_SERVICE_TILELANG=1 (issue #46).

    PYTHONPATH=$PWD python benchmark/tilelang_examples.py --examples DIR [--cases gemm,rms_norm] [--json out.json]

`--examples DIR` holds example files copied unchanged from TileLang's repository (examples/ of
github.com/tile-ai/tilelang, not part of this repository; EXAMPLES names each file's place there),
in a folder outside this repository. Each case runs the example as `python FILE ARGS` would
(runpy, `__main__`), twice, each time in a fresh process with torch seeded the same way:

  tilelang   TileLang alone, on a fresh TILELANG_CACHE_DIR;
  service    the same, started with KERNEL_SERVICE_TILELANG=1 beside a daemon on a fresh cache
             (its workers warm): every compile goes through the daemon.

Each run records, per kernel in the order the example first calls it, TileLang's
`get_kernel_source()` and the outputs of its first call (saved to the work directory), and
whether the example exited cleanly (the examples check themselves against torch). Then per case:
the same sources, the same outputs (torch.equal, else the largest difference), the daemon's
compiles, and that the service run left TileLang's own cache empty. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

UPSTREAM = "https://github.com/tile-ai/tilelang"
# case -> (file, path in TileLang's repository, arguments)
EXAMPLES = {
    "gemm": ("example_gemm.py", "examples/gemm/example_gemm.py", []),
    "gemm_autotune": ("example_gemm_autotune.py", "examples/gemm/example_gemm_autotune.py", []),
    "mha_fwd": ("example_mha_fwd_bshd.py", "examples/flash_attention/example_mha_fwd_bshd.py", []),
    "mha_fwd_tune": ("example_mha_fwd_bshd.py", "examples/flash_attention/example_mha_fwd_bshd.py", ["--tune"]),  # @autotune tuning
    "gqa_decode": ("example_gqa_decode.py", "examples/flash_decoding/example_gqa_decode.py", []),
    "rms_norm": ("rms_norm.py", "examples/norm/rms_norm.py", []),
    "layernorm": ("layernorm.py", "examples/norm/layernorm.py", []),
    "elementwise_add": ("example_elementwise_add.py", "examples/elementwise/example_elementwise_add.py", []),
}

# The child: runs one example as __main__, recording each kernel's source and first outputs.
CHILD = r"""
import json, os, runpy, sys, torch
path, record = sys.argv[1], sys.argv[2]
sys.argv = [path, *sys.argv[3:]]
sys.path.insert(0, os.path.dirname(path))
torch.manual_seed(0)
import tilelang
from tilelang.jit import JITKernel
seen, outputs, compiled = {}, [], []
jit = sys.modules["tilelang.jit"]
cached = jit.cached  # every tilelang.compile (the decorator's, the autotuner's) goes through it
def recording_cached(*args, **kwargs):
    kernel = cached(*args, **kwargs)
    compiled.append(str(kernel.get_kernel_source()))
    return kernel
jit.cached = recording_cached
call = JITKernel.__call__
def recording(self, *args, **kwargs):
    out = call(self, *args, **kwargs)
    if id(self) not in seen:
        seen[id(self)] = len(seen)
        outs = out if isinstance(out, (list, tuple)) else [out] if out is not None else [a for a in args if isinstance(a, torch.Tensor)]
        outputs.append({"source": str(self.get_kernel_source()), "outputs": [t.detach().cpu().clone() for t in outs if isinstance(t, torch.Tensor)]})
    return out
JITKernel.__call__ = recording
status = "ok"
try:
    runpy.run_path(path, run_name="__main__")
except SystemExit as exc:
    status = "ok" if exc.code in (None, 0) else f"exit {exc.code}"
except Exception as exc:
    status = f"{type(exc).__name__}: {str(exc)[:500]}"
torch.save({"called": outputs, "compiled": compiled}, record)
import client.tilelang
print(json.dumps({"status": status, "kernels": len(outputs), "served": client.tilelang.installed() is not None}))
"""


def run_case(name: str, examples: Path, work: Path, socket: Path, mode: str) -> dict:
    file, _, args = EXAMPLES[name]
    record = work / f"{name}-{mode}.pt"
    own = work / f"tilelang-cache-{name}-{mode}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "TILELANG_CACHE_DIR": str(own)}
    if mode == "service":
        env.update(KERNEL_SERVICE_TILELANG="1", KERNEL_SERVICE_SOCKET=str(socket))
    log = work / f"{name}-{mode}.log"
    start = time.perf_counter()
    with open(log, "w") as err:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(examples / file), str(record), *args], cwd=work, env=env, stdout=subprocess.PIPE, stderr=err, text=True
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"status"')]
    result = json.loads(lines[-1]) if lines else {"status": f"crashed (status {done.returncode}); see {log}", "kernels": 0, "served": False}
    result["seconds"] = time.perf_counter() - start
    result["own_cache_kernels"] = sum(1 for p in own.rglob("*") if p.is_file() and "kernels" in p.parts) if own.exists() else 0
    result["record"] = str(record)
    return result


def compare(a: dict, b: dict) -> dict:
    import torch

    if not (Path(a["record"]).exists() and Path(b["record"]).exists()):
        return {"same_sources": False, "same_outputs": False, "max_abs_diff": None}
    ra, rb = torch.load(a["record"]), torch.load(b["record"])
    x, y = ra["called"], rb["called"]
    same_sources = ra["compiled"] == rb["compiled"] and len(x) == len(y) and all(p["source"] == q["source"] for p, q in zip(x, y))
    differing = [i for i, (p, q) in enumerate(zip(ra["compiled"], rb["compiled"])) if p != q]
    diff_lines = []
    for i in differing[:2]:
        import difflib

        diff_lines += [line for line in difflib.unified_diff(ra["compiled"][i].splitlines(), rb["compiled"][i].splitlines(), lineterm="", n=0)][:12]
    diffs = []
    for p, q in zip(x, y):
        for s, t in zip(p["outputs"], q["outputs"]):
            diffs.append(0.0 if torch.equal(s, t) else float((s.double() - t.double()).abs().max()) if s.shape == t.shape else float("inf"))
    return {
        "compiled": len(ra["compiled"]),
        "same_sources": same_sources,
        "differing_sources": differing,
        "source_diff": diff_lines,
        "same_outputs": len(x) == len(y) and all(d == 0.0 for d in diffs),
        "max_abs_diff": max(diffs, default=0.0),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", required=True, help="the folder of example files, copied unchanged from TileLang's repository")
    p.add_argument("--cases", default=",".join(EXAMPLES), help=f"comma-separated, of {', '.join(EXAMPLES)}")
    p.add_argument("--json", help="write every result here")
    p.add_argument("--work-dir", help="where records, caches and logs go (default: a new temporary directory)")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in EXAMPLES]
    if unknown:
        p.error(f"unknown case {unknown[0]!r}; cases are {', '.join(EXAMPLES)}")
    examples = Path(args.examples).resolve()
    missing = [EXAMPLES[c][0] for c in cases if not (examples / EXAMPLES[c][0]).exists()]
    if missing:
        p.error(f"{examples} lacks {', '.join(missing)}: copy them unchanged from {UPSTREAM} ({', '.join(EXAMPLES[c][1] for c in cases)})")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tilelang-examples-"))
    work.mkdir(parents=True, exist_ok=True)

    from devtools.launch import DaemonProcess

    daemon = DaemonProcess(work / "daemon-cache", "--target", "auto", log_path=work / "daemon.log").start()
    daemon.wait_workers_ready()
    rpc = daemon.client()
    report = {}
    try:
        for name in cases:
            before = rpc.stats()["compiles"]
            alone = run_case(name, examples, work, daemon.socket, "tilelang")
            served = run_case(name, examples, work, daemon.socket, "service")
            report[name] = {"tilelang": alone, "service": served, "daemon_compiles": rpc.stats()["compiles"] - before, **compare(alone, served)}
            r = report[name]
            print(
                f"{name:<16} tilelang {alone['status'][:30]:<10} {alone['seconds']:5.1f} s | service {served['status'][:30]:<10} {served['seconds']:5.1f} s "
                f"compiled {r['compiled']} called {served['kernels']} daemon compiles {r['daemon_compiles']} own cache {served['own_cache_kernels']} | "
                f"same source {r['same_sources']} same output {r['same_outputs']} (max diff {r['max_abs_diff']})",
                flush=True,
            )
            for line in r["source_diff"]:
                print(f"    {line[:200]}")
    finally:
        rpc.close()
        daemon.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = all(r["tilelang"]["status"] == "ok" and r["service"]["status"] == "ok" and r["service"]["served"] and r["same_sources"] for r in report.values())
    print("all cases: same source, clean exits" if ok else "SOME CASES DIFFER OR FAILED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
