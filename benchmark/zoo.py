"""The published cold-build zoo, as kernel specs for our kernels/ kinds.

One scale unit is 42 distinct kernels:
  24 GEMMs      qkv and up projections (B as [N, K], the layout of linear
                weights) of four model sizes, three tilings each
   6 attention  GQA forwards, three head configurations x block_M 64 / 128
   4 RMSNorm, 4 SwiGLU, 4 row softmax
Every kernel gets its own M = 256 + 128*k (seq_len for attention), k running
over the whole zoo, so no two kernels share a cache key. `salt` shifts k past
every kernel of every smaller salt, so runs with different salts never hit
each other's caches.

A spec is the dict `client.prefetch` takes: {"kind", "target", **params}.
"""

from __future__ import annotations

UNIT = 42
M_BASE, M_STEP = 256, 128


# (name, hidden, ffn, heads, kv_heads, head_dim): heads from the models' real configs.
MODELS = (
    ("llama-3.2-1b-like", 2048, 5632, 32, 8, 64),
    ("qwen2.5-7b", 3584, 18944, 28, 4, 128),
    ("llama-3-8b", 4096, 14336, 32, 8, 128),
    ("qwen2.5-14b-like", 5120, 13824, 40, 8, 128),
)
ATTENTION_HEADS = ((32, 8, 128), (28, 4, 128), (40, 8, 128))
SOFTMAX_ROWS = (1024, 2048, 4096, 8192)  # attention-score row lengths

# Three tilings per GEMM. CUDA: Hopper-sized tiles that pass the gemm kind's
# register and shared-memory checks. CPU: the C form only takes block sizes.
GEMM_TILINGS = {
    "cuda": (
        {"block_M": 128, "block_N": 256, "block_K": 64, "num_stages": 3, "threads": 256},
        {"block_M": 128, "block_N": 128, "block_K": 64, "num_stages": 4, "threads": 256},
        {"block_M": 64, "block_N": 128, "block_K": 64, "num_stages": 4, "threads": 128},
    ),
    "c": (
        {"block_M": 32, "block_N": 32, "block_K": 32},
        {"block_M": 64, "block_N": 64, "block_K": 32},
        {"block_M": 16, "block_N": 64, "block_K": 64},
    ),
}


def unit_shapes(cpu: bool) -> list[tuple[str, dict]]:
    """The 42 (kind, params-without-M) of one scale unit, in a fixed order."""
    dtype = "float32" if cpu else "float16"  # target "c" has no 16-bit types
    tilings = GEMM_TILINGS["c" if cpu else "cuda"]
    out = []
    for name, hidden, ffn, heads, kv_heads, head_dim in MODELS:
        qkv_n = hidden + 2 * kv_heads * head_dim
        for proj, n in (("qkv", qkv_n), ("up", ffn)):
            for tiling in tilings:
                out.append(("gemm", dict(N=n, K=hidden, dtype=dtype, trans_b=True, **tiling)))
    for heads, kv_heads, head_dim in ATTENTION_HEADS:
        for block_m in (64, 128):
            out.append(("attention", dict(batch=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim, causal=True, dtype=dtype, block_M=block_m)))
    for name, hidden, ffn, *_ in MODELS:
        out.append(("rmsnorm", dict(N=hidden, dtype=dtype)))
    for name, hidden, ffn, *_ in MODELS:
        out.append(("swiglu", dict(N=ffn, dtype=dtype)))
    for n in SOFTMAX_ROWS:
        out.append(("softmax", dict(N=n, dtype=dtype)))
    assert len(out) == UNIT, len(out)
    return out


# --quick: one kernel of each kind plus a second GEMM tiling, so CI exercises every kind.
QUICK = (0, 1, 24, 30, 34, 38)


def build_zoo(target: str, scale: int = 1, salt: int = 0, quick: bool = False) -> list[dict]:
    """The zoo's specs for `target` (a string as the service takes it: "c", "sm_90a", "auto").

    Every spec is validated here, so a zoo the kinds reject fails before any timing starts.
    """
    import kernels  # here, not at the top: agent processes time their own imports

    resolved = kernels.parse_target(target)
    shapes = unit_shapes(resolved.is_cpu)
    picks = [shapes[i] for i in QUICK] if quick else shapes * scale
    specs = []
    for k, (kind, params) in enumerate(picks, start=salt * len(picks)):
        m = M_BASE + M_STEP * k
        rows = {"seq_len": m} if kind == "attention" else {"M": m}
        spec = {"kind": kind, "target": str(resolved), **params, **rows}
        kernels.canonicalize(kind, {k2: v for k2, v in spec.items() if k2 not in ("kind", "target")}, spec["target"])
        specs.append(spec)
    return specs


def params_of(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k not in ("kind", "target")}


def label(spec: dict) -> str:
    p = params_of(spec)
    shape = "x".join(str(p[d]) for d in ("M", "seq_len", "N", "K", "heads", "kv_heads") if d in p)
    return f"{spec['kind']} {shape}"


# A Llama-3-8B layer as an agent's decode step asks for it (benchmark/decode_step.py's kinds):
# four GEMMs over a runtime number of tokens (each a router over its M ranges), the norm, the
# MLP activation and causal attention over a runtime sequence length.
LAYER = dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128)


def llama_layer(target: str) -> list[dict]:
    """The layer's 7 specs for `target` (16-bit on CUDA, float32 on "c")."""
    import kernels

    resolved = kernels.parse_target(target)
    t = {"target": str(resolved), "dtype": "float32" if resolved.is_cpu else "bfloat16"}
    h, f, heads, kv, d = (LAYER[k] for k in ("hidden", "ffn", "heads", "kv_heads", "head_dim"))
    gemm = lambda n, k: {"kind": "gemm", "M": None, "N": n, "K": k, "trans_b": True, **t}  # noqa: E731
    return [
        {"kind": "rmsnorm", "M": None, "N": h, **t},
        gemm((heads + 2 * kv) * d, h),
        {"kind": "attention", "batch": 1, "heads": heads, "kv_heads": kv, "seq_len": None, "head_dim": d, "causal": True, **t},
        gemm(h, heads * d),
        gemm(2 * f, h),
        {"kind": "swiglu", "M": None, "N": f, "packed": True, **t},
        gemm(h, f),
    ]
