"""A bundle of sm_90a kernels built on a CPU-only machine, served on a GPU host that compiles nothing.

    python benchmark/bundle_roundtrip.py build --dir DIR     # the builder: no GPU needed (cross-compiles)
    python benchmark/bundle_roundtrip.py serve --dir DIR     # the GPU host: no nvcc, NVRTC never used
    python benchmark/bundle_roundtrip.py sizes --dir DIR --cache-dir CACHE --manifest FILE [--target sm_90a]

`build` starts a daemon on a fresh cache, has an application ("gpu-demo") prefetch
the kernels (recorded as it asks), writes the application's manifest
(`kernel-service manifest`) and packs exactly those entries (`kernel-service
bundle export`) into DIR, with the device compiler id the keys were made with.

`serve` imports the bundle into a fresh cache (`kernel-service bundle import
--cuda-compiler-id ID`) and starts `kernel-service serve --no-compile
--cuda-compiler-id ID`, both with every PATH entry holding an nvcc removed and
CUDA_HOME empty; a strict client then gets every kernel of the manifest (a miss
would raise KernelNotReady), runs each on the GPU at two runtime sizes on a side
stream behind a busy-wait, and compares it with the torch reference. The bundle
is signed by the builder's cache key; `serve` trusts exactly that key
(builder.pub, from `kernel-service bundle key`).

`sizes` exports one arch of a built cache (say the zoo, prewarmed with `serve
--target sm_90a`) as plain tar, gzip and xz, then imports the xz bundle as a
read-only layer (`bundle import --layer`), timing each step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devtools.launch import DaemonProcess  # noqa: E402

APP = "gpu-demo"
BUNDLE = "kernels.tar.xz"
SPECS = [
    {"kind": "gemm", "M": None, "N": 4096, "K": 4096, "dtype": "float16", "trans_b": True},
    {"kind": "gemm", "M": 2048, "N": 4096, "K": 4096, "dtype": "float16", "trans_b": True},  # served as a copy of the one above
    {"kind": "rmsnorm", "M": None, "N": 4096, "dtype": "bfloat16"},
    {"kind": "swiglu", "M": None, "N": 4096, "dtype": "bfloat16"},
    {"kind": "softmax", "M": None, "N": 4096, "dtype": "float16"},
    {"kind": "attention", "batch": 1, "heads": 32, "kv_heads": 8, "seq_len": None, "head_dim": 128, "causal": True, "dtype": "bfloat16"},
]


def cli(*args: str, env: dict | None = None) -> tuple[str, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "compile_service.cli", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"kernel-service {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout.strip(), time.perf_counter() - start


def build(out: Path, workers: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="ks-builder-")) / "cache"
    start = time.perf_counter()
    with DaemonProcess(cache, "--target", "c", "--cuda-compiler", "nvrtc", workers=workers) as daemon:
        c = daemon.client(app=APP)
        outcomes = c.prefetch([{**s, "target": "sm_90a"} for s in SPECS], load=False)
        if any(isinstance(o, Exception) for o in outcomes):
            raise SystemExit(f"build failed: {outcomes}")
        stats = c.stats()
    built = time.perf_counter() - start
    _, manifest_s = cli("manifest", "--app", APP, "--cache-dir", str(cache), "-o", str(out / "manifest.json"))
    exported, export_s = cli(
        "bundle", "export", "--manifest", str(out / "manifest.json"), "--cache-dir", str(cache), "--cuda-compiler", "nvrtc", "-o", str(out / BUNDLE)
    )
    (out / "builder.pub").write_text(cli("bundle", "key", "--cache-dir", str(cache))[0] + "\n")
    summary = {
        "cuda_compiler": stats["cuda_compiler"],
        "outcomes": outcomes,
        "compiles": stats["compiles"],
        "derived": stats["derived"],
        "build_s": round(built, 2),
        "manifest_s": round(manifest_s, 2),
        "export_s": round(export_s, 2),
        "export": exported,
        "bundle_bytes": (out / BUNDLE).stat().st_size,
    }
    (out / "build.json").write_text(json.dumps(summary, indent=1))
    return summary


def without_compilers() -> dict:
    """This environment minus every PATH entry that holds an nvcc, and with CUDA_HOME empty."""
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not os.path.exists(os.path.join(p, "nvcc")))
    return {**os.environ, "PATH": path, "CUDA_HOME": "", "CUDA_PATH": ""}


def serve(bundle_dir: Path, sizes: list[int]) -> dict:
    """`sizes`: the runtime sizes each kernel runs at; [] only loads them (no GPU needed)."""
    import torch

    import client  # noqa: F401 - the client's torch ops, registered on import
    from kernels.reference import make_inputs, reference, tolerance

    built = json.loads((bundle_dir / "build.json").read_text())
    cc = built["cuda_compiler"]
    env = without_compilers()
    assert shutil.which("nvcc", path=env["PATH"]) is None
    cache = Path(tempfile.mkdtemp(prefix="ks-gpu-")) / "cache"
    trust = ("--trusted-key", str(bundle_dir / "builder.pub"), *(() if sizes else ("--target", "sm_90a")))  # no GPU: only loaded
    imported, import_s = cli("bundle", "import", str(bundle_dir / BUNDLE), "--cache-dir", str(cache), "--cuda-compiler-id", cc, *trust, env=env)
    daemon = DaemonProcess(cache, "--no-compile", "--cuda-compiler-id", cc, env={k: env[k] for k in ("PATH", "CUDA_HOME", "CUDA_PATH")})
    start = time.perf_counter()
    daemon.start()
    up_s = time.perf_counter() - start
    rows = []
    try:
        c = daemon.client(strict=True)
        manifest = json.loads((bundle_dir / "manifest.json").read_text())
        for spec in manifest["kernels"]:
            t0 = time.perf_counter()
            k = c.get_kernel(spec["kind"], target=spec["target"], **spec["params"])
            get_ms = (time.perf_counter() - t0) * 1e3
            p, checks = k.spec["params"], []
            for n in sizes:  # runtime sizes; dims the spec fixes keep their values
                ins = make_inputs(spec["kind"], p, "cuda", runtime={"M": n, "batch": 2, "seq_len": n})
                want = reference(spec["kind"], p, ins)
                side = torch.cuda.Stream()
                torch.cuda.synchronize()
                with torch.cuda.stream(side):
                    torch.cuda._sleep(200_000_000)  # a kernel launched on another stream would read unwritten inputs
                    got = k(*[t * 1 for t in ins])
                side.synchronize()
                try:
                    torch.testing.assert_close(got, want, **tolerance(p["dtype"]))
                    ok = True
                except AssertionError:
                    ok = False
                checks.append({"size": n, "max_abs_err": (got.float() - want.float()).abs().max().item(), "ok": ok})
            rows.append({"spec": spec, "outcome": k.outcome, "get_ms": round(get_ms, 1), "checks": checks})
        stats = c.stats()
    finally:
        daemon.stop()
    return {
        "gpu": torch.cuda.get_device_name() if sizes else None,
        "cuda_compiler_id": cc,
        "nvcc_on_path": shutil.which("nvcc", path=env["PATH"]),
        "import": imported,
        "import_s": round(import_s, 2),
        "daemon_up_s": round(up_s, 2),
        "compiles": stats["compiles"],
        "hits": stats["hits"],
        "not_ready": stats["not_ready"],
        "workers": stats["workers"],
        "rows": rows,
        "ok": all(ch["ok"] for r in rows for ch in r["checks"]) and stats["compiles"] == 0 and all(r["outcome"] == "hit" for r in rows),
    }


def sizes(out: Path, cache: Path, manifest: Path, target: str, cuda_compiler: str) -> dict:
    """One arch of `cache`'s entries for `manifest`, exported three ways, and the xz one laid out as a layer."""
    out.mkdir(parents=True, exist_ok=True)
    exporting = ("bundle", "export", "--manifest", str(manifest), "--cache-dir", str(cache), "--cuda-compiler", cuda_compiler, "--target", target)
    rows = {}
    for name in ("kernels.tar", "kernels.tar.gz", BUNDLE):
        shutil.rmtree(out / name, ignore_errors=True)
        text, seconds = cli(*exporting, "-o", str(out / name))
        rows[name] = {"bytes": (out / name).stat().st_size, "export_s": round(seconds, 2), "export": text}
    (out / "builder.pub").write_text(cli("bundle", "key", "--cache-dir", str(cache))[0] + "\n")
    layer = out / "layer"
    if layer.exists():  # a layer of an earlier run: read-only, so made writable to be replaced
        for path in [layer, *layer.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(layer)
    trust = ("--trusted-key", str(out / "builder.pub"), "--target", target, "--cuda-compiler", cuda_compiler)
    imported, import_s = cli("bundle", "import", str(out / BUNDLE), "--layer", str(layer), *trust)
    gz = rows["kernels.tar.gz"]["bytes"]
    return {
        "target": target,
        "rows": rows,
        "xz_vs_gzip": round(1 - rows[BUNDLE]["bytes"] / gz, 3),
        "layer_import_s": round(import_s, 2),
        "layer_import": imported,
        "layer_files": sum(1 for p in layer.rglob("*") if p.is_file()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("build", "serve", "sizes"))
    parser.add_argument("--dir", type=Path, required=True, help=f"where build writes manifest.json, {BUNDLE}, builder.pub, build.json; where serve reads them")
    parser.add_argument("--cache-dir", type=Path, help="sizes: the built cache to export from")
    parser.add_argument("--manifest", type=Path, help="sizes: the kernels to export")
    parser.add_argument("--target", default="sm_90a", help="sizes: the arch to export (default sm_90a)")
    parser.add_argument("--cuda-compiler", default="nvrtc", help="sizes: the compiler the cache's keys were made with (default nvrtc)")
    parser.add_argument("--workers", type=int, default=2, help="build: compile workers (default 2)")
    parser.add_argument("--no-run", action="store_true", help="serve: only load the kernels (a host without a GPU)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.step == "sizes":
        result = sizes(args.dir, args.cache_dir, args.manifest, args.target, args.cuda_compiler)
    else:
        result = build(args.dir, args.workers) if args.step == "build" else serve(args.dir, [] if args.no_run else [4096, 1000])
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if args.step != "serve" or result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
