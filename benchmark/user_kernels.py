"""TileLang's own examples, served unchanged, against TileLang's own compile of the same kernel (issue #30).

    PYTHONPATH=$PWD python benchmark/user_kernels.py --examples .bench/tl_examples [--cases gemm,rms_norm] [--rounds 5] [--json out.json]

`--examples DIR` holds example files copied unchanged from TileLang's repository (examples/
of github.com/tile-ai/tilelang; they are not part of this repository). EXAMPLES below names
each file and where it lives upstream. Every case is served **without a wrapper**: the daemon
imports the example module itself (`kernel-service serve --kernel-module <module>`), so each
`@tilelang.jit` / `@autotune` object in it is a kind under its own name.

Per case:

1. served: daemons on fresh caches (the modules split between daemons so kind names stay
   unique: three examples name their factory `flashattn`), every case prefetched at once
   (`Client.prefetch`: cold builds in parallel on the daemon's workers), target auto;
2. TileLang: the same factory compiled by TileLang itself with the same parameters
   (`<factory>.compile(**params)`, the `@tilelang.jit` under an `@autotune`: the example's
   own fixed-config path), with its decorator's out_idx, pass_configs and compile flags,
   on a fresh TileLang cache, several cases at once in threads;
3. correctness: fresh random inputs (never zeros), the served output written into a
   NaN-poisoned `out=` buffer where the kernel has outputs, both checked against a float64
   torch reference (relative Frobenius error, max abs error) and against each other;
4. generated CUDA: TileLang's `get_kernel_source()` against the served entry's `kernel.cu`:
   equal, or the count of differing lines and the first hunk of the diff;
5. device time: TileLang's `do_bench` (CUPTI kernel time, L2 flushed between calls, the flush
   excluded) on each side, alternated for `--rounds` rounds, median per side; ratio served/TileLang
   (issue #30: within 3%);
6. host time per call outside CUDA graphs: after a synchronize, `--host-calls` back-to-back
   calls with no synchronize between them (fewer than the launch queue holds), each timed with
   perf_counter; alternated for `--rounds` rounds; median per call per side; ratio (issue #30:
   served at most TileLang's own adapter's).

Prints a table last; `--json PATH` writes every number. Exits 0 even when cases fail: each
failed case is reported FAILED with its reason.

Example modules that import a package this environment lacks (einops in
example_gqa_decode.py) get a stub of it on the path (`--stub-missing`, default on): a module
the examples import only for their own reference code, never for the kernel.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import difflib
import importlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Example files: module name -> path in TileLang's repository (copy them unchanged, flat, into --examples).
EXAMPLES = {
    "example_gemm": "examples/gemm/example_gemm.py",
    "rms_norm": "examples/norm/rms_norm.py",
    "example_elementwise_add": "examples/elementwise/example_elementwise_add.py",
    "example_mha_fwd_bshd": "examples/flash_attention/example_mha_fwd_bshd.py",
    "example_gqa_decode": "examples/flash_decoding/example_gqa_decode.py",
    "example_mha_inference": "examples/flash_decoding/example_mha_inference.py",
    "example_tilelang_gemm_splitk": "examples/gemm_splitk/example_tilelang_gemm_splitk.py",
    "example_gemv": "examples/gemv/example_gemv.py",
}
UPSTREAM = "https://github.com/tile-ai/tilelang"
STUBBABLE = ("einops",)  # imported by examples for their reference code only


@dataclass
class Case:
    """One served kernel: `attr` of example `module` (the kind's name), its params, how to make
    inputs (`inputs(torch, device) -> list`), the float64 torch reference (`ref(*inputs) -> tensor`),
    and which tensor is the result: the kernel's return value, or for an in-place kernel the
    input at index `result_input`."""

    name: str
    module: str
    attr: str
    styles: tuple[str, ...]
    params: dict
    inputs: object
    ref: object
    tol: float  # relative Frobenius error against the float64 reference
    result_input: int | None = None  # in place: the input the kernel writes its result into
    note: str = ""
    upstream_call: str = ""  # the example's own compile call, for the record

    @property
    def kind(self) -> str:
        return self.attr


def _randn(torch, shape, dtype, device):
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)


def _attn_ref(torch, q, k, v, scale=None):
    """softmax(q k^T / sqrt(d)) v for [B, S, H, D] tensors, in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    d = q.shape[-1]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def _gqa_decode_ref(torch, q, k, v, mask):
    """q [B, H, D], k/v [B, S, G, D], mask [B, S, G] (0: masked) -> [B, H, D], float64."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, d = q.shape
    g = k.shape[2]
    qg = q.view(b, g, h // g, d)  # head i uses kv head i // (h // g)
    s = torch.einsum("bgjd,bsgd->bgjs", qg, k) / math.sqrt(d)
    s = s.masked_fill((mask.permute(0, 2, 1) == 0)[:, :, None, :], float("-inf"))
    return torch.einsum("bgjs,bsgd->bgjd", s.softmax(-1), v).reshape(b, h, d)


def _cases() -> list[Case]:
    import torch

    f16, f32 = torch.float16, torch.float32
    G = dict(M=4096, N=4096, K=4096)

    def rms(x):
        return x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-12)

    attn = dict(batch=2, heads=32, seq_len=2048, dim=128)
    dec = dict(batch=8, heads=32, groups=8, seqlen_kv=8192, dim=128)
    inf = dict(batch=2, heads=32, seqlen_q=128, seqlen_kv=8192, dim=128)
    NV = dict(N=8192, K=8192)
    return [
        Case(
            "gemm",
            "example_gemm",
            "matmul",
            ("eager", "T.empty output"),
            dict(**G, block_M=128, block_N=128, block_K=32),
            lambda t, dev: [_randn(t, (G["M"], G["K"]), f16, dev), _randn(t, (G["K"], G["N"]), f16, dev)],
            lambda a, b: a.double() @ b.double(),
            1e-2,
            upstream_call="matmul.compile(M=1024, N=1024, K=1024, block_M=128, block_N=128, block_K=32)",
        ),
        Case(
            "rms_norm",
            "rms_norm",
            "rms_norm",
            ("eager", "pass_configs", "several per module"),
            dict(M=8192, N=8192, blk_m=1),
            lambda t, dev: [_randn(t, (8192, 8192), f32, dev)],
            rms,
            1e-4,
            upstream_call="rms_norm.compile(M=8192, N=8192, blk_m=1)",
        ),
        Case(
            "rms_norm_splitk",
            "rms_norm",
            "rms_norm_splitk",
            ("eager", "pass_configs", "several per module"),
            dict(M=8192, N=8192, blk_m=1, blk_k=512),
            lambda t, dev: [_randn(t, (8192, 8192), f32, dev)],
            rms,
            1e-4,
            upstream_call="rms_norm_splitk.compile(M, N, blk_m=1, blk_k=512) (the file's other kernel)",
        ),
        Case(
            "elementwise_add",
            "example_elementwise_add",
            "elementwise_add",
            ("eager", "dtype params"),
            dict(M=4096, N=4096, block_M=32, block_N=32, in_dtype="float32", out_dtype="float32", threads=128),
            lambda t, dev: [_randn(t, (4096, 4096), f32, dev), _randn(t, (4096, 4096), f32, dev)],
            lambda a, b: a.double() + b.double(),
            1e-6,
            upstream_call="elementwise_add(a, b, block_M=32, block_N=32, threads=128, in_dtype=T.float32, out_dtype=T.float32)",
        ),
        Case(
            "flash_attention",
            "example_mha_fwd_bshd",
            "flashattn",
            ("plain", "autotuned", "pass_configs: TL_ENABLE_FAST_MATH", "out_idx"),
            dict(**attn, is_causal=False, block_M=128, block_N=128, num_stages=1, threads=128),
            lambda t, dev: [_randn(t, (attn["batch"], attn["seq_len"], attn["heads"], attn["dim"]), f16, dev) for _ in range(3)],
            lambda q, k, v: _attn_ref(torch, q, k, v),
            1e-2,
            upstream_call="flashattn(batch, heads, seq_len, dim, is_causal, block_M=128, block_N=128, num_stages=1, threads=128)",
        ),
        Case(
            "flash_decoding_gqa",
            "example_gqa_decode",
            "flashattn",
            ("plain", "autotuned", "pass_configs: TL_DISABLE_WARP_SPECIALIZED", "T.alloc_global workspaces"),
            dict(**dec, block_N=128, block_H=64, num_split=8, num_stages=2, threads=128),
            lambda t, dev: [
                _randn(t, (dec["batch"], dec["heads"], dec["dim"]), f16, dev),
                _randn(t, (dec["batch"], dec["seqlen_kv"], dec["groups"], dec["dim"]), f16, dev),
                _randn(t, (dec["batch"], dec["seqlen_kv"], dec["groups"], dec["dim"]), f16, dev),
                t.randint(0, 2, (dec["batch"], dec["seqlen_kv"], dec["groups"]), dtype=t.uint8, device=dev),
            ],
            lambda q, k, v, m: _gqa_decode_ref(torch, q, k, v, m),
            1e-2,
            upstream_call="flashattn(batch, heads, groups, kv_seqlen, dim, **get_heuristic_config()[0]) (its sm_90 config)",
        ),
        Case(
            "flash_decoding_mha",
            "example_mha_inference",
            "flashattn",
            ("plain", "module-level constant", "T.alloc_global workspaces"),
            dict(**inf, is_causal=False, block_M=64, block_N=128),
            lambda t, dev: [
                _randn(t, (inf["batch"], inf["seqlen_q"], inf["heads"], inf["dim"]), f16, dev),
                _randn(t, (inf["batch"], inf["seqlen_kv"], inf["heads"], inf["dim"]), f16, dev),
                _randn(t, (inf["batch"], inf["seqlen_kv"], inf["heads"], inf["dim"]), f16, dev),
            ],
            lambda q, k, v: _attn_ref(torch, q, k, v),
            1e-2,
            upstream_call="flashattn(batch, heads, seqlen_q, seqlen_kv, dim, is_causal, block_M=64, block_N=128)",
        ),
        Case(
            "gemm_splitk",
            "example_tilelang_gemm_splitk",
            "matmul",
            ("eager", "in-place (atomic adds into C, no output)"),
            dict(**G, block_M=128, block_N=128, block_K=32, split_k=4),
            lambda t, dev: [_randn(t, (G["M"], G["K"]), f16, dev), _randn(t, (G["K"], G["N"]), f16, dev), t.zeros((G["M"], G["N"]), dtype=f32, device=dev)],
            lambda a, b, c: c.double() + a.double() @ b.double(),
            1e-4,
            result_input=2,
            note="C accumulates: the reference is C + A @ B for the C passed in",
            upstream_call="matmul(a, b, c, block_M, block_N, block_K, split_k)",
        ),
        Case(
            "gemv_naive",
            "example_gemv",
            "naive_gemv",
            ("eager", "several per module", "annotated params"),
            dict(**NV, BLOCK_N=128, BLOCK_K=128),
            lambda t, dev: [_randn(t, (NV["K"],), f16, dev), _randn(t, (NV["N"], NV["K"]), f16, dev)],
            lambda a, b: b.double() @ a.double(),
            1e-2,
            upstream_call="naive_gemv.compile(N=N, K=K, BLOCK_N=128, BLOCK_K=128)",
        ),
        Case(
            "gemv_splitk_vectorized",
            "example_gemv",
            "splitk_gemv_vectorized",
            ("eager", "several per module"),
            dict(**NV, BLOCK_N=2, reduce_threads=32),
            lambda t, dev: [_randn(t, (NV["K"],), f16, dev), _randn(t, (NV["N"], NV["K"]), f16, dev)],
            lambda a, b: b.double() @ a.double(),
            1e-2,
            upstream_call="splitk_gemv_vectorized.compile(N=N, K=K, BLOCK_N=2, reduce_threads=32)",
        ),
        Case(
            "gemv_alloc_reducer",
            "example_gemv",
            "gemv_alloc_reducer",
            ("eager", "autotuned", "pass_configs", "several per module"),
            dict(M=8192, N=8192, block_M=128, block_N=128, num_stages=2, threads=256),
            lambda t, dev: [_randn(t, (8192, 8192), f16, dev), _randn(t, (8192,), f16, dev)],
            lambda a, x: a.double() @ x.double(),
            1e-2,
            upstream_call="gemv_alloc_reducer.compile(M=N, N=K, block_M=128, block_N=128)",
        ),
    ]


def case_table() -> list[dict]:
    """The cases as plain data (for --list and the tests)."""
    return [
        {
            "name": c.name,
            "module": c.module,
            "file": EXAMPLES[c.module],
            "kind": c.kind,
            "styles": list(c.styles),
            "params": c.params,
            "tol": c.tol,
            "in_place": c.result_input is not None,
        }
        for c in _cases()
    ]


def daemon_groups(cases: list[Case]) -> list[list[str]]:
    """Modules split between daemons so that no daemon serves two kinds of one name."""
    groups: list[tuple[list[str], set[str]]] = []
    for module in dict.fromkeys(c.module for c in cases):
        kinds = {c.kind for c in cases if c.module == module}
        for mods, names in groups:
            if not names & kinds:
                mods.append(module)
                names |= kinds
                break
        else:
            groups.append(([module], set(kinds)))
    return [mods for mods, _ in groups]


def stub_dir(work: Path, modules: list[str], examples: Path) -> Path | None:
    """A directory of empty stand-ins for STUBBABLE packages missing here, when an example imports them."""
    needed = []
    for name in STUBBABLE:
        try:
            importlib.import_module(name)
        except ImportError:
            if any(f"import {name}" in (examples / f"{m}.py").read_text() or f"from {name} " in (examples / f"{m}.py").read_text() for m in modules):
                needed.append(name)
    if not needed:
        return None
    d = work / "stubs"
    for name in needed:
        (d / name).mkdir(parents=True, exist_ok=True)
        (d / name / "__init__.py").write_text(
            f'"""Stand-in for {name}, absent here: the examples use it only in their torch reference code."""\n'
            "def __getattr__(attr):\n"
            "    def missing(*args, **kwargs):\n"
            f"        raise ImportError('{name} is not installed (benchmark stub)')\n"
            "    return missing\n"
        )
    return d


# ----- measurement


def source_diff(a: str, b: str) -> dict:
    if a == b:
        return {"equal": True}
    la, lb = a.splitlines(), b.splitlines()
    diff = list(difflib.unified_diff(la, lb, "tilelang", "served", n=1, lineterm=""))
    changed = sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))
    return {"equal": False, "changed_lines": changed, "tilelang_lines": len(la), "served_lines": len(lb), "diff_head": "\n".join(diff[:40])}


def errors(torch, out, ref) -> dict:
    out64 = out.double()
    finite = bool(torch.isfinite(out64).all())
    diff = (out64 - ref).abs()
    return {
        "finite": finite,
        "max_abs": float(diff.max()),
        "rel": float(torch.linalg.vector_norm(out64 - ref) / max(float(torch.linalg.vector_norm(ref)), 1e-30)),
    }


def run_kernel(kernel, inputs, result_input):
    result = kernel(*inputs)
    return inputs[result_input] if result_input is not None else result


def check(torch, case: Case, served, tl_kernel, dev) -> dict:
    torch.manual_seed(hash(case.name) & 0xFFFF)
    inputs = case.inputs(torch, dev)
    ref = case.ref(*inputs)  # before the kernels: in-place kernels change their inputs

    def fresh():
        return [t.clone() for t in inputs]

    out = {}
    # served, into a NaN-poisoned out= buffer (every element must be written), then plain
    if case.result_input is None and served.abi["outputs"]:
        dims = served.check_inputs(inputs)[0]
        params = served.abi["params"]
        poisoned = [
            torch.full(shape, float("nan"), dtype=getattr(torch, params[slot]["dtype"]), device=dev)
            for slot, shape in zip(served.abi["outputs"], served.output_shapes(dims))
        ]
        served(*fresh(), out=poisoned[0] if len(poisoned) == 1 else tuple(poisoned))
        torch.cuda.synchronize()
        out["served_poisoned"] = errors(torch, poisoned[0], ref)
    s_out = run_kernel(served, fresh(), case.result_input)
    t_out = run_kernel(tl_kernel, fresh(), case.result_input)
    torch.cuda.synchronize()
    out["served"] = errors(torch, s_out, ref)
    out["tilelang"] = errors(torch, t_out, ref)
    out["served_vs_tilelang_max_abs"] = float((s_out.double() - t_out.double()).abs().max())
    worst = max(e["rel"] for e in (out["served"], out["tilelang"], out.get("served_poisoned", out["served"])))
    out["ok"] = all(e["finite"] for k, e in out.items() if isinstance(e, dict)) and worst <= case.tol
    return out


def device_times(torch, case: Case, served, tl_kernel, dev, rounds: int) -> dict:
    from tilelang.profiler import do_bench

    inputs = case.inputs(torch, dev)
    sides = {"served": lambda: served(*inputs), "tilelang": lambda: tl_kernel(*inputs)}
    backend = "cupti"
    times = {k: [] for k in sides}
    for r in range(rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:  # alternate the order: drift cancels
            try:
                times[name].append(do_bench(sides[name], warmup=25, rep=100, backend=backend) * 1e3)
            except Exception:  # no CUPTI here: CUDA events around each call, L2 flushed
                backend = "event"
                times[name].append(do_bench(sides[name], warmup=25, rep=100, backend=backend) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"backend": backend, "served_us": med["served"], "tilelang_us": med["tilelang"], "ratio": med["served"] / med["tilelang"], "rounds_us": times}


def host_times(torch, case: Case, served, tl_kernel, dev, rounds: int, calls: int) -> dict:
    inputs = case.inputs(torch, dev)
    sides = {"served": lambda: served(*inputs), "tilelang": lambda: tl_kernel(*inputs)}
    for fn in sides.values():
        for _ in range(20):
            fn()
    per = {k: [] for k in sides}
    clock = time.perf_counter
    for r in range(rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            fn = sides[name]
            torch.cuda.synchronize()
            samples = []
            for _ in range(calls):
                t0 = clock()
                fn()
                samples.append(clock() - t0)
            per[name] += samples
    torch.cuda.synchronize()
    med = {k: statistics.median(v) * 1e6 for k, v in per.items()}
    return {"served_us": med["served"], "tilelang_us": med["tilelang"], "ratio": med["served"] / med["tilelang"], "calls": calls * rounds}


# ----- the two builds


def tilelang_compile(case: Case) -> tuple[object, float]:
    """TileLang's own compile of the example's factory (an @autotune's @tilelang.jit: its fixed-config path)."""
    module = importlib.import_module(case.module)
    obj = getattr(module, case.attr)
    jit = getattr(obj, "jit_impl", None) or obj
    t0 = time.perf_counter()
    kernel = jit.compile(**case.params)
    return kernel, time.perf_counter() - t0


def start_daemons(groups, work: Path, env: dict, workers_total: int, cases: list[Case], target: str = "auto"):
    from devtools.launch import DaemonProcess

    daemons = []
    counts = [sum(c.module in g for c in cases) for g in groups]
    for g, n in zip(groups, counts):
        workers = max(1, round(workers_total * n / sum(counts)))
        cache = work / f"cache-{len(daemons)}"
        flags = ["--target", target, "--no-entry-points", *[x for m in g for x in ("--kernel-module", m)]]
        tl_cache = {"TILELANG_CACHE_DIR": str(work / f"daemon-{len(daemons)}-tilelang-cache")}
        d = DaemonProcess(cache, *flags, workers=workers, log_path=work / f"daemon-{len(daemons)}.log", env={**env, **tl_cache})
        d.start(wait=False)
        daemons.append(d)
    from devtools.launch import socket_address, wait_serving

    for d in daemons:
        wait_serving(socket_address(d.socket), 300, d.proc)
    return daemons


def tilelang_compile_for(case: Case, arch: str):
    """TileLang's compile of the example's factory for an explicit CUDA arch (no GPU needed):
    what `<factory>.compile` does, with the decorator's options, the target given."""
    import tilelang

    module = importlib.import_module(case.module)
    jit = getattr(module, case.attr)
    jit = getattr(jit, "jit_impl", None) or jit
    func = jit.get_tir(**case.params)
    return tilelang.compile(func, out_idx=jit.out_idx, target={"kind": "cuda", "arch": arch}, pass_configs=jit.pass_configs, compile_flags=jit.compile_flags)


def served_source(cache: Path, case: Case) -> str | None:
    """The kernel.cu of the cache entry built for `case` (read off the entries' entry.json)."""
    for meta in cache.rglob("entry.json"):
        try:
            spec = json.loads(meta.read_text())["spec"]
        except (OSError, ValueError, KeyError):
            continue
        if spec.get("kind") == case.kind and all(spec["params"].get(k) == v for k, v in case.params.items()) and (meta.parent / "kernel.cu").exists():
            return (meta.parent / "kernel.cu").read_text()
    return None


def build_only(args, cases, groups, work, env, results, t_start) -> int:
    daemons = start_daemons(groups, work, env, args.workers, cases, target=args.build_only)
    try:
        for i, g in enumerate(groups):
            group_cases = [c for c in cases if c.module in g]
            got = daemons[i].client().prefetch([{"kind": c.kind, "target": args.build_only, **c.params} for c in group_cases], load=False)
            for c, outcome in zip(group_cases, got):
                r = results[c.name]
                if isinstance(outcome, Exception):
                    r["status"], r["reason"] = "FAILED", f"served: {type(outcome).__name__}: {outcome}"
                    continue
                r["served_outcome"] = outcome
                try:
                    theirs = tilelang_compile_for(c, args.build_only).get_kernel_source()
                    ours = served_source(daemons[i].cache_dir, c)
                    r["source"] = (
                        source_diff(theirs, ours)
                        if ours is not None
                        else {"equal": False, "changed_lines": -1, "diff_head": "no kernel.cu in the served entry"}
                    )
                    r["status"] = "ok" if r["source"]["equal"] else "MISS"
                except Exception as exc:
                    r["status"], r["reason"] = "FAILED", f"TileLang's own compile: {type(exc).__name__}: {exc}"
    finally:
        for d in daemons:
            d.stop()
    for c in cases:
        r = results[c.name]
        what = r.get("reason") or (
            "same CUDA source" if r["source"]["equal"] else f"CUDA differs in {r['source']['changed_lines']} lines\n{r['source']['diff_head']}"
        )
        print(f"{c.name:24} {r['status']:7} {what}")
    summary = {
        "cases": len(cases),
        "ok": sum(r.get("status") == "ok" for r in results.values()),
        "seconds": round(time.perf_counter() - t_start, 1),
        "build_only": args.build_only,
    }
    print(f"build only ({args.build_only}): {summary['ok']} of {summary['cases']} served with TileLang's CUDA source, in {summary['seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "work_dir": str(work), "results": list(results.values())}, indent=1, default=str))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example files: " + ", ".join(f"{m}.py <- {UPSTREAM}/blob/main/{p}" for m, p in EXAMPLES.items()),
    )
    ap.add_argument("--examples", type=Path, help="directory holding TileLang's example files, unchanged (see EXAMPLES)")
    ap.add_argument("--cases", help="comma-separated case names (default: all; --list shows them)")
    ap.add_argument("--list", action="store_true", help="print the case table and exit")
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds of each timing (default 5)")
    ap.add_argument("--host-calls", type=int, default=200, help="calls per host-time round (default 200)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 4, help="compile workers over all daemons (default: CPUs)")
    ap.add_argument("--tl-threads", type=int, default=4, help="TileLang's own compiles run this many at once (default 4)")
    ap.add_argument("--work-dir", type=Path, help="daemon caches, logs, TileLang's cache (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument(
        "--build-only", metavar="ARCH", help="no GPU needed: build both sides for ARCH (e.g. sm_90a; cross-compiled) and compare the generated CUDA only"
    )
    ap.add_argument(
        "--no-stub-missing", dest="stub_missing", action="store_false", help="no stand-ins for packages the examples import only for reference code"
    )
    args = ap.parse_args(argv)

    table = case_table()
    if args.list:
        for c in table:
            print(f"{c['name']:24} {c['module']}:{c['kind']:24} {', '.join(c['styles'])}\n{'':24} {json.dumps(c['params'])}")
        return 0
    if args.examples is None:
        ap.error("--examples DIR is required (TileLang's example files, unchanged)")
    examples = args.examples.resolve()
    cases = _cases()
    if args.cases:
        wanted = [w.strip() for w in args.cases.split(",") if w.strip()]
        unknown = sorted(set(wanted) - {c.name for c in cases})
        if unknown:
            ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(c.name for c in cases)}")
        cases = [c for c in cases if c.name in wanted]
    missing = sorted({f"{c.module}.py" for c in cases if not (examples / f"{c.module}.py").exists()})
    if missing:
        ap.error(f"{examples} lacks {', '.join(missing)} (copy them unchanged from {UPSTREAM}: {', '.join(EXAMPLES[m[:-3]] for m in missing)})")

    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="user-kernels-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    stubs = stub_dir(work, [c.module for c in cases], examples) if args.stub_missing else None
    path = [str(ROOT), str(examples), *([str(stubs)] if stubs else [])]
    sys.path[:0] = [p for p in path[1:] if p not in sys.path]
    os.environ.setdefault("TILELANG_CACHE_DIR", str(work / "tilelang-cache"))  # TileLang's own builds: cold too
    env = {"PYTHONPATH": os.pathsep.join(path + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}

    results = {
        c.name: {"case": c.name, "module": c.module, "file": EXAMPLES[c.module], "kind": c.kind, "styles": list(c.styles), "params": c.params} for c in cases
    }
    t_start = time.perf_counter()
    groups = daemon_groups(cases)
    print(f"work dir {work}; daemons: {' | '.join(', '.join(g) for g in groups)}", flush=True)
    if args.build_only:
        return build_only(args, cases, groups, work, env, results, t_start)
    daemons = start_daemons(groups, work, env, args.workers, cases)
    try:
        import torch

        dev = torch.device("cuda")
        # served: every case prefetched at once, each daemon its own; TileLang: threads meanwhile
        pool = cf.ThreadPoolExecutor(max(1, args.tl_threads))
        tl_futures = {c.name: pool.submit(tilelang_compile, c) for c in cases}
        clients = [d.client() for d in daemons]
        served = {}

        def fetch(i, group_cases):
            t0 = time.perf_counter()
            got = clients[i].prefetch([{"kind": c.kind, **c.params} for c in group_cases])
            return [(c, k, time.perf_counter() - t0) for c, k in zip(group_cases, got)]

        with cf.ThreadPoolExecutor(len(daemons)) as fp:
            for done in fp.map(lambda ig: fetch(*ig), [(i, [c for c in cases if c.module in g]) for i, g in enumerate(groups)]):
                for c, k, secs in done:
                    served[c.name] = k
                    results[c.name]["served_ready_s"] = round(secs, 2)
        print(f"served side ready after {time.perf_counter() - t_start:.1f} s", flush=True)
        for c in cases:
            r = results[c.name]
            try:
                k = served[c.name]
                if isinstance(k, Exception):
                    raise RuntimeError(f"served: {type(k).__name__}: {k}")
                r["served_outcome"] = k.outcome
                try:
                    tl_kernel, secs = tl_futures[c.name].result()
                except Exception as exc:
                    raise RuntimeError(f"TileLang's own compile: {type(exc).__name__}: {exc}") from exc
                r["tilelang_compile_s"] = round(secs, 2)
                r["tilelang_target"] = str(getattr(tl_kernel, "target", ""))
                r["served_target"] = k.spec.get("target")
                beside = Path(k.path).parent / "kernel.cu"  # k.path: the entry's library
                src_served = beside.read_text() if beside.exists() else served_source(daemons[[c.module in g for g in groups].index(True)].cache_dir, c)
                if src_served is None:
                    raise RuntimeError(f"no kernel.cu beside {k.path} or in the daemon's cache")
                r["source"] = source_diff(tl_kernel.get_kernel_source(), src_served)
                r["check"] = check(torch, c, k, tl_kernel, dev)
                r["device"] = device_times(torch, c, k, tl_kernel, dev, args.rounds)
                r["host"] = host_times(torch, c, k, tl_kernel, dev, args.rounds, args.host_calls)
                r["status"] = "ok" if r["check"]["ok"] and r["source"]["equal"] and r["device"]["ratio"] <= 1.03 and r["host"]["ratio"] <= 1.0 else "MISS"
            except Exception as exc:
                r["status"] = "FAILED"
                r["reason"] = f"{type(exc).__name__}: {exc}"
                r["traceback"] = traceback.format_exc(limit=6)
            print(f"  {c.name}: {r['status']}" + (f" ({r['reason']})" if r["status"] == "FAILED" else ""), flush=True)
        pool.shutdown(wait=True)
    finally:
        for d in daemons:
            d.stop()
    total = time.perf_counter() - t_start

    lines = [
        f"{'case':24} {'styles':42} {'check rel err srv/tl':>22} {'source':>10} {'dev us srv/tl':>17} {'ratio':>6} {'host us srv/tl':>15} {'ratio':>6}  status"
    ]
    for c in cases:
        r = results[c.name]
        styles = ", ".join(c.styles)[:42]
        if r["status"] == "FAILED":
            lines.append(f"{c.name:24} {styles:42} FAILED: {r['reason'][:160]}")
            continue
        ch, src, dv, ho = r["check"], r["source"], r["device"], r["host"]
        srctext = "equal" if src["equal"] else f"{src['changed_lines']} lines"
        lines.append(
            f"{c.name:24} {styles:42} {ch['served']['rel']:10.2e}/{ch['tilelang']['rel']:.2e} {srctext:>10} {dv['served_us']:8.1f}/{dv['tilelang_us']:<8.1f} {dv['ratio']:6.3f} {ho['served_us']:7.1f}/{ho['tilelang_us']:<7.1f} {ho['ratio']:6.3f}  {r['status']}"
        )
    summary = {
        "cases": len(cases),
        "ok": sum(r["status"] == "ok" for r in results.values()),
        "failed": sum(r["status"] == "FAILED" for r in results.values()),
        "seconds": round(total, 1),
    }
    lines.append(
        f"{summary['ok']} of {summary['cases']} ok, {summary['failed']} failed, in {total:.0f} s. ok: rel err under the case's tolerance on both sides and the poisoned out=, same CUDA source, device time within 3%, host time at most TileLang's."
    )
    for c in cases:
        src = results[c.name].get("source")
        if src and not src["equal"]:
            lines.append(f"--- {c.name}: generated CUDA differs\n{src['diff_head']}")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "work_dir": str(work), "results": list(results.values())}, indent=1, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
