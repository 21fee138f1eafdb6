"""Torch references and random inputs for any kind, shaped by a canonical spec.

Each kind carries its own input maker and reference (KernelKind.inputs and
.reference); this module gives them one calling convention for tests, the demo
and the benchmarks, so that "correct" means the same thing everywhere. Imports
torch lazily.
"""

from __future__ import annotations

from .registry import get_kind

# Runtime sizes used for dimensions a spec leaves dynamic (None).
RUNTIME_DIMS = {"M": 37, "batch": 2, "seq_len": 70, "tokens": 37, "max_position": 53, "q_len": 5, "max_kv": 150}


def make_inputs(kind: str, p: dict, device="cpu", runtime: dict | None = None, seed: int = 0) -> list:
    """Random inputs for canonical params `p`, in signature order."""
    import torch

    runtime = runtime or {}
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, p["dtype"]) if "dtype" in p else torch.float32

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    def size(name: str) -> int:
        return p[name] if p.get(name) is not None else runtime.get(name, RUNTIME_DIMS.get(name, 37))

    return get_kind(kind).inputs(p, randn, size)


def reference(kind: str, p: dict, inputs: list):
    """The expected output (a tuple for several outputs), computed in fp32 and cast back to
    the spec's dtype. Integer inputs (positions) are passed as they are."""
    dtype = next(t.dtype for t in inputs if t.is_floating_point())
    out = get_kind(kind).reference(p, [t.float() if t.is_floating_point() else t for t in inputs])
    if isinstance(out, (tuple, list)):
        return tuple(o.to(dtype) for o in out)
    return out.to(dtype)


def tolerance(dtype: str) -> dict:
    """assert_close tolerances: fp32 accumulation everywhere, 16-bit storage of outputs."""
    return {"float32": dict(rtol=1e-4, atol=1e-4), "float16": dict(rtol=2e-2, atol=2e-2), "bfloat16": dict(rtol=5e-2, atol=5e-2)}[dtype]
