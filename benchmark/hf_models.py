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
the untouched model to its first output (kernelize's prefetch, or compile's first call,
included). Then --rounds rounds each time every variant in turn, --reps runs each: `ms` is the
median over the rounds of each round's median, `spread_ms` the lowest and highest round. Outputs
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
import json
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import client  # noqa: E402
import client.integrations.hf as hf  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, ModernBertConfig, ModernBertModel  # noqa: E402

VARIANTS = ("eager", "compile", "compile-ro", "kernel-service", "kernel-service-graphs")  # served last (see above)
SERVED = ("kernel-service", "kernel-service-graphs")
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


def prepare(base, variant, c, buckets, generate):
    """(model, seconds to make it): the variant's copy of `base`; `generate`: the workload is
    generate (compile-ro then lets generate compile its decode steps, as transformers advises)."""
    t = time.perf_counter()
    model = copy.deepcopy(base)
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
    return model, time.perf_counter() - t


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


def run_workload(name, base, inputs, call, compare, device, reps, rounds, c, rows, extra=None, buckets=None, generate=False):
    """Every variant of `base` on one workload; `buckets`: the (batch, tokens) graphs of the
    kernel-service-graphs variant (None: the workload has no such variant)."""
    variants = [v for v in VARIANTS if buckets is not None or v != "kernel-service-graphs"]
    # generate as callers run it (transformers' generate is itself under no_grad); the forwards
    # under inference_mode. graphs.step_capture serves both.
    grad_off = torch.no_grad if generate else torch.inference_mode
    models, ready = {}, {}
    for variant in variants:
        model, made = prepare(base, variant, c, buckets, generate)
        sync(device)
        t = time.perf_counter()
        with grad_off(), own_rope(variant):
            call(model, inputs)
        sync(device)
        models[variant], ready[variant] = model, made + time.perf_counter() - t
        print(f"  {name:<26} {variant:<22} ready {ready[variant]:8.2f} s", flush=True)
        if variant in SERVED:
            model.kernel_service.ready()  # a router's other builds: timed rounds run every kernel they will run
    rounds_s, outs = {v: [] for v in variants}, {}
    for r in range(rounds):  # alternating: a drift of the host's speed reaches every variant alike
        for variant in variants:
            with grad_off(), own_rope(variant):
                outs[variant], sec = timed(functools.partial(call, models[variant], inputs), device, reps)
            rounds_s[variant].append(sec)
        print(f"  {name:<26} round {r + 1}: " + ", ".join(f"{v} {rounds_s[v][-1] * 1e3:.3f} ms" for v in variants), flush=True)
    for variant in variants:
        ms = [round(sec * 1e3, 3) for sec in rounds_s[variant]]
        row = {
            "workload": name,
            "variant": variant,
            "ready_s": round(ready[variant], 3),
            "ms": statistics.median(ms),
            "spread_ms": [min(ms), max(ms)],
            "rounds_ms": ms,
            **(extra or {}),
        }
        row.update(compare(outs[variant], outs["eager"]))
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
        rows.append(row)
    models.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny models, float32, on the CPU (target 'c'), with a daemon of its own")
    parser.add_argument("--socket", help="the daemon's socket (default: $KERNEL_SERVICE_SOCKET or the default socket; --small starts one)")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per variant and round (default 10, --small 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant in turn (default 3)")
    parser.add_argument("--only", choices=("prefill", "generate", "modernbert"), action="append", help="run only these workloads")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    small = args.small
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
    rows: list[dict] = []
    g = torch.Generator().manual_seed(0)
    try:
        torch.manual_seed(0)
        if only & {"prefill", "generate"}:
            cfg = llama_config(small)
            with torch.device(device):
                base = LlamaForCausalLM(cfg).to(dtype).eval()

            def logits_diff(out, ref):
                return {"max_diff": float((out.float() - ref.float()).abs().max())}

            if "prefill" in only:
                n = 16 if small else 2048
                ids = torch.randint(3, cfg.vocab_size, (1, n), generator=g).to(device)
                run_workload(
                    "llama prefill",
                    base,
                    ids,
                    lambda m, x: m(x, use_cache=False).logits,
                    logits_diff,
                    device,
                    reps,
                    args.rounds,
                    c,
                    rows,
                    {"batch": 1, "tokens": n},
                    buckets=None if small else [(1, n)],  # graphs need CUDA
                )
            if "generate" in only:
                prompt, new = (8, 8) if small else (128, 128)
                for batch, padded in ((1, False), (8, False), (8, True)):
                    ids = torch.randint(3, cfg.vocab_size, (batch, prompt), generator=g).to(device)
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
                    run_workload(name, base, ids, gen, same, device, reps, args.rounds, c, rows, extra, buckets=None if small else [(batch, 1)], generate=True)
            del base
        if "modernbert" in only:
            cfg = bert_config(small)
            with torch.device(device):
                base = ModernBertModel(cfg).to(dtype).eval()
            batch, n = (4, 12) if small else (32, 512)
            ids = torch.randint(3, min(cfg.vocab_size, 50000), (batch, n), generator=g).to(device)
            lens = torch.randint(n // 2, n + 1, (batch,), generator=g)
            mask = (torch.arange(n)[None, :] < lens[:, None]).to(device=device, dtype=torch.long)

            def hidden_diff(out, ref):
                valid = mask.bool()
                return {"max_diff": float((out[valid].float() - ref[valid].float()).abs().max())}

            run_workload(
                "modernbert",
                base,
                (ids, mask),
                lambda m, x: m(input_ids=x[0], attention_mask=x[1]).last_hidden_state,
                hidden_diff,
                device,
                reps,
                args.rounds,
                c,
                rows,
                {"batch": batch, "tokens": n, "padded": True},
                buckets=None if small else [(batch, n)],
            )
    finally:
        if daemon is not None:
            daemon.stop()
    base = {v: {r["workload"]: r["ms"] for r in rows if r["variant"] == v} for v in ("eager", "compile", "compile-ro")}
    print(f"\n{'workload':<26} {'variant':<22} {'ready s':>9} {'ms':>10} {'spread ms':>17} {'x eager':>8} {'x compile':>10} {'x c-ro':>7}  check")
    for r in rows:
        for v, field in (("eager", "x_eager"), ("compile", "x_compile"), ("compile-ro", "x_compile_ro")):
            r[field] = round(base[v][r["workload"]] / r["ms"], 3) if r["workload"] in base[v] else None
        check = f"max_diff {r['max_diff']:.3g}" if "max_diff" in r else f"same tokens {r['same_tokens']:.0%}"
        spread = f"{r['spread_ms'][0]:.3f}-{r['spread_ms'][1]:.3f}"
        print(
            f"{r['workload']:<26} {r['variant']:<22} {r['ready_s']:>9.2f} {r['ms']:>10.3f} {spread:>17} {r['x_eager']:>8.2f} "
            f"{r['x_compile'] or 0:>10.2f} {r['x_compile_ro'] or 0:>7.2f}  {check}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
