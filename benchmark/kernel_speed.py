"""Speed and correctness of the kernel zoo on a CUDA GPU, against torch's best path.

    python benchmark/kernel_speed.py [--target auto|sm_90a] [--only gemm,decode,attention,...] [--out DIR]

Builds every kernel through the service (a daemon on a fresh cache, the zoo
prefetched by the client, which loads each kernel as an agent would), checks
each against torch (kernels/reference.py), then times ours and torch with CUDA
events. Timing method: a `torch.cuda._sleep` is
queued first so the host enqueues all timed launches while the GPU is still
busy (host launch overhead stays out of the numbers), each launch sits between
its own pair of events, and the median is reported. Memory-bound kinds rotate
over enough input sets to exceed L2. Tolerances: relative Frobenius error
against an fp32/fp64 torch reference below 1e-2 for 16-bit dtypes (fp16/bf16
rounding of outputs is ~4e-3), 1e-4 for float32.

`decode` (in --only) times GEMMs of decode-sized M: each weight N x K is one
M=None build (the gemm kind routes each call to the build of its M range) called
at M = 1 ... 4096, against F.linear (cuBLAS), both under CUDA graphs (20 calls
captured, replays timed with events, median) and rotating weights past L2, so the
numbers are what a decode step's graph sees; it prints the ratio and the weight
bytes per second each achieves. `kv_attention` (in --only) adds decode attention against a
KV cache the same way: one query row per sequence, contiguous and paged caches, batch x KV
length, against SDPA's fastest backend on the contiguous cache, with the KV-cache bytes read
per second.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from devtools.launch import DaemonProcess  # noqa: E402
from kernels import reference  # noqa: E402

PEAK_HBM = 4.8e12  # H200 datasheet bytes/s; the measured copy is printed beside it
DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

# (kind, label, params, variants): each variant is a dict of tiling overrides.
GEMM_VARIANTS = [{}, {"block_M": 256, "block_N": 128, "block_K": 64, "num_stages": 3}]
ATTN_VARIANTS = [{}, {"block_N": 64, "num_stages": 3}, {"block_M": 64, "block_N": 128, "threads": 128}]
ROW_VARIANTS = {4096: [{"threads": 128}, {"threads": 256}, {"threads": 512}], 14336: [{"threads": 256}, {"threads": 512}, {"threads": 1024}]}
CASES = [
    ("gemm", "llama3-8b up 4096x14336x4096 fp16 NT", dict(M=4096, N=14336, K=4096, dtype="float16", trans_b=True), GEMM_VARIANTS),
    ("gemm", "qwen2.5-7b up 4096x18944x3584 fp16 NT", dict(M=4096, N=18944, K=3584, dtype="float16", trans_b=True), [{}]),
    ("attention", "b1 s4096 h32/8 d128 fp16", dict(batch=1, heads=32, kv_heads=8, seq_len=4096, head_dim=128, causal=False, dtype="float16"), ATTN_VARIANTS),
    (
        "attention",
        "b1 s4096 h32/8 d128 fp16 causal",
        dict(batch=1, heads=32, kv_heads=8, seq_len=4096, head_dim=128, causal=True, dtype="float16"),
        ATTN_VARIANTS,
    ),
    ("rmsnorm", "4096x4096 bf16", dict(M=None, N=4096, dtype="bfloat16"), ROW_VARIANTS[4096]),
    ("rmsnorm", "4096x14336 bf16", dict(M=None, N=14336, dtype="bfloat16"), ROW_VARIANTS[14336]),
    ("swiglu", "4096x4096 bf16", dict(M=None, N=4096, dtype="bfloat16"), [{}]),
    ("swiglu", "4096x14336 bf16", dict(M=None, N=14336, dtype="bfloat16"), [{}, {"block_M": 4, "block_N": 1024}]),
    ("swiglu", "4096x18944 bf16", dict(M=None, N=18944, dtype="bfloat16"), [{}]),
    ("softmax", "4096x4096 bf16", dict(M=None, N=4096, dtype="bfloat16"), ROW_VARIANTS[4096]),
    ("softmax", "4096x14336 bf16", dict(M=None, N=14336, dtype="bfloat16"), ROW_VARIANTS[14336]),
]
# Decode GEMMs (issue #18): weight N x K (trans_b, fp16), one M=None build each, timed at these M.
DECODE = [(14336, 4096), (4096, 4096), (6144, 4096), (4096, 14336)]
DECODE_M = (1, 8, 32, 128, 512, 4096)
# Decode against a KV cache (kv_attention): one query row per sequence, GQA 32/8, d=128, fp16,
# every sequence full (SDPA takes no per-sequence lengths); one build per cache layout.
KV_DECODE_PARAMS = dict(batch=None, q_len=1, heads=32, kv_heads=8, head_dim=128, dtype="float16")
KV_DECODE = [
    ("contiguous", KV_DECODE_PARAMS),
    ("contig_cp", dict(KV_DECODE_PARAMS, load="cp_async", block_N=64)),
    ("paged16", dict(KV_DECODE_PARAMS, paged=True)),
    ("paged64", dict(KV_DECODE_PARAMS, paged=True, page_size=64)),
]
KV_DECODE_BATCHES = (1, 8, 64)
KV_DECODE_LENGTHS = (1024, 4096, 16384, 32768)
ROWS = 4096  # runtime M for the dynamic memory-bound kernels
# Ragged shapes: correctness only (not multiples of any tile; dynamic sizes at two values).
RAGGED = [
    ("gemm", dict(M=None, N=200, K=72, dtype="float16", bias=True, act="gelu", trans_b=True), [dict(M=1000), dict(M=7)]),
    ("gemm", dict(M=None, N=136, K=40, dtype="bfloat16", act="silu"), [dict(M=333)]),
    ("gemm", dict(M=None, N=96, K=36, dtype="float32", bias=True, act="relu"), [dict(M=130)]),
    (
        "attention",
        dict(batch=None, heads=4, kv_heads=2, seq_len=None, head_dim=64, causal=True, dtype="bfloat16"),
        [dict(batch=2, seq_len=1000), dict(batch=1, seq_len=77)],
    ),
    ("attention", dict(batch=None, heads=8, kv_heads=1, seq_len=None, head_dim=128, causal=False, dtype="float16"), [dict(batch=3, seq_len=333)]),
    ("rmsnorm", dict(M=None, N=1000, dtype="float16"), [dict(M=37)]),
    ("softmax", dict(M=None, N=1000, dtype="float32"), [dict(M=37)]),
    ("swiglu", dict(M=None, N=1000, dtype="bfloat16"), [dict(M=37)]),
    ("softmax", dict(M=None, N=16384, dtype="float16"), [dict(M=5)]),
    ("rmsnorm", dict(M=None, N=4104, dtype="bfloat16"), [dict(M=9)]),
    # Every gemm schedule, and the router of M ranges, at sizes no multiple of any tile.
    ("gemm", dict(M=None, N=4104, K=4104, dtype="float16", trans_b=True), [dict(M=1), dict(M=7), dict(M=33), dict(M=129), dict(M=1000)]),
    (
        "gemm",
        dict(M=None, N=1000, K=1000, dtype="bfloat16", bias=True, act="gelu", residual=True),
        [dict(M=1), dict(M=7), dict(M=33), dict(M=129), dict(M=1000)],
    ),
    (
        "gemm",
        dict(M=None, N=4104, K=4104, dtype="float16", trans_b=True, schedule="gemv", block_M=1, block_N=8, block_K=1024),
        [dict(M=1), dict(M=7), dict(M=33)],
    ),
    (
        "gemm",
        dict(M=None, N=1000, K=1000, dtype="bfloat16", trans_b=True, bias=True, act="silu", residual=True, schedule="gemv", block_M=4, block_N=4, block_K=512),
        [dict(M=1), dict(M=7), dict(M=129)],
    ),
    (
        "gemm",
        dict(
            M=None,
            N=1000,
            K=1000,
            dtype="float16",
            bias=True,
            act="relu",
            schedule="splitk",
            block_M=16,
            block_N=64,
            block_K=256,
            num_stages=4,
            threads=128,
            split_k=1,
        ),
        [dict(M=1), dict(M=7), dict(M=33), dict(M=1000)],
    ),
    (
        "gemm",
        dict(
            M=None,
            N=4104,
            K=4104,
            dtype="bfloat16",
            trans_b=True,
            residual=True,
            schedule="splitk",
            block_M=128,
            block_N=128,
            block_K=64,
            num_stages=5,
            threads=256,
            split_k=4,
        ),
        [dict(M=1), dict(M=129), dict(M=1000)],
    ),
    (
        "gemm",
        dict(
            M=None,
            N=1000,
            K=1000,
            dtype="float16",
            trans_b=True,
            bias=True,
            act="gelu",
            schedule="splitk",
            block_M=64,
            block_N=64,
            block_K=128,
            num_stages=4,
            threads=128,
            split_k=3,
        ),
        [dict(M=7), dict(M=129)],
    ),
    # Non-default tilings that validation accepts must also compute the right thing.
    ("gemm", dict(M=None, N=72, K=88, dtype="float16", block_M=32, block_N=32, block_K=32, threads=128, num_stages=2), [dict(M=70)]),
    ("gemm", dict(M=None, N=72, K=88, dtype="float16", block_M=64, block_N=16, block_K=16, threads=128, num_stages=2), [dict(M=70)]),
    ("gemm", dict(M=None, N=272, K=200, dtype="bfloat16", block_M=16, block_N=256, block_K=64, threads=256, trans_b=True), [dict(M=70)]),
    ("gemm", dict(M=None, N=72, K=200, dtype="float16", block_M=256, block_N=64, block_K=64, threads=128, num_stages=2), [dict(M=300)]),
    ("gemm", dict(M=None, N=264, K=264, dtype="float16", block_M=64, block_N=256, block_K=128, threads=256, num_stages=1), [dict(M=100)]),
    (
        "attention",
        dict(batch=None, heads=2, kv_heads=1, seq_len=None, head_dim=16, dtype="float16", causal=True, block_N=32, threads=128),
        [dict(batch=1, seq_len=200)],
    ),
    ("attention", dict(batch=None, heads=2, kv_heads=2, seq_len=None, head_dim=96, dtype="bfloat16", block_N=256, threads=128), [dict(batch=1, seq_len=300)]),
    ("attention", dict(batch=None, heads=2, kv_heads=1, seq_len=None, head_dim=192, dtype="float16", causal=True), [dict(batch=1, seq_len=300)]),
    ("attention", dict(batch=None, heads=2, kv_heads=1, seq_len=None, head_dim=64, dtype="float16", block_N=32, num_stages=4), [dict(batch=2, seq_len=129)]),
    # Ragged seq_lens from the input maker; chunked prefill; pages in a random order.
    ("kv_attention", KV_DECODE_PARAMS, [dict(batch=7, max_kv=1111), dict(batch=1, max_kv=5)]),
    ("kv_attention", dict(KV_DECODE_PARAMS, paged=True), [dict(batch=7, max_kv=1111)]),
    ("kv_attention", dict(KV_DECODE_PARAMS, paged=True, page_size=64, dtype="bfloat16"), [dict(batch=3, max_kv=2000)]),
    ("kv_attention", dict(KV_DECODE_PARAMS, q_len=None, num_splits=4), [dict(batch=2, q_len=7, max_kv=1000)]),
    (
        "kv_attention",
        dict(KV_DECODE_PARAMS, q_len=None, heads=12, kv_heads=4, head_dim=64, dtype="bfloat16", paged=True, num_splits=3),
        [dict(batch=3, q_len=6, max_kv=500)],
    ),
]


def make_inputs(kind, p, rt):
    """Fresh random inputs on the GPU for static params p and runtime sizes rt."""
    return reference.make_inputs(kind, p, "cuda", runtime=rt, seed=int(torch.randint(1 << 30, ())))


def torch_paths(kind, p):
    """name -> callable(*ins): torch's fast paths for the same computation."""
    if kind == "gemm":
        return {"cuBLAS": (lambda a, b, *r: F.linear(a, b)) if p["trans_b"] else (lambda a, b, *r: a @ b)}
    if kind == "attention":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=p["causal"], enable_gqa=True
                ).transpose(1, 2)

        return {"SDPA-flash": flash}
    eps = p.get("eps", 1e-6)
    if kind == "rmsnorm":
        eager = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps)  # noqa: E731
        manual = lambda x, w: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w  # noqa: E731
        return {"eager": eager, "compile": torch.compile(manual)}
    if kind == "swiglu":
        f = lambda g, u: F.silu(g) * u  # noqa: E731
        return {"eager": f, "compile": torch.compile(f)}
    f = lambda x: torch.softmax(x, -1)  # noqa: E731
    return {"eager": f, "compile": torch.compile(lambda x: torch.softmax(x.float(), -1).to(x.dtype))}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---- timing --------------------------------------------------------------------


def bench(fn, arg_sets, reps=50, warmup=10):
    """Median ms of fn(*args) over reps, args rotating through arg_sets (defeats L2 reuse)."""
    for i in range(warmup):
        fn(*arg_sets[i % len(arg_sets)])
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda._sleep(50_000_000)  # ~25 ms of GPU busy-wait: the host enqueues everything below meanwhile
    for i, (a, b) in enumerate(ev):
        a.record()
        fn(*arg_sets[i % len(arg_sets)])
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in ev)
    return times[len(times) // 2]


def bench_graph(fn, arg_sets, calls=20, replays=7):
    """Median ms of one fn(*args) under a CUDA graph: `calls` calls (args rotating through
    arg_sets) captured once, each replay timed with events. What a decode step's graph sees:
    no host launch overhead, back-to-back kernels."""
    for args in arg_sets:
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[len(times) // 2]


DECODE_HEADER = f"{'N x K':12} {'M':>5} {'ours us':>8} {'cuBLAS us':>9} {'cuBLAS/ours':>11} {'ours TB/s':>9} {'cuBLAS TB/s':>11} {'err':>7}  build"


def decode_line(r):
    shape = f"{r['N']} x {r['K']}"
    return f"{shape:12} {r['M']:5} {r['ours_us']:8.1f} {r['cublas_us']:9.1f} {r['speed']:11.2f} {r['ours_TBs']:9.2f} {r['cublas_TBs']:11.2f} {r['err']:7.1e}  {r['build']}"


def decode_rows(kernels_by_shape):
    """Times each decode GEMM at every M in DECODE_M against F.linear; returns the rows and prints them."""
    rows = []
    print(DECODE_HEADER, flush=True)
    for (n, k), ker in kernels_by_shape.items():
        weight_bytes = n * k * 2
        copies = max(2, math.ceil(3 * 50e6 / weight_bytes))  # the weights rotate past the 50 MB L2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.float16) / math.sqrt(k) for _ in range(copies)]
        for m in DECODE_M:
            sets = [(torch.randn(m, k, device="cuda", dtype=torch.float16), w) for w in weights]
            err = rel_err(ker(*sets[0]), F.linear(sets[0][0].float(), sets[0][1].float()))
            ours = bench_graph(ker, sets)
            theirs = bench_graph(lambda a, w: F.linear(a, w), sets)
            build = ker.route(m).spec["params"]
            tiles = (
                f"{build['schedule']} {build['block_M']}x{build['block_N']}x{build['block_K']}"
                + (f" s{build['num_stages']}" if build["num_stages"] else "")
                + (f" sk{build['split_k']}" if (build["split_k"] or 1) > 1 else "")
            )
            row = dict(
                N=n,
                K=k,
                M=m,
                ours_us=ours * 1e3,
                cublas_us=theirs * 1e3,
                speed=theirs / ours,
                ours_TBs=weight_bytes / ours / 1e9,
                cublas_TBs=weight_bytes / theirs / 1e9,
                err=err,
                build=tiles,
            )
            rows.append(row)
            print(decode_line(row), flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows


def sdpa_decode_paths():
    """name -> callable(q, k, v) in [batch, seq, heads, dim]: SDPA's backends, GQA without copies."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def path(backend):
        def f(q, k, v):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)

        return f

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    return {"default": path(None), **{name: path(b) for name, b in backends.items()}}


KV_DECODE_HEADER = (
    f"{'layout':10} {'batch':>5} {'kv':>6} {'ours us':>8} {'SDPA us':>8} {'SDPA':>9} {'SDPA/ours':>9} {'ours TB/s':>9} {'SDPA TB/s':>9} {'err':>7}"
)


def kv_decode_line(r):
    return (
        f"{r['layout']:10} {r['batch']:5d} {r['kv']:6d} {r['ours_us']:8.1f} {r['sdpa'][r['sdpa_best']]:8.1f} {r['sdpa_best']:>9} {r['speed']:9.2f} "
        f"{r['ours_TBs']:9.2f} {r['sdpa_TBs']:9.2f} {r['err']:7.1e}"
    )


def kv_decode_rows(kernels_by_layout):
    """Each KV_DECODE kernel and SDPA at every batch x KV length; returns the rows and prints them."""
    h, kvh, d = KV_DECODE_PARAMS["heads"], KV_DECODE_PARAMS["kv_heads"], KV_DECODE_PARAMS["head_dim"]
    rows = []
    print(KV_DECODE_HEADER, flush=True)
    for b in KV_DECODE_BATCHES:
        for n in KV_DECODE_LENGTHS:
            kv_bytes = 2 * b * n * kvh * d * 2
            copies = max(2, min(20, math.ceil(3 * 50e6 / kv_bytes)))  # the caches rotate past the 50 MB L2
            q = torch.randn(copies, b, 1, h, d, device="cuda", dtype=torch.float16)
            k = torch.randn(copies, b, n, kvh, d, device="cuda", dtype=torch.float16)
            v = torch.randn(copies, b, n, kvh, d, device="cuda", dtype=torch.float16)
            lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
            dense = [(q[i], k[i], v[i]) for i in range(copies)]
            want = sdpa_decode_paths()["default"](*dense[0])
            theirs = {}
            for name, f in sdpa_decode_paths().items():
                try:
                    theirs[name] = bench_graph(f, dense) * 1e3
                except Exception as e:  # a backend that takes no such shape
                    print(f"SDPA {name} failed at batch {b} kv {n}: {e!r}"[:300], flush=True)
            best = min(theirs, key=theirs.get)
            for label, ker in kernels_by_layout.items():
                p = ker.spec["params"]
                if p["paged"]:  # the same keys, as pages at random places of one pool
                    ps = p["page_size"]
                    order = torch.randperm(copies * b * (n // ps), device="cuda")
                    kp = torch.empty(order.numel(), ps, kvh, d, device="cuda", dtype=torch.float16)
                    vp = torch.empty_like(kp)
                    kp[order], vp[order] = k.reshape(-1, ps, kvh, d), v.reshape(-1, ps, kvh, d)
                    table = order.reshape(copies, b, n // ps).to(torch.int32)
                    sets = [(q[i], kp, vp, lens, table[i]) for i in range(copies)]
                else:
                    sets = [(q[i], k[i], v[i], lens) for i in range(copies)]
                err = rel_err(ker(*sets[0]), want)
                us = bench_graph(ker, sets) * 1e3
                row = dict(
                    layout=label,
                    batch=b,
                    kv=n,
                    ours_us=us,
                    sdpa=theirs,
                    sdpa_best=best,
                    speed=theirs[best] / us,
                    ours_TBs=kv_bytes / us / 1e6,
                    sdpa_TBs=kv_bytes / theirs[best] / 1e6,
                    err=err,
                )
                rows.append(row)
                print(kv_decode_line(row), flush=True)
                del sets
            del q, k, v, dense
            torch.cuda.empty_cache()
    return rows


def work(kind, p, rt):
    """(flops, bytes) of one call: bytes are each input read once and the output written once."""
    size = torch.tensor([], dtype=DT[p["dtype"]]).element_size()
    if kind == "gemm":
        M = rt.get("M", p["M"])
        return 2 * M * p["N"] * p["K"], (M * p["K"] + p["N"] * p["K"] + M * p["N"]) * size
    if kind == "attention":
        b, s, h, d = p["batch"], p["seq_len"], p["heads"], p["head_dim"]
        f = 4 * b * h * s * s * d * (0.5 if p["causal"] else 1.0)
        return f, (2 * b * s * h * d + 2 * b * s * p["kv_heads"] * d) * size
    M, N = ROWS, p["N"]
    n = {"rmsnorm": 2, "swiglu": 3, "softmax": 2}[kind]
    return 0, n * M * N * size + (N * size if kind == "rmsnorm" else 0)


def copy_ms(nbytes):
    """ms of a device-to-device copy moving nbytes in all (read + write), rotating past L2."""
    n = int(nbytes // 2)
    bufs = [
        (torch.empty(n, dtype=torch.uint8, device="cuda").random_(), torch.empty(n, dtype=torch.uint8, device="cuda"))
        for _ in range(max(1, min(8, math.ceil(3 * 64e6 / nbytes))))
    ]
    return bench(lambda s, d: d.copy_(s), bufs, reps=30)


def copy_bandwidth():
    return (1 << 31) / (copy_ms(1 << 31) * 1e-3)


def _all_builds(kernel):
    """A prefetch result with every build of a router loaded (or the exception that met)."""
    if isinstance(kernel, Exception):
        return kernel
    try:
        return kernel.ready()
    except Exception as exc:  # noqa: BLE001 - reported as a failed build
        return exc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="auto")
    ap.add_argument("--only", default="", help="comma-separated kinds")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--compile-only", action="store_true", help="build every kernel (works without a GPU) and stop")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    torch.manual_seed(0)
    if not args.compile_only:
        print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)

    jobs = []  # (kind, label, params, variant_index)
    for kind, label, params, variants in CASES:
        if not only or kind in only:
            for vi, v in enumerate(variants):
                jobs.append(("perf", kind, label, {**params, **v}, vi))
    for kind, params, rts in RAGGED:
        if not only or kind in only:
            jobs.append(("ragged", kind, str(params), params, rts))
    if not only or "decode" in only:
        for n, k in DECODE:
            jobs.append(("decode", "gemm", f"{n} x {k}", dict(M=None, N=n, K=k, dtype="float16", trans_b=True), None))
    if not only or "kv_attention" in only:
        for label, params in KV_DECODE:
            jobs.append(("kv_decode", "kv_attention", label, params, None))
    t0 = time.time()
    with DaemonProcess(Path(tempfile.mkdtemp(prefix="ks-speed-")) / "cache", "--target", args.target) as daemon:
        results = daemon.client().prefetch([{"kind": j[1], **j[3], "target": args.target} for j in jobs])
        results = [_all_builds(k) for k in results]  # a router's other builds, while the daemon is up
    built = []
    for j, k in zip(jobs, results):
        if isinstance(k, Exception):  # a failed build is reported, not fatal to the rest
            print(f"BUILD FAILED {j[1]} {j[3]}: {k}"[:2000], flush=True)
        else:
            built.append((j, k, k.compile_seconds, k.spec["params"]))
    print(f"built {len(built)}/{len(jobs)} kernels through the service in {time.time() - t0:.1f}s", flush=True)
    if args.compile_only:
        return 0 if len(built) == len(jobs) else 1

    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw / 1e9:.0f} GB/s ({100 * bw / PEAK_HBM:.0f}% of {PEAK_HBM / 1e12:.1f} TB/s)", flush=True)

    rows, failures, copy_at_size = [], [], {}
    decode = decode_rows({tuple(map(int, label.split(" x "))): ker for (tag, kind, label, params, extra), ker, ctime, p in built if tag == "decode"})
    failures += [("gemm decode", r["N"], r["K"], r["M"], r["err"]) for r in decode if not r["err"] < 1e-2]
    kv_decode = kv_decode_rows({label: ker for (tag, kind, label, params, extra), ker, ctime, p in built if tag == "kv_decode"})
    failures += [("kv_attention decode", r["layout"], r["batch"], r["kv"], r["err"]) for r in kv_decode if not r["err"] < 1e-2]
    for (tag, kind, label, params, extra), ker, ctime, p in built:
        if tag in ("decode", "kv_decode"):
            continue
        tol = 1e-4 if p["dtype"] == "float32" else 1e-2
        if kind == "gemm" and p["dtype"] == "float32":
            tol = 5e-3  # tensor cores run fp32 GEMM in tf32
        if tag == "ragged":
            for rt in extra:
                ins = make_inputs(kind, p, rt)
                err = rel_err(ker(*ins), reference.reference(kind, p, ins))
                ok = err < tol
                print(f"{'ok  ' if ok else 'FAIL'} ragged {kind} {label} {rt}: rel err {err:.1e}", flush=True)
                if not ok:
                    failures.append((kind, label, rt, err))
            continue
        rt = {"M": ROWS}
        ins = make_inputs(kind, p, rt)
        err = rel_err(ker(*ins), reference.reference(kind, p, ins))
        if not err < tol:
            failures.append((kind, label, params, err))
        flops, nbytes = work(kind, p, rt)
        if nbytes not in copy_at_size:  # the copy of the same byte count: what HBM allows at this size
            copy_at_size[nbytes] = copy_ms(nbytes)
        n_sets = max(1, math.ceil(3 * 64e6 / nbytes))  # >= ~3x the 50 MiB L2 across the rotation
        sets = [ins] + [make_inputs(kind, p, rt) for _ in range(min(n_sets, 8) - 1)]
        ours = bench(ker, sets)
        theirs = {}
        for name, fn in torch_paths(kind, p).items():
            try:
                fn(*ins)
                theirs[name] = bench(fn, sets)
            except Exception as e:
                print(f"torch path {name} failed: {e!r}"[:500], flush=True)
        best_name = min(theirs, key=theirs.get) if theirs else "-"
        best = theirs.get(best_name, float("nan"))
        tiles = {k: p[k] for k in ("block_M", "block_N", "block_K", "num_stages", "threads") if k in p}
        rows.append(
            dict(
                kind=kind,
                shape=label,
                tiles=tiles,
                err=err,
                ours_ms=ours,
                torch=theirs,
                torch_best=best_name,
                torch_ms=best,
                speed=best / ours,
                tflops=flops / ours / 1e9 if flops else None,
                gbs=nbytes / ours / 1e6,
                hbm_pct=100 * nbytes / (ours * 1e-3) / PEAK_HBM,
                copy_pct=100 * copy_at_size[nbytes] / ours,
                compile_s=ctime,
            )
        )
        print(f"done {kind} {label} {tiles}: ours {ours:.4f} ms, torch {theirs}, err {err:.1e}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernel_speed.json"), "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "copy_GBs": bw / 1e9,
                "rows": rows,
                "decode": decode,
                "kv_decode": kv_decode,
                "failures": [str(x) for x in failures],
            },
            f,
            indent=1,
        )
    hdr = f"{'kind':9} {'shape':40} {'tiles':34} {'ours ms':>8} {'torch ms':>9} {'torch':>10} {'t/ours':>6} {'TFLOP/s':>8} {'GB/s':>6} {'%4.8T':>5} {'%copy':>5} {'err':>7}"
    lines = [
        f"copy bandwidth (2 GiB) {bw / 1e9:.0f} GB/s = {100 * bw / PEAK_HBM:.0f}% of 4.8 TB/s; t/ours > 1 means ours is faster;",
        "%4.8T = our bytes/s over 4.8 TB/s; %copy = a device copy moving the same bytes, in time, over ours",
        hdr,
    ]
    for r in rows:
        t = ",".join(f"{k[6:] if k.startswith('block_') else k[:6]}={v}" for k, v in r["tiles"].items())
        tf = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        lines.append(
            f"{r['kind']:9} {r['shape']:40} {t:34} {r['ours_ms']:8.4f} {r['torch_ms']:9.4f} {r['torch_best']:>10} {r['speed']:6.2f} {tf:>8} {r['gbs']:6.0f} {r['hbm_pct']:5.0f} {r['copy_pct']:5.0f} {r['err']:7.1e}"
        )
    if decode:
        lines += ["", "decode GEMMs (fp16, trans_b, one M=None build each), under CUDA graphs; TB/s = weight bytes / time", DECODE_HEADER]
        lines += [decode_line(r) for r in decode]
    if kv_decode:
        lines += [
            "",
            "decode attention (kv_attention, q_len=1, GQA 32/8, d=128, fp16), under CUDA graphs; SDPA: its fastest backend (enable_gqa);",
            "TB/s = KV-cache bytes / time",
            KV_DECODE_HEADER,
        ]
        lines += [kv_decode_line(r) for r in kv_decode]
    lines.append("correctness failures: " + (", ".join(map(str, failures)) if failures else "none"))
    text = "\n".join(lines)
    with open(os.path.join(args.out, "kernel_speed.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
