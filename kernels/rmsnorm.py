"""Y = X * rsqrt(mean(X^2) + eps) * W over each row, fp32 accumulation."""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .launch import dependent_launch
from .registry import register
from .spec import KernelKind, Param, Target, dim, dtype_param, tile
from .tiling import check_row, padded


@register
class RMSNorm(KernelKind):
    name = "rmsnorm"
    warm_up = ({"M": 256, "N": 1024, "dtype": "float16"},)
    compile_cost = 0.5
    doc = "Y[M,N] = X * rsqrt(mean(X^2, row) + eps) * W[N]."
    params = (
        dim("M", "rows; None makes it a runtime size", dynamic=True),
        dim("N", "row length (hidden size)"),
        Param("eps", float, default=1e-6, min=0.0, max=1.0, doc="added to the mean square"),
        dtype_param(),
        tile("threads", "threads per row (CUDA only)"),
    )

    def inplace(self, p):
        return {"Y": "X"}  # one row per block (a thread), read whole before it is written

    def check(self, p, target):
        return check_row(p, target)

    def build_cpu(self, p):
        import tilelang.language as T

        M = p["M"] if p["M"] is not None else T.dynamic("M")
        N, eps, dtype = p["N"], p["eps"], p["dtype"]

        @T.prim_func
        def main(X: T.Tensor((M, N), dtype), W: T.Tensor((N,), dtype), Y: T.Tensor((M, N), dtype)):
            with T.Kernel(M) as bx:
                ss = T.alloc_local((1,), "float32")
                ss[0] = 0
                for j in T.serial(N):
                    ss[0] += X[bx, j] * X[bx, j]
                ss[0] = T.rsqrt(ss[0] / N + eps)
                for j in T.serial(N):
                    Y[bx, j] = X[bx, j] * ss[0] * W[j]

        return main

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        M = p["M"] if p["M"] is not None else T.dynamic("M")
        N, eps, dtype = p["N"], p["eps"], p["dtype"]
        threads = p["threads"]
        NP = padded(N, threads)

        @T.prim_func
        def main(X: T.Tensor((M, N), dtype), W: T.Tensor((N,), dtype), Y: T.Tensor((M, N), dtype)):
            # One row per block, read once into registers: one pass over memory each way.
            with T.Kernel(M, threads=threads) as bx:
                dependent_launch(target)
                x = T.alloc_fragment((1, NP), "float32")
                sq = T.alloc_fragment((1, NP), "float32")
                ss = T.alloc_fragment((1,), "float32")
                T.copy(X[bx, 0:NP], x)
                for i, j in T.Parallel(1, NP):  # padding columns add nothing to the sum
                    sq[i, j] = T.if_then_else(j < N, x[i, j] * x[i, j], 0) if NP != N else x[i, j] * x[i, j]
                T.reduce_sum(sq, ss, dim=1)
                for i in T.Parallel(1):
                    ss[i] = T.rsqrt(ss[i] / N + eps)
                for i, j in T.Parallel(1, NP):  # W is small and L2-resident: read it in place
                    x[i, j] = x[i, j] * ss[i] * W[T.min(j, N - 1)]
                T.copy(x, Y[bx, 0:NP])

        return main

    def inputs(self, p, randn, size):
        return [randn(size("M"), p["N"]), randn(p["N"])]

    def reference(self, p, x):
        import torch

        return x[0] * torch.rsqrt(x[0].pow(2).mean(-1, keepdim=True) + p["eps"]) * x[1]
