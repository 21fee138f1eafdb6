"""A transformer block whose every kernel is served: the model tests and benchmarks compile.

    block = ServedBlock(client.connect(), BlockConfig(hidden=4096, heads=32, kv_heads=8, ffn=14336,
                        seq_len=2048, dtype="float16", target="auto"))
    with torch.inference_mode():
        y = torch.compile(block, fullgraph=True, dynamic=True)(x)    # x: [batch, seq_len, hidden]

Llama-style (pre-norm, GQA attention, SwiGLU MLP, residuals added in the
GEMM epilogues): rmsnorm -> q, k, v GEMMs -> attention -> o GEMM (+ residual)
-> rmsnorm -> gate, up GEMMs -> swiglu -> down GEMM, which adds its product
to the residual stream in place (`out=`). `causal=False` makes it an encoder
block. The batch is a runtime size of every kernel, so one compiled graph
serves every batch. `reference()` computes the same block with torch ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockConfig:
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq_len: int
    dtype: str = "float32"
    target: str = "c"
    causal: bool = True
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def kernel_specs(cfg: BlockConfig) -> dict[str, dict]:
    """The block's kernels by role, as client.prefetch specs (the batch is a runtime size everywhere)."""
    c, d = cfg, cfg.head_dim
    common = {"target": c.target, "dtype": c.dtype}

    def gemm(n, k, residual=False):
        return {"kind": "gemm", "M": None, "N": n, "K": k, "trans_b": True, "residual": residual, **common}

    return {
        "norm": {"kind": "rmsnorm", "M": None, "N": c.hidden, "eps": c.eps, **common},
        "q": gemm(c.heads * d, c.hidden),
        "kv": gemm(c.kv_heads * d, c.hidden),
        "attn": {
            "kind": "attention",
            "batch": None,
            "heads": c.heads,
            "kv_heads": c.kv_heads,
            "seq_len": c.seq_len,
            "head_dim": d,
            "causal": c.causal,
            **common,
        },
        "o": gemm(c.hidden, c.heads * d, residual=True),
        "gate_up": gemm(c.ffn, c.hidden),
        "swiglu": {"kind": "swiglu", "M": None, "N": c.ffn, **common},
        "down": gemm(c.hidden, c.ffn, residual=True),
    }


class ServedBlock(torch.nn.Module):
    def __init__(self, client, cfg: BlockConfig, seed: int = 0, device: str | None = None):
        super().__init__()
        self.cfg = cfg
        c, d, dtype = cfg, cfg.head_dim, getattr(torch, cfg.dtype)
        for role, spec in kernel_specs(cfg).items():
            spec = dict(spec)
            setattr(self, role, client.get_kernel(spec.pop("kind"), **spec).ready())  # every range: no build loads mid-run
        device = device or self.norm.abi["device"]  # "cpu" or "cuda", whatever "auto" resolved to

        g = torch.Generator().manual_seed(seed)

        def weight(*shape, scale=None):
            scale = scale if scale is not None else 1 / math.sqrt(shape[-1])
            return torch.nn.Parameter((torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype))

        self.w_norm1 = torch.nn.Parameter((1 + 0.1 * torch.randn(c.hidden, generator=g)).to(device=device, dtype=dtype))
        self.w_norm2 = torch.nn.Parameter((1 + 0.1 * torch.randn(c.hidden, generator=g)).to(device=device, dtype=dtype))
        self.w_q, self.w_k, self.w_v = weight(c.heads * d, c.hidden), weight(c.kv_heads * d, c.hidden), weight(c.kv_heads * d, c.hidden)
        self.w_o = weight(c.hidden, c.heads * d)
        self.w_gate, self.w_up = weight(c.ffn, c.hidden), weight(c.ffn, c.hidden)
        self.w_down = weight(c.hidden, c.ffn)

    def forward(self, x):
        c, d = self.cfg, self.cfg.head_dim
        b, s = x.shape[0], x.shape[1]
        h = x.reshape(b * s, c.hidden)
        n = self.norm(h, self.w_norm1)
        q = self.q(n, self.w_q).view(b, s, c.heads, d)
        k = self.kv(n, self.w_k).view(b, s, c.kv_heads, d)
        v = self.kv(n, self.w_v).view(b, s, c.kv_heads, d)
        a = self.attn(q, k, v).view(b * s, c.heads * d)
        h = self.o(a, self.w_o, h)  # h + a @ w_o.T, into a new tensor (x is the caller's)
        n = self.norm(h, self.w_norm2)
        m = self.swiglu(self.gate_up(n, self.w_gate), self.gate_up(n, self.w_up))
        self.down(m, self.w_down, h, out=h)  # h += m @ w_down.T, in place
        return h.view(b, s, c.hidden)


def reference(block: ServedBlock, x: torch.Tensor) -> torch.Tensor:
    """The same block with torch ops, in fp32 on upcast weights, cast back to x's dtype."""
    c, d = block.cfg, block.cfg.head_dim
    w = {name: p.detach().float() for name, p in block.named_parameters()}
    b, s = x.shape[0], x.shape[1]

    def rms(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.eps) * weight

    h = x.float().reshape(b * s, c.hidden)
    n = rms(h, w["w_norm1"])
    q, k, v = ((n @ w[f"w_{p}"].T).view(b, s, -1, d).transpose(1, 2) for p in "qkv")
    k, v = (t.repeat_interleave(c.heads // c.kv_heads, dim=1) for t in (k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=c.causal).transpose(1, 2).reshape(b * s, c.heads * d)
    h = h + a @ w["w_o"].T
    n = rms(h, w["w_norm2"])
    h = h + (F.silu(n @ w["w_gate"].T) * (n @ w["w_up"].T)) @ w["w_down"].T
    return h.view(b, s, c.hidden).to(x.dtype)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
