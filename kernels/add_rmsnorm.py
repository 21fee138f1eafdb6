"""Residual add plus RMSNorm: H = X + R, then Y = H * rsqrt(mean(H^2) + eps) * W, fp32 arithmetic.

Rounding: H is summed in fp32 and rounded to the tensor dtype once; that rounded H is
both the stored residual R' and what is normalised (as vLLM's fused_add_rms_norm and a
plain torch `h = x + r; rmsnorm(h)` do), so Y == rmsnorm(R') exactly and the next
layer sees the residual this one normalised. In float32 the rounding is a no-op.
"""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .launch import dependent_launch
from .registry import register
from .rows import RowKind, norm_prim_func, rms_scale, rows, squared
from .spec import Param, Target, dim, dtype_param, tile
from .tiling import padded


@register
class AddRMSNorm(RowKind):
    name = "add_rmsnorm"
    outputs = (-2, -1)
    doc = "R'[M,N] = X + R (rounded to dtype), Y[M,N] = R' * rsqrt(mean(R'^2, row) + eps) * W[N]; returns (Y, R'); out=(Y, R) updates R in place."
    params = (
        dim("M", "rows (tokens); None makes it a runtime size", dynamic=True),
        dim("N", "row length (hidden size)"),
        Param("eps", float, default=1e-6, min=0.0, max=1.0, doc="added to the mean square"),
        dtype_param(),
        tile("threads", "threads per row (CUDA only)"),
    )

    def inplace(self, p):
        # One row per block (a thread on the CPU), read whole before either output is written.
        return {"Y": "X", "Rout": "R"}

    def build_cpu(self, p):
        import tilelang.language as T

        M = rows(T, p)
        N, eps, dtype = p["N"], p["eps"], p["dtype"]

        @T.macro
        def body(X, R, W, B, Y, Rout):
            with T.Kernel(M) as bx:
                ss = T.alloc_local((1,), "float32")
                h = T.alloc_local((1,), "float32")
                ss[0] = 0
                for j in T.serial(N):  # R' first: Y is computed from it, and R may be Rout
                    Rout[bx, j] = X[bx, j] + R[bx, j]
                    ss[0] += Rout[bx, j] * Rout[bx, j]
                ss[0] = T.rsqrt(ss[0] / N + eps)
                for j in T.serial(N):
                    h[0] = Rout[bx, j]
                    Y[bx, j] = h[0] * ss[0] * W[j]

        return norm_prim_func(T, body, M, N, dtype, has_res=True, has_bias=False)

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        M = rows(T, p)
        N, eps, dtype = p["N"], p["eps"], p["dtype"]
        threads = p["threads"]
        NP = padded(N, threads)
        scale = rms_scale(T, N, NP, eps)

        @T.macro
        def body(X, R, W, B, Y, Rout):
            # One row per block, held in registers: X and R read once, Y and R' written once.
            with T.Kernel(M, threads=threads) as bx:
                dependent_launch(target)
                h = T.alloc_fragment((1, NP), dtype)
                r = T.alloc_fragment((1, NP), dtype)
                x = T.alloc_fragment((1, NP), "float32")
                sq = T.alloc_fragment((1, NP), "float32")
                ss = T.alloc_fragment((1,), "float32")
                T.copy(X[bx, 0:NP], h)
                T.copy(R[bx, 0:NP], r)
                for i, j in T.Parallel(1, NP):  # the fp32 sum, rounded once to the stored dtype
                    h[i, j] = T.cast(T.cast(h[i, j], "float32") + T.cast(r[i, j], "float32"), dtype)
                T.copy(h, Rout[bx, 0:NP])
                for i, j in T.Parallel(1, NP):
                    x[i, j] = T.cast(h[i, j], "float32")
                    sq[i, j] = squared(T, x, i, j, N, NP)
                scale(x, sq, ss, W, Y, bx)

        return norm_prim_func(T, body, M, N, dtype, has_res=True, has_bias=False)

    def inputs(self, p, randn, size):
        return [randn(size("M"), p["N"]), randn(size("M"), p["N"]), randn(p["N"])]

    def reference(self, p, x):
        import torch

        h = (x[0] + x[1]).to(getattr(torch, p["dtype"])).float()  # the rounded sum is what is normalised
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + p["eps"]) * x[2], h
