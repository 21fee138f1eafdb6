"""Torch references for every kind, and random inputs shaped by a canonical spec.

Used by tests (CPU), the demo and the GPU benchmarks, so that "correct" means
the same thing everywhere. Imports torch lazily.
"""

from __future__ import annotations

import math

# Runtime sizes used for dimensions a spec leaves dynamic (None).
RUNTIME_DIMS = {"M": 37, "batch": 2, "seq_len": 70}


def _size(p: dict, name: str, runtime: dict) -> int:
    return p[name] if p[name] is not None else runtime.get(name, RUNTIME_DIMS[name])


def make_inputs(kind: str, p: dict, device="cpu", runtime: dict | None = None, seed: int = 0) -> list:
    """Random inputs for canonical params `p`, in signature order."""
    import torch

    runtime = runtime or {}
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, p["dtype"]) if "dtype" in p else torch.float32

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    if kind == "gemm":
        m = _size(p, "M", runtime)
        scale = 1 / math.sqrt(p["K"])  # keeps 16-bit outputs well inside range
        b_shape = (p["N"], p["K"]) if p["trans_b"] else (p["K"], p["N"])
        ins = [randn(m, p["K"]), randn(*b_shape, scale=scale)]
        return ins + [randn(p["N"])] if p.get("bias") else ins
    if kind == "attention":
        b, s = _size(p, "batch", runtime), _size(p, "seq_len", runtime)
        q = randn(b, s, p["heads"], p["head_dim"])
        return [q, randn(b, s, p["kv_heads"], p["head_dim"]), randn(b, s, p["kv_heads"], p["head_dim"])]
    m = _size(p, "M", runtime)
    if kind == "rmsnorm":
        return [randn(m, p["N"]), randn(p["N"])]
    if kind == "swiglu":
        return [randn(m, p["N"]), randn(m, p["N"])]
    if kind == "softmax":
        return [randn(m, p["N"], scale=4.0)]
    raise KeyError(f"no reference inputs for kind {kind!r}")


def reference(kind: str, p: dict, inputs: list):
    """The expected output, computed in fp32 and cast back to the inputs' dtype."""
    import torch
    import torch.nn.functional as F

    x32 = [t.float() for t in inputs]
    if kind == "gemm":
        a, b = x32[0], x32[1]
        out = a @ (b.T if p["trans_b"] else b)
        if p.get("bias"):
            out = out + x32[2]
        act = p.get("act", "none")
        out = {"none": lambda t: t, "relu": F.relu, "silu": F.silu, "gelu": lambda t: F.gelu(t, approximate="none")}[act](out)
    elif kind == "attention":
        q, k, v = (t.transpose(1, 2) for t in x32)  # -> [batch, heads, seq, dim]
        groups = p["heads"] // p["kv_heads"]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=p["causal"]).transpose(1, 2)
    elif kind == "rmsnorm":
        x, w = x32
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + p["eps"]) * w
    elif kind == "swiglu":
        out = F.silu(x32[0]) * x32[1]
    elif kind == "softmax":
        out = torch.softmax(x32[0], dim=-1)
    else:
        raise KeyError(f"no reference for kind {kind!r}")
    return out.to(inputs[0].dtype)


def tolerance(dtype: str) -> dict:
    """assert_close tolerances: fp32 accumulation everywhere, 16-bit storage of outputs."""
    return {"float32": dict(rtol=1e-4, atol=1e-4), "float16": dict(rtol=2e-2, atol=2e-2), "bfloat16": dict(rtol=5e-2, atol=5e-2)}[dtype]
