"""One Llama-3-8B decoder layer from served kernels against torch eager and torch.compile.

    python benchmark/decode_step.py                      # on a CUDA host: check, then time
    python benchmark/decode_step.py --check-only         # correctness only (no timing)
    python benchmark/decode_step.py --small --check-only # anywhere: tiny layer, float32, target "c"

The layer (hidden 4096, 32 query / 8 KV heads of 128, FFN 14336 SwiGLU, RMSNorm eps
1e-5, RoPE neox theta 500000) follows vLLM's calling convention: it maps
(x, r) -> (x', r'), x the previous sublayer's output not yet added to the residual
stream r, so every residual add fuses into a kernel:

    n1, r1 = add_rmsnorm(x, r)              r1 = x + r
    qkv = gemm(n1, Wqkv)                    one GEMM on Wqkv = cat(Wq, Wk, Wv), viewed per head
    q, k = rope(positions, qkv, slots, cache)
                                            packed: reads qkv's Q and K heads, writes new q, k;
                                            write_cache: also k and qkv's V heads into the paged cache
    a = attention(q, cache)                 kv_attention at decode, causal attention at prefill
    r2 = r1 + a @ Wo.T                      --residual gemm: the O GEMM's epilogue, then n2 = rmsnorm(r2)
                                            --residual norm: o = gemm(a, Wo); n2, r2 = add_rmsnorm(o, r1)
    x' = gemm(swiglu(gemm(n2, Wgu)), Wd)    one GEMM on Wgu = cat(Wg, Wu); swiglu (packed) takes its
                                            [gate | up] rows (x' + r2 fuses into the next layer's add_rmsnorm)

As in vLLM, the fused QKV and gate/up GEMMs save launches at decode; the cache write rides
along in rope's launch (vLLM's attention backends write it in a kernel of their own; here it
would be two index_copy_ launches).

Runs decode at batch 1, 8 and 64, each sequence at KV length --kv-len (4096) in a paged
cache (--page-size, pages in shuffled order), and one --prefill (2048) token chunk of a
fresh sequence. Four variants of the same layer, each captured in one CUDA graph and
timed in the same run, taking turns: `served` (the kernels above), `eager` (the layer in
plain torch, with HF's separate q/k/v and gate/up projections: what users run),
`compiled` (torch.compile of that function) and `compiled_fused` (torch.compile of the
same function on the concatenated weights: one QKV and one gate/up F.linear, split
after). The torch layer keeps its KV cache contiguous ([batch, kv_len, kv_heads,
head_dim], SDPA with enable_gqa): a paged gather would only slow the baseline down.
Outputs are checked against torch eager (the fused torch layer's too).

Goals printed: served >= 1.1x torch.compile at decode (batch 1, 8, 64), >= 1.0x at prefill;
the ratio to torch.compile on the fused weights is printed beside it.

Decode attention needs the `kv_attention` kind (Q [batch, q_len, heads, head_dim], paged
K/V [num_pages, page_size, kv_heads, head_dim], seq_lens int32 [batch], block_table int32
[batch, max_blocks], in that order); everything that depends on it is in `attention_kernel()`. Where
the daemon does not serve it yet, --check-only uses a torch stand-in (paged gather + SDPA)
and says so; timing refuses to run without it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


@dataclass(frozen=True)
class LayerConfig:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    eps: float = 1e-5
    theta: float = 500000.0
    kv_len: int = 4096  # tokens each decoding sequence has in the cache, the new one included
    prefill: int = 2048  # tokens of the prefill chunk
    page_size: int = 16
    dtype: str = "bfloat16"
    target: str = "auto"
    residual: str = "gemm"  # where r2 = r1 + a @ Wo.T is added: the O GEMM's epilogue, or an add_rmsnorm

    @property
    def max_position(self) -> int:
        return max(self.kv_len, self.prefill)

    @property
    def max_blocks(self) -> int:
        return -(-self.max_position // self.page_size)


SMALL = LayerConfig(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, kv_len=70, prefill=48, page_size=16, dtype="float32", target="c")


# ----- the served layer's kernels


def kernel_specs(cfg: LayerConfig) -> dict[str, dict]:
    """The layer's kernels but attention, by role, as client.prefetch specs; tokens are a runtime size."""
    c, d = cfg, cfg.head_dim
    common = {"target": c.target, "dtype": c.dtype}

    def gemm(n, k, residual=False):
        return {"kind": "gemm", "M": None, "N": n, "K": k, "trans_b": True, "residual": residual, **common}

    specs = {
        "add_norm": {"kind": "add_rmsnorm", "M": None, "N": c.hidden, "eps": c.eps, **common},
        "qkv": gemm((c.heads + 2 * c.kv_heads) * d, c.hidden),
        "rope": {
            "kind": "rope",
            "tokens": None,
            "heads": c.heads,
            "kv_heads": c.kv_heads,
            "head_dim": d,
            "style": "neox",
            "max_position": c.max_position,
            "packed": True,
            "write_cache": True,
            **common,
        },
        "o": gemm(c.hidden, c.heads * d, residual=c.residual == "gemm"),
        "gate_up": gemm(2 * c.ffn, c.hidden),
        "swiglu": {"kind": "swiglu", "M": None, "N": c.ffn, "packed": True, **common},
        "down": gemm(c.hidden, c.ffn),
    }
    if c.residual == "gemm":
        specs["norm"] = {"kind": "rmsnorm", "M": None, "N": c.hidden, "eps": c.eps, **common}
    return specs


def prefill_attention_spec(cfg: LayerConfig, q_len: int) -> dict:
    """The causal attention kernel of a q_len-token prefill chunk of one fresh sequence, as a client.prefetch spec."""
    c = cfg
    return {
        "kind": "attention",
        "batch": 1,
        "heads": c.heads,
        "kv_heads": c.kv_heads,
        "seq_len": q_len,
        "head_dim": c.head_dim,
        "causal": True,
        "target": c.target,
        "dtype": c.dtype,
    }


def attention_kernel(client, cfg: LayerConfig, batch: int, q_len: int, served_kinds: set[str]):
    """attend(q [batch, q_len, heads, d], k_new, v_new [batch*q_len, kv_heads, d], cache) -> [batch, q_len, heads, d].

    The one place that knows the attention kinds' interfaces. Decode (q_len 1) reads the
    paged cache through `kv_attention`; the prefill chunk (a fresh sequence, so its keys are
    its own) uses the causal `attention` kind on the chunk's K and V, as they come out of the
    GEMMs. Returns (attend, label); attend is None where nothing served can do it.
    """
    c, d = cfg, cfg.head_dim
    common = {"target": c.target, "dtype": c.dtype}
    if q_len > 1 and batch == 1:
        spec = prefill_attention_spec(cfg, q_len)
        k = client.get_kernel(spec.pop("kind"), **spec)

        def attend(q, k_new, v_new, cache):
            # v_new is a strided view of the QKV GEMM's output and the kind takes contiguous
            # tensors: one copy of the chunk's V (decode reads V from the paged cache instead).
            return k(q, k_new.view(1, q_len, c.kv_heads, d), v_new.contiguous().view(1, q_len, c.kv_heads, d))

        return attend, "attention (causal)"
    if "kv_attention" not in served_kinds:
        return None, "kv_attention is not served by this daemon"
    # The interface the kv_attention helper announced; adapt here once it lands if it differs.
    try:
        k = client.get_kernel(
            "kv_attention", batch=batch, heads=c.heads, kv_heads=c.kv_heads, q_len=q_len, head_dim=d, paged=True, page_size=c.page_size, **common
        )
    except ValueError as exc:  # InvalidSpec: the kind landed with other params
        raise SystemExit(f"kv_attention refused the spec attention_kernel() in {Path(__file__).name} asks for ({exc}); adapt it to the kind's params") from None

    def attend(q, k_new, v_new, cache):
        return k(q, cache.k_pages, cache.v_pages, cache.seq_lens, cache.block_table)  # the kind's order: seq_lens, then block_table

    return attend, "kv_attention (paged)"


def torch_paged_attention(cfg: LayerConfig):
    """A stand-in for kv_attention in --check-only runs, in torch: gathers each sequence's pages."""

    def attend(q, k_new, v_new, cache):
        b = q.shape[0]
        keys = cache.k_pages[cache.block_table.long()].flatten(1, 2)[:, : cfg.kv_len]  # [b, kv_len, kv_heads, d]
        values = cache.v_pages[cache.block_table.long()].flatten(1, 2)[:, : cfg.kv_len]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), enable_gqa=True)
        return out.transpose(1, 2).reshape(b, q.shape[1], cfg.heads, cfg.head_dim)

    return attend


@dataclass
class PagedCache:
    """The served layer's KV cache: pages of page_size tokens, each sequence's pages in shuffled order."""

    k_pages: torch.Tensor  # [num_pages, page_size, kv_heads, head_dim]
    v_pages: torch.Tensor
    block_table: torch.Tensor  # int32 [batch, max_blocks]
    seq_lens: torch.Tensor  # int32 [batch]

    def slots(self, positions: torch.Tensor, batch_of: torch.Tensor, page_size: int) -> torch.Tensor:
        """Flat row indices (into k_pages.view(-1, ...)) of tokens at `positions` of sequences `batch_of`."""
        pages = self.block_table.long()[batch_of, positions // page_size]
        return pages * page_size + positions % page_size


class ServedLayer:
    """The decoder layer from served kernels; weights shared with the torch layer."""

    def __init__(self, client, cfg: LayerConfig, weights: dict, attend):
        self.cfg, self.w, self.attend = cfg, weights, attend
        self.roles = []
        for role, spec in kernel_specs(cfg).items():
            spec = dict(spec)
            setattr(self, role, client.get_kernel(spec.pop("kind"), **spec))
            self.roles.append(role)

    def ready(self) -> "ServedLayer":
        """Once every range of each router is loaded (they load in the background): before a capture."""
        for role in self.roles:
            getattr(self, role).ready()
        return self

    def __call__(self, x, r, positions, slots, cache: PagedCache, batch: int, q_len: int):
        c, w, d = self.cfg, self.w, self.cfg.head_dim
        n1, r1 = self.add_norm(x, r, w["norm1"])  # new tensors: the caller's x and r stay as they are
        qkv = self.qkv(n1, w["qkv"]).view(-1, c.heads + 2 * c.kv_heads, d)
        # New contiguous q, k from qkv's Q and K heads; k and qkv's V heads also go into the
        # paged cache, viewed as rows [num_pages * page_size, kv_heads, d], at `slots`.
        q, k = self.rope(positions, qkv, w["cos_sin"], slots, cache.k_pages.view(-1, c.kv_heads, d), cache.v_pages.view(-1, c.kv_heads, d))
        v = qkv[:, c.heads + c.kv_heads :]  # a strided view (the prefill chunk's attention reads it)
        a = self.attend(q.view(batch, q_len, c.heads, d), k, v, cache).reshape(-1, c.heads * d)
        if c.residual == "gemm":
            self.o(a, w["o"], r1, out=r1)  # r1 += a @ Wo.T in the epilogue
            n2, r2 = self.norm(r1, w["norm2"]), r1
        else:
            n2, r2 = self.add_norm(self.o(a, w["o"]), r1, w["norm2"])
        m = self.swiglu(self.gate_up(n2, w["gate_up"]))  # packed: the GEMM's [gate | up] rows
        return self.down(m, w["down"]), r2


# ----- the same layer in plain torch


def torch_layer(x, r, positions, batch_of, k_cache, v_cache, w: dict, cfg: LayerConfig, kv_len: int, causal: bool, fused: bool = False):
    """The layer in plain torch (what eager and torch.compile run); k_cache, v_cache [batch, >= kv_len,
    kv_heads, head_dim] are written at (batch_of, positions); attention reads keys [0, kv_len).
    HF's separate q/k/v and gate/up projections, or with `fused` one GEMM for each group on the
    concatenated weights (w["qkv"], w["gate_up"]), split after."""
    c, d = cfg, cfg.head_dim
    dtype = x.dtype

    def rms(t, weight):
        t32 = t.float()
        return (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + c.eps) * weight.float()).to(dtype)

    def rope(t):  # neox: rotate halves; cos_sin rows are [cos..., sin...]
        cos, sin = w["cos_sin"][positions].float().chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        t1, t2 = t.float().chunk(2, dim=-1)
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1).to(dtype)

    tokens, b = x.shape[0], k_cache.shape[0]
    r1 = x + r
    n1 = rms(r1, w["norm1"])
    if fused:
        q, k, v = F.linear(n1, w["qkv"]).split([c.heads * d, c.kv_heads * d, c.kv_heads * d], dim=-1)
    else:
        q, k, v = F.linear(n1, w["q"]), F.linear(n1, w["k"]), F.linear(n1, w["v"])
    q = rope(q.view(tokens, c.heads, d))
    k = rope(k.view(tokens, c.kv_heads, d))
    v = v.view(tokens, c.kv_heads, d)
    k_cache[batch_of, positions] = k
    v_cache[batch_of, positions] = v
    q = q.view(b, -1, c.heads, d).transpose(1, 2)
    if causal:  # the prefill chunk: its own keys
        keys, values = k.view(b, -1, c.kv_heads, d).transpose(1, 2), v.view(b, -1, c.kv_heads, d).transpose(1, 2)
    else:
        keys, values = k_cache[:, :kv_len].transpose(1, 2), v_cache[:, :kv_len].transpose(1, 2)
    a = F.scaled_dot_product_attention(q, keys, values, is_causal=causal, enable_gqa=True)
    a = a.transpose(1, 2).reshape(tokens, c.heads * d)
    r2 = r1 + F.linear(a, w["o"])
    n2 = rms(r2, w["norm2"])
    gate, up = F.linear(n2, w["gate_up"]).chunk(2, dim=-1) if fused else (F.linear(n2, w["gate"]), F.linear(n2, w["up"]))
    return F.linear(F.silu(gate) * up, w["down"]), r2


# ----- inputs


def make_weights(cfg: LayerConfig, device, seed: int = 0) -> dict:
    """The layer's weights: HF's separate projections (the torch layer's) and, built once from the
    same tensors, their concatenations "qkv" [(heads + 2*kv_heads)*d, hidden] and "gate_up"
    [2*ffn, hidden] (the served layer's fused GEMMs, and the fused torch layer's). Random, from `seed`,
    drawn on `device` (a CPU generator spends seconds on a Llama-3-8B layer)."""
    c, d = cfg, cfg.head_dim
    dtype = getattr(torch, c.dtype)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    def weight(*shape):
        return (randn(*shape) / math.sqrt(shape[-1])).to(dtype)

    inv_freq = 1.0 / c.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(c.max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    w = {
        "norm1": (1 + 0.1 * randn(c.hidden)).to(dtype),
        "norm2": (1 + 0.1 * randn(c.hidden)).to(dtype),
        "q": weight(c.heads * d, c.hidden),
        "k": weight(c.kv_heads * d, c.hidden),
        "v": weight(c.kv_heads * d, c.hidden),
        "o": weight(c.hidden, c.heads * d),
        "gate": weight(c.ffn, c.hidden),
        "up": weight(c.ffn, c.hidden),
        "down": weight(c.hidden, c.ffn),
        "cos_sin": torch.cat([angles.cos(), angles.sin()], dim=-1).to(device=device, dtype=dtype),  # vLLM's layout
    }
    w["qkv"] = torch.cat([w["q"], w["k"], w["v"]])
    w["gate_up"] = torch.cat([w["gate"], w["up"]])
    return w


@dataclass
class Step:
    """One step's inputs for both layers: the served one's paged cache and the torch one's contiguous cache,
    holding the same context."""

    batch: int
    q_len: int
    x: torch.Tensor
    r: torch.Tensor
    positions: torch.Tensor  # int64 [tokens]
    batch_of: torch.Tensor  # int64 [tokens]
    slots: torch.Tensor  # int64 [tokens]: rows of the paged cache the step writes
    paged: PagedCache
    k_cache: torch.Tensor  # [batch, max_blocks * page_size, kv_heads, head_dim]
    v_cache: torch.Tensor

    @property
    def prefill(self) -> bool:
        return self.q_len > 1


def make_step(cfg: LayerConfig, batch: int, q_len: int, device) -> Step:
    c, d = cfg, cfg.head_dim
    dtype = getattr(torch, c.dtype)
    g = torch.Generator(device=device).manual_seed(batch * 7919 + q_len)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    tokens = batch * q_len
    x, r = randn(tokens, c.hidden), randn(tokens, c.hidden)
    if q_len > 1:  # a fresh sequence: positions 0..q_len-1
        positions, length = torch.arange(q_len, device=device).repeat(batch), q_len
    else:  # decoding the last token of kv_len
        positions, length = torch.full((batch,), c.kv_len - 1, device=device), c.kv_len
    batch_of = torch.arange(batch, device=device).repeat_interleave(q_len)
    # Context: the same random keys and values in both caches (the step overwrites its own rows).
    padded = c.max_blocks * c.page_size
    k_cache = torch.zeros(batch, padded, c.kv_heads, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, :length] = randn(batch, length, c.kv_heads, d)
    v_cache[:, :length] = randn(batch, length, c.kv_heads, d)
    pages = batch * c.max_blocks
    block_table = torch.randperm(pages, generator=g, device=device).view(batch, c.max_blocks).to(torch.int32)
    k_pages = torch.empty(pages, c.page_size, c.kv_heads, d, dtype=dtype, device=device)
    v_pages = torch.empty_like(k_pages)
    k_pages[block_table.long()] = k_cache.view(batch, c.max_blocks, c.page_size, c.kv_heads, d)
    v_pages[block_table.long()] = v_cache.view(batch, c.max_blocks, c.page_size, c.kv_heads, d)
    paged = PagedCache(k_pages, v_pages, block_table, torch.full((batch,), length, dtype=torch.int32, device=device))
    slots = paged.slots(positions, batch_of, c.page_size)
    return Step(batch, q_len, x, r, positions, batch_of, slots, paged, k_cache, v_cache)


# ----- running and timing


def run_served(layer: ServedLayer, s: Step):
    return layer(s.x, s.r, s.positions, s.slots, s.paged, s.batch, s.q_len)


def run_torch(fn, w, cfg: LayerConfig, s: Step, fused: bool = False):
    kv_len = s.q_len if s.prefill else cfg.kv_len
    return fn(s.x, s.r, s.positions, s.batch_of, s.k_cache, s.v_cache, w, cfg, kv_len, s.prefill, fused)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def check(name: str, served, eager, step: Step, cfg: LayerConfig, tol: float) -> list[str]:
    """Compares the served layer's outputs and written cache rows with torch's; returns the problems."""
    problems = []
    for what, a, b in (("x'", served[0], eager[0]), ("r'", served[1], eager[1])):
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{name}: {what} is {tuple(a.shape)} {a.dtype}, torch's {tuple(b.shape)} {b.dtype}")
            continue
        err = rel_error(a, b)
        print(f"  {name}: {what} relative error vs torch eager {err:.2e}")
        if not err < tol:
            problems.append(f"{name}: {what} relative error {err:.2e} over {tol:.0e}")
    kv, d = cfg.kv_heads, cfg.head_dim
    for what, pages, contiguous in (("keys", step.paged.k_pages, step.k_cache), ("values", step.paged.v_pages, step.v_cache)):
        err = rel_error(pages.view(-1, kv, d)[step.slots], contiguous[step.batch_of, step.positions])
        if not err < tol:
            problems.append(f"{name}: {what} written into the paged cache differ from torch's (relative error {err:.2e})")
    return problems


def output_error(a, b) -> float:
    """The larger relative error of one torch variant's (x', r') against another's."""
    return max(rel_error(a[0], b[0]), rel_error(a[1], b[1]))


def graphed(fn):
    """fn captured in a CUDA graph (after warm-up on a side stream); returns replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay


def time_graphs(replays: dict, iters: int, reps: int) -> dict:
    """ms per replay of each graph, median over `reps` rounds of `iters` replays, the graphs taking turns."""
    samples = {name: [] for name in replays}
    for _ in range(reps):
        for name, replay in replays.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / iters)
    return {name: statistics.median(v) for name, v in samples.items()}


def validate_specs(cfg: LayerConfig, cases) -> None:
    """Every served kernel's spec canonicalizes (kinds this process knows), before any daemon starts."""
    import kernels

    for role, spec in kernel_specs(cfg).items():
        params = {k: v for k, v in spec.items() if k not in ("kind", "target")}
        kernels.canonicalize(spec["kind"], params, spec["target"])
    for batch, q_len in cases:
        if q_len > 1:
            spec = prefill_attention_spec(cfg, q_len)
            kernels.canonicalize(spec["kind"], {k: v for k, v in spec.items() if k not in ("kind", "target")}, spec["target"])


def compile_torch_layer(mode: str, cases: int):
    """torch.compile of torch_layer, for both torch.compile variants: dynamo specializes on `fused`."""
    # Dynamo counts compiles per code object: room for both variants of every case, so that
    # none falls back to eager unnoticed.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * cases)
    return torch.compile(torch_layer, fullgraph=True, dynamic=False, mode=None if mode == "default" else mode)


def run_case(client, cfg, w, batch, q_len, served_kinds, args, compiled_fn) -> dict:
    device = "cuda" if cfg.target != "c" else "cpu"
    label = f"prefill {q_len}" if q_len > 1 else f"decode batch {batch}"
    attend, how = attention_kernel(client, cfg, batch, q_len, served_kinds)
    stand_in = attend is None
    if stand_in:
        if not args.check_only:
            raise SystemExit(f"{label}: {how}; timing needs it (adapt attention_kernel() in {Path(__file__).name} once it lands)")
        attend, how = torch_paged_attention(cfg), "torch stand-in for kv_attention (paged gather + SDPA)"
    print(f"{label}: attention by {how}", flush=True)
    layer = ServedLayer(client, cfg, w, attend).ready()  # the steps are captured
    step = make_step(cfg, batch, q_len, device)
    with torch.inference_mode():
        served = run_served(layer, step)
        eager = run_torch(torch_layer, w, cfg, step)
        tol = 1e-4 if cfg.dtype == "float32" else 3e-2
        problems = check(label, served, eager, step, cfg, tol)
        err = output_error(run_torch(torch_layer, w, cfg, step, fused=True), eager)
        print(f"  {label}: the torch layer on fused weights vs eager {err:.2e}")
        if not err < tol:
            problems.append(f"{label}: the torch layer on fused weights differs from eager by {err:.2e}")
        row = {"case": label, "attention": how, "problems": problems}
        if args.check_only:
            return row
        for name, fused in (("torch.compile", False), ("torch.compile on fused weights", True)):
            err = output_error(run_torch(compiled_fn, w, cfg, step, fused), eager)
            if not err < tol:
                problems.append(f"{label}: {name}'s output differs from eager by {err:.2e}")
        replays = {
            "served": graphed(lambda: run_served(layer, step)),
            "eager": graphed(lambda: run_torch(torch_layer, w, cfg, step)),
            "compiled": graphed(lambda: run_torch(compiled_fn, w, cfg, step)),
            "compiled_fused": graphed(lambda: run_torch(compiled_fn, w, cfg, step, fused=True)),
        }
        row["ms"] = time_graphs(replays, args.iters, args.reps)
        row["goal"] = 1.0 if q_len > 1 else 1.1
        row["speedup"] = row["ms"]["compiled"] / row["ms"]["served"]
        row["speedup_fused"] = row["ms"]["compiled_fused"] / row["ms"]["served"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,64", help="decode batch sizes")
    parser.add_argument("--kv-len", type=int, help="KV length of each decoding sequence (default 4096)")
    parser.add_argument("--prefill", type=int, help="tokens of the prefill chunk (default 2048; 0: none)")
    parser.add_argument("--page-size", type=int, help="tokens per KV page (default 16)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), help="default bfloat16 (float32 with --small)")
    parser.add_argument("--residual", choices=("gemm", "norm"), default="gemm", help="where r1 + a @ Wo.T is added (see above)")
    parser.add_argument("--small", action="store_true", help="a tiny layer; without a GPU it runs in float32 on target 'c'")
    parser.add_argument("--check-only", "--dry-run", dest="check_only", action="store_true", help="check outputs against torch, no timing")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--socket", help="use a running daemon instead of starting one")
    parser.add_argument("--compile-mode", default="default", help="torch.compile mode for the baseline (its CUDA graph is ours)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if not cuda and not (args.small and args.check_only):
        sys.exit(
            "benchmark/decode_step.py needs a CUDA GPU (torch.cuda.is_available() is False); "
            "without one, `--small --check-only` checks the layer on the CPU (float32, target 'c')"
        )
    cfg = SMALL if args.small else LayerConfig()
    if args.small and cuda:
        cfg = replace(cfg, dtype="bfloat16", target="auto")
    overrides = {"kv_len": args.kv_len, "prefill": args.prefill, "page_size": args.page_size, "dtype": args.dtype}
    cfg = replace(cfg, residual=args.residual, **{k: v for k, v in overrides.items() if v is not None})
    if not cuda and cfg.dtype != "float32":
        sys.exit("on the CPU (target 'c') the layer runs in float32; leave --dtype out")
    cases = [(int(b), 1) for b in args.batches.split(",") if b] + ([(1, cfg.prefill)] if cfg.prefill else [])
    validate_specs(cfg, cases)
    print(f"config: {cfg}", flush=True)

    from devtools.launch import DaemonProcess

    import client as client_api

    with tempfile.TemporaryDirectory(prefix="ks-decode-step-") as tmp:
        daemon = None
        if args.socket:
            c = client_api.connect(args.socket)
        else:
            t0 = time.perf_counter()
            daemon = DaemonProcess(Path(tmp) / "cache", "--target", cfg.target, workers=args.workers, log_path=Path(tmp) / "daemon.log").start()
            c = daemon.client()
            print(f"daemon up in {time.perf_counter() - t0:.1f} s", flush=True)
        try:
            served_kinds = {k["name"] for k in c.kinds()}
            t0 = time.perf_counter()
            failed = [r for r in c.prefetch(list(kernel_specs(cfg).values())) if isinstance(r, Exception)]
            if failed:
                raise failed[0]
            print(f"kernels ready in {time.perf_counter() - t0:.1f} s", flush=True)
            device = "cuda" if cfg.target != "c" else "cpu"
            w = make_weights(cfg, device)
            compiled_fn = None if args.check_only else compile_torch_layer(args.compile_mode, len(cases))
            rows = [run_case(c, cfg, w, batch, q_len, served_kinds, args, compiled_fn) for batch, q_len in cases]
        finally:
            c.close()
            if daemon is not None:
                daemon.stop()
    report(rows, cfg, args)


def report(rows: list[dict], cfg: LayerConfig, args) -> None:
    problems = [p for r in rows for p in r["problems"]]
    if not args.check_only:
        print(
            f"\ntorch {torch.__version__}, {torch.cuda.get_device_name()}; {cfg.dtype}, KV length {cfg.kv_len}, page size {cfg.page_size}, "
            f"residual in the {cfg.residual}; ms per layer step, each variant one CUDA graph, medians of {args.reps} rounds of {args.iters} replays"
        )
        print("| case | served | torch eager | torch.compile | torch.compile, fused weights | compile / served | goal | | fused compile / served |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            ms = r["ms"]
            verdict = "met" if r["speedup"] >= r["goal"] else "MISSED"
            print(
                f"| {r['case']} | {ms['served']:.4f} | {ms['eager']:.4f} | {ms['compiled']:.4f} | {ms['compiled_fused']:.4f} "
                f"| {r['speedup']:.2f}x | >= {r['goal']:.1f}x | {verdict} | {r['speedup_fused']:.2f}x |"
            )
    stand_ins = [r["case"] for r in rows if "stand-in" in r["attention"]]
    if stand_ins:
        print(f"note: {', '.join(stand_ins)} used a torch stand-in for kv_attention (not served yet)")
    if problems:
        print("\nPROBLEMS:\n  " + "\n  ".join(problems))
        sys.exit(1)
    print("outputs match torch" + ("" if args.check_only else "; timings above"))


if __name__ == "__main__":
    main()
