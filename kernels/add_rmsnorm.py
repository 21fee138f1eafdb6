"""Residual add plus RMSNorm: H = X + R, then Y = H * rsqrt(mean(H^2) + eps) * W, fp32 arithmetic.

Rounding: H is summed in fp32 and rounded to the tensor dtype once; that rounded H is
both the stored residual R' and what is normalised (as vLLM's fused_add_rms_norm and a
plain torch `h = x + r; rmsnorm(h)` do), so Y == rmsnorm(R') exactly and the next
layer sees the residual this one normalised. In float32 the rounding is a no-op.
"""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .registry import register
from .rmsnorm import RMSNorm
from .rows import TOKENS


@register
class AddRMSNorm(RMSNorm):
    name = "add_rmsnorm"
    outputs = (-2, -1)
    doc = "R'[M,N] = X + R (rounded to dtype), Y[M,N] = R' * rsqrt(mean(R'^2, row) + eps) * W[N]; returns (Y, R'); out=(Y, R) updates R in place."
    params = (TOKENS, *RMSNorm.params[1:])
    residual = True  # RMSNorm's builders, with the residual add

    def inplace(self, p):
        # One row per block (a thread on the CPU), read whole before either output is written.
        return {"Y": "X", "Rout": "R"}

    def inputs(self, p, randn, size):
        return [randn(size("M"), p["N"]), randn(size("M"), p["N"]), randn(p["N"])]

    def reference(self, p, x):
        import torch

        h = (x[0] + x[1]).to(getattr(torch, p["dtype"])).float()  # the rounded sum is what is normalised
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + p["eps"]) * x[2], h
