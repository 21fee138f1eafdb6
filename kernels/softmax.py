"""Row-wise softmax, max-subtracted for stability, fp32 arithmetic."""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .launch import dependent_launch
from .registry import register
from .rows import ROWS, THREADS, RowKind, rows
from .spec import Target, dim, dtype_param
from .tiling import padded

LOG2E = 1.4426950408889634


@register
class Softmax(RowKind):
    name = "softmax"
    doc = "Y[M,N] = softmax(X[M,N]) along each row."
    params = (
        ROWS,
        dim("N", "row length"),
        dtype_param(),
        THREADS,
    )

    def build_cpu(self, p):
        import tilelang.language as T

        M = rows(T, p)
        N, dtype = p["N"], p["dtype"]

        @T.prim_func
        def main(X: T.Tensor((M, N), dtype), Y: T.Tensor((M, N), dtype)):
            with T.Kernel(M) as bx:
                mx = T.alloc_local((1,), "float32")
                total = T.alloc_local((1,), "float32")
                mx[0] = -T.infinity("float32")
                total[0] = 0
                for j in T.serial(N):
                    mx[0] = T.max(mx[0], X[bx, j])
                for j in T.serial(N):
                    total[0] += T.exp2((X[bx, j] - mx[0]) * LOG2E)
                for j in T.serial(N):
                    Y[bx, j] = T.exp2((X[bx, j] - mx[0]) * LOG2E) / total[0]

        return main

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        M = rows(T, p)
        N, dtype = p["N"], p["dtype"]
        threads = p["threads"]
        NP = padded(N, threads)

        @T.prim_func
        def main(X: T.Tensor((M, N), dtype), Y: T.Tensor((M, N), dtype)):
            # One row per block, read once into registers: one pass over memory each way.
            with T.Kernel(M, threads=threads) as bx:
                dependent_launch(target)
                x = T.alloc_fragment((1, NP), "float32")
                mx = T.alloc_fragment((1,), "float32")
                total = T.alloc_fragment((1,), "float32")
                T.copy(X[bx, 0:NP], x)
                if NP != N:  # padding columns must not win the max (and then exp to 0)
                    for i, j in T.Parallel(1, NP):
                        x[i, j] = T.if_then_else(j < N, x[i, j], -T.infinity("float32"))
                T.reduce_max(x, mx, dim=1)
                for i, j in T.Parallel(1, NP):
                    x[i, j] = T.exp2((x[i, j] - mx[i]) * LOG2E)
                T.reduce_sum(x, total, dim=1)
                for i in T.Parallel(1):
                    total[i] = 1.0 / total[i]  # one divide per row, then multiplies
                for i, j in T.Parallel(1, NP):
                    x[i, j] = x[i, j] * total[i]
                T.copy(x, Y[bx, 0:NP])

        return main

    def inputs(self, p, randn, size):
        return [randn(size("M"), p["N"], scale=4.0)]

    def reference(self, p, x):
        import torch

        return torch.softmax(x[0], dim=-1)
