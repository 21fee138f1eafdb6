"""transformers models kernelized with served kernels, against HF eager (sdpa) and torch.compile.

    python benchmark/hf_models.py                  # CUDA host, bf16, the default daemon ($KERNEL_SERVICE_SOCKET)
    python benchmark/hf_models.py --json out.json  # the table, and the rows as JSON
    python benchmark/hf_models.py --small          # anywhere: tiny models, float32, target "c", a private daemon

Workloads (random weights, no download):
- `llama prefill`: a 2-layer Llama-3-8B-shaped LlamaForCausalLM (hidden 4096, 32/8 heads of 128,
  FFN 14336, vocab 128256), one forward of 2048 tokens at batch 1 (no cache);
- `llama generate`: the same model, `generate` of 128 new tokens (greedy, exactly 128) after a
  128-token prompt, at batch 1 and 8, and at batch 8 left-padded (`b8 padded`: prompts of 64 to
  128 tokens, as a tokenizer pads a batch for generate);
- `modernbert`: a ModernBERT-base-shaped encoder (22 layers, hidden 768, 12 heads, local
  attention 128 every third layer global), batch 32 x 512 tokens, right-padded to random lengths
  in [256, 512] (an attention_mask).

Variants, each on its own copy of the same weights: `eager` (transformers' sdpa), `compile`
(torch.compile of that model: `model.compile()`; generate compiles the forward it calls),
`compile-ro` (the same in mode "reduce-overhead", CUDA graphs; for generate, a static cache, with
which transformers compiles the decode forward in that mode itself), `kernel-service`
(`client.integrations.hf.kernelize(model, backend="kernel-service")`) and, for the forwards
`kernel-service-graphs` (the same with `graphs=[(batch, tokens)]`: the forward captured in a
CUDA graph at kernelize and replayed; for generate `[(batch, 1)]`, its decode steps with a static
cache, captured at the second step). `ready_s` is the time from
the untouched model to its first output with its CUDA graphs (kernelize's prefetch and capture,
or compile's first call, included; reduce-overhead records a forward's graph at its second call,
so it is called twice), in this process, after the variants before it; `fresh_ready_s` the same
in a fresh process of this script on the caches this run filled (the daemon's, the Inductor
directory), its imports and model made before the clock starts, as a restarted server's are
(compile-ro and kernel-service-graphs). Then --rounds rounds each time every variant in turn,
--reps runs each: `ms` is the median over the rounds of each round's median, `spread_ms` the lowest and highest round. Outputs
are compared with eager (`max_diff`: logits / hidden states at non-padded positions; generate:
the fraction of generated tokens equal to eager's). kernel-service is made last: transformers
shares `apply_rotary_pos_emb` between models of a family, so kernelizing swaps it process-wide;
the other variants run with the modeling module's own put back.

A padded batch is one varlen `attention` call per layer in eager mode (sliding layers with their
window); under torch.compile a padded mask keeps sdpa (reading it is data-dependent), so
`modernbert` compares kernel-service eager with compile.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import client  # noqa: E402
import client.integrations.hf as hf  # noqa: E402
from devtools.bytecode import compile_tree  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, ModernBertConfig, ModernBertModel  # noqa: E402

VARIANTS = ("eager", "compile", "compile-ro", "kernel-service", "kernel-service-graphs")  # served last (see above)
SERVED = ("kernel-service", "kernel-service-graphs")
FRESH = ("compile-ro", "kernel-service-graphs")  # made ready again in a fresh process (fresh_ready)
COMPILE_MODES = {"compile": None, "compile-ro": "reduce-overhead"}


def llama_config(small: bool) -> LlamaConfig:
    if small:
        return LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0
        )
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        pad_token_id=0,
    )


def bert_config(small: bool) -> ModernBertConfig:
    if small:
        return ModernBertConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            global_attn_every_n_layers=2,
            local_attention=8,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        )
    return ModernBertConfig(
        vocab_size=50368,
        hidden_size=768,
        intermediate_size=1152,
        num_hidden_layers=22,
        num_attention_heads=12,
        global_attn_every_n_layers=3,
        local_attention=128,
        pad_token_id=50283,
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps):
    out, times = None, []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def prepare(model, variant, c, buckets, generate):
    """`model` (untouched) made into the variant, in place; `generate`: the workload is generate
    (compile-ro then lets generate compile its decode steps, as transformers advises)."""
    if variant == "compile-ro" and generate:
        # A static cache makes generate torch.compile its decode forward in mode reduce-overhead
        # (its default CompileConfig); compiling the model too would compile it twice.
        model.generation_config.cache_implementation = "static"
    elif variant in COMPILE_MODES:
        model.compile(mode=COMPILE_MODES[variant])
    elif variant in SERVED:
        graphs = buckets if variant == "kernel-service-graphs" else None
        hf.kernelize(model, client=c, backend="kernel-service", strict=False, graphs=graphs)
        if model.kernel_service.backend != "kernel-service":
            raise SystemExit(f"kernelize chose {model.kernel_service.backend}: {model.kernel_service.reason}")
    return model


@contextlib.contextmanager
def own_rope(variant):
    """Runs a variant other than kernel-service with the modeling modules' own
    `apply_rotary_pos_emb`, which kernelize replaced process-wide."""
    from transformers.models.llama import modeling_llama
    from transformers.models.modernbert import modeling_modernbert

    swapped = [(m, m.apply_rotary_pos_emb) for m in (modeling_llama, modeling_modernbert) if getattr(m.apply_rotary_pos_emb, "kernel_service", False)]
    if variant not in SERVED:
        for module, wrapper in swapped:
            module.apply_rotary_pos_emb = wrapper.__wrapped__
    try:
        yield
    finally:
        for module, wrapper in swapped:
            module.apply_rotary_pos_emb = wrapper


@dataclasses.dataclass
class Workload:
    name: str
    part: str  # what --only names: "prefill", "generate" or "modernbert"
    family: str  # the base model it runs: "llama" or "modernbert"
    inputs: object
    call: Callable  # (model, inputs) -> the output compared with eager's
    compare: Callable  # (output, eager's) -> {"max_diff": ...} or {"same_tokens": ...}
    extra: dict
    buckets: list | None  # kernel-service-graphs' (batch, tokens) graphs; None: no such variant
    generate: bool = False


def workloads(small: bool, device) -> list[Workload]:
    """Every workload, its inputs drawn in this order from one seed, whichever run: a fresh
    process's (fresh_ready) are the same as the main run's."""
    g = torch.Generator().manual_seed(0)
    vocab = llama_config(small).vocab_size
    n = 16 if small else 2048
    out = [
        Workload(
            "llama prefill",
            "prefill",
            "llama",
            torch.randint(3, vocab, (1, n), generator=g).to(device),
            lambda m, x: m(x, use_cache=False).logits,
            logits_diff,
            {"batch": 1, "tokens": n},
            buckets=None if small else [(1, n)],  # graphs need CUDA
        )
    ]
    prompt, new = (8, 8) if small else (128, 128)
    for batch, padded in ((1, False), (8, False), (8, True)):
        ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(device)
        mask = torch.ones_like(ids)
        if padded:  # left padding: each prompt's own length, from half the prompt to all of it
            pads = torch.randint(0, prompt // 2 + 1, (batch,), generator=g)
            mask = (torch.arange(prompt)[None, :] >= pads[:, None]).to(device=device, dtype=torch.long)

        def gen(m, x, new=new, mask=mask):
            return m.generate(x, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

        def same(out, ref, prompt=prompt):
            return {"same_tokens": float((out[:, prompt:] == ref[:, prompt:]).float().mean())}

        name = f"llama generate b{batch}" + (" padded" if padded else "")
        extra = {"batch": batch, "new_tokens": new, "padded": padded}
        out.append(Workload(name, "generate", "llama", ids, gen, same, extra, buckets=None if small else [(batch, 1)], generate=True))
    batch, n = (4, 12) if small else (32, 512)
    ids = torch.randint(3, min(bert_config(small).vocab_size, 50000), (batch, n), generator=g).to(device)
    lens = torch.randint(n // 2, n + 1, (batch,), generator=g)
    mask = (torch.arange(n)[None, :] < lens[:, None]).to(device=device, dtype=torch.long)

    def hidden_diff(out, ref):
        valid = mask.bool()
        return {"max_diff": float((out[valid].float() - ref[valid].float()).abs().max())}

    out.append(
        Workload(
            "modernbert",
            "modernbert",
            "modernbert",
            (ids, mask),
            lambda m, x: m(input_ids=x[0], attention_mask=x[1]).last_hidden_state,
            hidden_diff,
            {"batch": batch, "tokens": n, "padded": True},
            buckets=None if small else [(batch, n)],
        )
    )
    return out


def logits_diff(out, ref):
    return {"max_diff": float((out.float() - ref.float()).abs().max())}


def base_model(family: str, small: bool, device, dtype):
    torch.manual_seed(0)
    cls, cfg = (LlamaForCausalLM, llama_config(small)) if family == "llama" else (ModernBertModel, bert_config(small))
    with torch.device(device):
        return cls(cfg).to(dtype).eval()


def grad_off(w: Workload):
    """generate as callers run it (transformers' generate is itself under no_grad); the forwards
    under inference_mode. graphs.step_capture serves both."""
    return torch.no_grad() if w.generate else torch.inference_mode()


def make_ready(w: Workload, model, variant: str, c, device) -> float:
    """Seconds from the untouched `model` to the variant's first output with its CUDA graphs
    (kernelize's prefetch and capture, or compile's first calls, included): reduce-overhead
    records a forward's graph at its second call, so it is run twice (generate's first call
    records its decode step's)."""
    sync(device)
    t = time.perf_counter()
    prepare(model, variant, c, w.buckets, w.generate)
    with grad_off(w), own_rope(variant):
        for _ in range(2 if variant == "compile-ro" and not w.generate and device.type == "cuda" else 1):
            w.call(model, w.inputs)
    sync(device)
    return time.perf_counter() - t


def run_workload(w: Workload, base, device, reps, rounds, c) -> dict[str, dict]:
    """Every variant of `base` on one workload: its row by variant."""
    variants = [v for v in VARIANTS if w.buckets is not None or v != "kernel-service-graphs"]
    models, ready = {}, {}
    for variant in variants:
        models[variant] = model = copy.deepcopy(base)
        ready[variant] = make_ready(w, model, variant, c, device)
        print(f"  {w.name:<26} {variant:<22} ready {ready[variant]:8.2f} s", flush=True)
        if variant in SERVED:
            model.kernel_service.ready()  # a router's other builds: timed rounds run every kernel they will run
    rounds_s, outs, rows = {v: [] for v in variants}, {}, {}
    for r in range(rounds):  # alternating: a drift of the host's speed reaches every variant alike
        for variant in variants:
            with grad_off(w), own_rope(variant):
                outs[variant], sec = timed(functools.partial(w.call, models[variant], w.inputs), device, reps)
            rounds_s[variant].append(sec)
        print(f"  {w.name:<26} round {r + 1}: " + ", ".join(f"{v} {rounds_s[v][-1] * 1e3:.3f} ms" for v in variants), flush=True)
    for variant in variants:
        ms = [round(sec * 1e3, 3) for sec in rounds_s[variant]]
        row = {
            "workload": w.name,
            "variant": variant,
            "ready_s": round(ready[variant], 3),
            "ms": statistics.median(ms),
            "spread_ms": [min(ms), max(ms)],
            "rounds_ms": ms,
            **w.extra,
        }
        row.update(w.compare(outs[variant], outs["eager"]))
        if variant in SERVED:
            r = models[variant].kernel_service
            row["swapped"] = len(r.swapped)
            row["kept"] = dict(r.kept)
            row["fallbacks"] = dict(r.fallbacks)
            if r.graphs is not None:
                row["graphs"] = {
                    "buckets": r.graphs.buckets,
                    "replays": sum(r.graphs.replays.values()),
                    "uncaptured": dict(r.graphs.uncaptured),
                    "capture_s": round(r.graphs.capture_s, 3),
                    "head": r.graphs.head,
                }
        rows[variant] = row
    models.clear()
    return rows


def fresh_ready(w: Workload, variants: list[str], small: bool, socket: str | None) -> dict[str, float]:
    """Each of FRESH's variants made ready in a fresh process of this script on the caches this
    run has filled (the daemon's, the Inductor directory): its imports and untouched model are
    made before the clock starts, as a restarted server's are. A process that fails is reported
    and left out (the run's other figures stand)."""
    out = {}
    for variant in (v for v in FRESH if v in variants):
        cmd = [sys.executable, __file__, "--fresh-ready", w.name, variant, *(["--small"] if small else []), *(["--socket", socket] if socket else [])]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        except subprocess.TimeoutExpired:
            print(f"  {w.name:<26} {variant:<22} the fresh process ran past 900 s: left out", file=sys.stderr, flush=True)
            continue
        last = done.stdout.strip().splitlines()[-1:] or [""]
        if done.returncode != 0 or not last[0].startswith("{"):
            print(f"  {w.name:<26} {variant:<22} the fresh process failed (rc {done.returncode}): left out\n{done.stderr[-3000:]}", file=sys.stderr, flush=True)
            continue
        out[variant] = json.loads(last[0])["ready_s"]
        print(f"  {w.name:<26} {variant:<22} ready {out[variant]:8.2f} s in a fresh process", flush=True)
    return out


def fresh_ready_child(name: str, variant: str, small: bool, socket: str | None) -> None:
    device = torch.device("cpu" if small else "cuda")
    w = next(w for w in workloads(small, device) if w.name == name)
    model = base_model(w.family, small, device, torch.float32 if small else torch.bfloat16)
    c = client.connect(socket) if socket else client.default_client()
    print(json.dumps({"ready_s": round(make_ready(w, model, variant, c, device), 3)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny models, float32, on the CPU (target 'c'), with a daemon of its own")
    parser.add_argument("--socket", help="the daemon's socket (default: $KERNEL_SERVICE_SOCKET or the default socket; --small starts one)")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per variant and round (default 10, --small 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant in turn (default 3)")
    parser.add_argument("--only", choices=("prefill", "generate", "modernbert"), action="append", help="run only these workloads")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--fresh-ready", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)  # fresh_ready's child
    args = parser.parse_args()
    small = args.small
    if args.fresh_ready:
        return fresh_ready_child(*args.fresh_ready, small, args.socket)
    reps = args.reps or (2 if small else 10)
    if reps < 1 or args.rounds < 1:
        parser.error("--reps and --rounds take a whole number of at least 1")
    # The compiled copies of a model share its code objects, and every workload's and variant's
    # graphs count against one per-code limit: past it dynamo runs that code eagerly, unsaid.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    device = torch.device("cpu" if small else "cuda")
    dtype = torch.float32 if small else torch.bfloat16
    if not small and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --small for the CPU smoke path")
    daemon = None
    if small and not args.socket:
        from devtools.launch import DaemonProcess

        base_dir = Path(tempfile.mkdtemp(prefix="hf-bench-"))
        daemon = DaemonProcess(base_dir / "cache", "--target", "c", workers=2, log_path=base_dir / "daemon.log").start(timeout=120)
        args.socket = str(daemon.socket)
    c = client.connect(args.socket) if args.socket else client.default_client()
    only = set(args.only or ("prefill", "generate", "modernbert"))
    compile_tree()  # fresh_ready's processes import this tree as an installed client's (devtools/bytecode.py)
    rows: list[dict] = []
    family, base = None, None
    try:
        for w in workloads(small, device):
            if w.part not in only:
                continue
            if w.family != family:
                family, base = None, None  # the last model's memory back first
                family, base = w.family, base_model(w.family, small, device, dtype)
            by_variant = run_workload(w, base, device, reps, args.rounds, c)
            for variant, sec in fresh_ready(w, list(by_variant), small, args.socket).items():
                by_variant[variant]["fresh_ready_s"] = sec
            rows.extend(by_variant.values())
    finally:
        if daemon is not None:
            daemon.stop()
    base = {v: {r["workload"]: r["ms"] for r in rows if r["variant"] == v} for v in ("eager", "compile", "compile-ro")}
    print(f"\n{'workload':<26} {'variant':<22} {'ready s':>9} {'fresh':>6} {'ms':>10} {'spread ms':>17} {'x eager':>8} {'x compile':>10} {'x c-ro':>7}  check")
    for r in rows:
        for v, field in (("eager", "x_eager"), ("compile", "x_compile"), ("compile-ro", "x_compile_ro")):
            r[field] = round(base[v][r["workload"]] / r["ms"], 3) if r["workload"] in base[v] else None
        check = f"max_diff {r['max_diff']:.3g}" if "max_diff" in r else f"same tokens {r['same_tokens']:.0%}"
        spread = f"{r['spread_ms'][0]:.3f}-{r['spread_ms'][1]:.3f}"
        fresh = f"{r['fresh_ready_s']:.2f}" if "fresh_ready_s" in r else "-"
        print(
            f"{r['workload']:<26} {r['variant']:<22} {r['ready_s']:>9.2f} {fresh:>6} {r['ms']:>10.3f} {spread:>17} {r['x_eager']:>8.2f} "
            f"{r['x_compile'] or 0:>10.2f} {r['x_compile_ro'] or 0:>7.2f}  {check}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
