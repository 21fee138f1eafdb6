"""Served kernels inside a compiled model: an fp16 Llama-style block, on a CUDA host.

    python benchmark/torch_ops.py [--configs llama8b,small] [--json out.json]

Starts a daemon (target auto) on a fresh cache, builds the block of
benchmark/llama_block.py from served kernels, checks it against torch at two
batch sizes, then runs it four ways:

  eager          the kernels called from Python, one launch at a time
  eager+graph    the same calls captured by hand in one torch.cuda.CUDAGraph, replayed
  compiled       torch.compile(fullgraph=True, dynamic=True)
  compiled+graph torch.compile(fullgraph=True, dynamic=True, mode="reduce-overhead")

Each is timed three ways per call, the four variants taking turns in every
round (so clock drift favours none), medians of --reps rounds of --iters calls:

  wall    back-to-back calls between CUDA events: host overhead counts wherever
          the CPU falls behind the GPU
  device  the same calls queued behind a long torch.cuda._sleep, so the GPU
          never waits for the host: the device work alone
  host    the CPU time to issue one call (measured while the GPU sleeps)

It also reports graph breaks (torch._dynamo.explain), compiled frames over both
batch sizes (1 = no recompile), what the compiled module's code launches
besides the served kernels, and compiled+graph / eager+graph (goal <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmark"))

import torch  # noqa: E402

from devtools.launch import DaemonProcess  # noqa: E402
from llama_block import BlockConfig, ServedBlock, kernel_specs, reference, rel_error  # noqa: E402

CONFIGS = {
    # Llama-3-8B's layer, prefill of 2 and 3 sequences of 1024 tokens (M = 2048, 3072).
    "llama8b": (BlockConfig(hidden=4096, heads=32, kv_heads=8, ffn=14336, seq_len=1024, dtype="float16", target="auto"), (2, 3)),
    # A 1B-class layer on 2 and 3 sequences of 64 tokens (M = 128, 192): launch-bound.
    "small": (BlockConfig(hidden=2048, heads=16, kv_heads=4, ffn=5632, seq_len=64, dtype="float16", target="auto"), (2, 3)),
}


SERVED_CALL = re.compile(r"^\s*(?:\w+ = )?torch\.ops\.kernel_service\.\w+\.(?:default|out)\(", re.M)
SLEEP_CYCLES = 200_000_000  # ~0.1 s at the H200's clock: longer than issuing --iters calls of any variant


def timed(variants: dict, iters: int, reps: int) -> dict:
    """{variant: {"wall", "device", "host"}} in ms per call, medians over `reps` rounds in which
    every variant takes its turn."""
    samples = {name: {"wall": [], "device": [], "host": []} for name in variants}
    for fn in variants.values():
        for _ in range(3):
            fn()
    for _ in range(reps):
        for name, fn in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples[name]["wall"].append(start.elapsed_time(end) / iters)

            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            host = (time.perf_counter() - t0) / iters * 1e3
            end.record()
            end.synchronize()
            samples[name]["device"].append(start.elapsed_time(end) / iters)
            samples[name]["host"].append(host)
    return {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}


def launches_besides_served_ops(code: str) -> list[str]:
    """Lines of Inductor's wrapper code (its call()) that launch or copy anything but the served kernels."""
    body = code[code.index("def call(") : code.index("runner = Runner") if "runner = Runner" in code else len(code)]
    keep = []
    for line in body.splitlines():
        line = line.strip()
        if (
            not line.startswith("#")
            and any(w in line for w in (".run(", "copy_", "clone", "extern_kernels", "aten.", "triton_"))
            and "kernel_service" not in line
        ):
            keep.append(line[:160])
    return keep


def run_config(c, name: str, cfg: BlockConfig, batches, iters: int, reps: int) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._inductor.utils import run_and_get_code

    t0 = time.perf_counter()
    specs = list(kernel_specs(cfg).values())
    results = c.prefetch(specs)  # cold kernels compile in parallel
    bad = [r for r in results if isinstance(r, Exception)]
    if bad:
        raise bad[0]
    block = ServedBlock(c, cfg)
    row = {"config": name, "cfg": cfg.__dict__, "batches": list(batches), "kernels_s": round(time.perf_counter() - t0, 2)}
    dtype = getattr(torch, cfg.dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(b, cfg.seq_len, cfg.hidden, device="cuda", dtype=dtype, generator=gen) for b in batches]
    with torch.inference_mode():
        want = [block(x) for x in xs]
        row["eager_rel_err"] = [rel_error(w, reference(block, x)) for w, x in zip(want, xs)]
        assert max(row["eager_rel_err"]) < 1e-2, row

        explained = torch._dynamo.explain(block)(xs[0])
        row["graph_breaks"] = explained.graph_break_count
        torch._dynamo.reset()
        _, codes = run_and_get_code(torch.compile(block, fullgraph=True, dynamic=True), xs[0])
        row["served_op_calls"] = sum(len(SERVED_CALL.findall(code)) for code in codes)
        row["other_launches"] = [line for code in codes for line in launches_besides_served_ops(code)]
        torch._dynamo.reset()

        t0 = time.perf_counter()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
        row["compiled_rel_err"] = [rel_error(compiled(x), w) for x, w in zip(xs, want)]
        row["compiled_frames"] = counter.frame_count
        row["compile_s"] = round(time.perf_counter() - t0, 2)

        t0 = time.perf_counter()
        graphed = torch.compile(block, fullgraph=True, dynamic=True, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            row["reduce_overhead_rel_err"] = [rel_error(graphed(x).clone(), w) for x, w in zip(xs, want)]
        row["reduce_overhead_compile_s"] = round(time.perf_counter() - t0, 2)

        x = xs[0]
        static = x.clone()
        block(static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = block(static)
        graph.replay()
        torch.cuda.synchronize()
        row["manual_graph_exact"] = bool(torch.equal(static_out, want[0]))

        row["ms"] = timed(
            {
                "eager": lambda: block(x),
                "eager+graph": graph.replay,
                "compiled": lambda: compiled(x),
                "compiled+graph": lambda: graphed(x),
            },
            iters,
            reps,
        )
        row["ratio_wall"] = row["ms"]["compiled+graph"]["wall"] / row["ms"]["eager+graph"]["wall"]
        row["ratio_device"] = row["ms"]["compiled+graph"]["device"] / row["ms"]["eager+graph"]["device"]
        row["compiled_frames_after"] = counter.frame_count
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmark/torch_ops.py needs a CUDA GPU")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ks-torch-ops-") as tmp:
        t0 = time.perf_counter()
        with DaemonProcess(Path(tmp) / "cache", "--target", "auto", workers=args.workers, log_path=Path(tmp) / "daemon.log") as d:
            print(f"daemon up in {time.perf_counter() - t0:.1f} s", flush=True)
            c = d.client()
            for name in args.configs.split(","):
                cfg, batches = CONFIGS[name]
                row = run_config(c, name, cfg, batches, args.iters, args.reps)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(
        f"\ntorch {torch.__version__}, {torch.cuda.get_device_name()}; ms per block call at the first batch size, "
        f"medians of {args.reps} rounds of {args.iters} calls; wall / device / host (see the docstring)"
    )
    print("| config | M | eager | eager+graph | compiled | compiled+graph | compiled+graph / eager+graph (wall, device) | breaks | frames |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ms = r["ms"]
        m = r["batches"][0] * r["cfg"]["seq_len"]
        cells = [f"{ms[v]['wall']:.3f} / {ms[v]['device']:.3f} / {ms[v]['host']:.3f}" for v in ("eager", "eager+graph", "compiled", "compiled+graph")]
        print(f"| {r['config']} | {m} | {' | '.join(cells)} | {r['ratio_wall']:.3f}, {r['ratio_device']:.3f} | {r['graph_breaks']} | {r['compiled_frames']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
