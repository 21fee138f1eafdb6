"""Y = X * rsqrt(mean(X^2) + eps) * W over each row, fp32 accumulation."""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .launch import dependent_launch
from .registry import register
from .rows import RowKind, norm_prim_func, rms_scale, rows, squared
from .spec import Param, Target, dim, dtype_param, tile
from .tiling import padded


@register
class RMSNorm(RowKind):
    name = "rmsnorm"
    doc = "Y[M,N] = X * rsqrt(mean(X^2, row) + eps) * W[N]."
    params = (
        dim("M", "rows; None makes it a runtime size", dynamic=True),
        dim("N", "row length (hidden size)"),
        Param("eps", float, default=1e-6, min=0.0, max=1.0, doc="added to the mean square"),
        dtype_param(),
        tile("threads", "threads per row (CUDA only)"),
    )

    def build_cpu(self, p):
        import tilelang.language as T

        M = rows(T, p)
        N, eps, dtype = p["N"], p["eps"], p["dtype"]

        @T.macro
        def body(X, R, W, B, Y, Rout):
            with T.Kernel(M) as bx:
                ss = T.alloc_local((1,), "float32")
                ss[0] = 0
                for j in T.serial(N):
                    ss[0] += X[bx, j] * X[bx, j]
                ss[0] = T.rsqrt(ss[0] / N + eps)
                for j in T.serial(N):
                    Y[bx, j] = X[bx, j] * ss[0] * W[j]

        return norm_prim_func(T, body, M, N, dtype, has_res=False, has_bias=False)

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        M = rows(T, p)
        N, eps, dtype = p["N"], p["eps"], p["dtype"]
        threads = p["threads"]
        NP = padded(N, threads)
        scale = rms_scale(T, N, NP, eps)

        @T.macro
        def body(X, R, W, B, Y, Rout):
            # One row per block, read once into registers: one pass over memory each way.
            with T.Kernel(M, threads=threads) as bx:
                dependent_launch(target)
                x = T.alloc_fragment((1, NP), "float32")
                sq = T.alloc_fragment((1, NP), "float32")
                ss = T.alloc_fragment((1,), "float32")
                T.copy(X[bx, 0:NP], x)
                for i, j in T.Parallel(1, NP):
                    sq[i, j] = squared(T, x, i, j, N, NP)
                scale(x, sq, ss, W, Y, bx)

        return norm_prim_func(T, body, M, N, dtype, has_res=False, has_bias=False)

    def inputs(self, p, randn, size):
        return [randn(size("M"), p["N"]), randn(p["N"])]

    def reference(self, p, x):
        import torch

        return x[0] * torch.rsqrt(x[0].pow(2).mean(-1, keepdim=True) + p["eps"]) * x[1]
