"""Y = X * rsqrt(mean(X^2) + eps) * W over each row, fp32 accumulation; with `residual`
(add_rmsnorm's builders) the row normalised is H = X + R, stored first as R'."""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .launch import dependent_launch
from .registry import register
from .rows import ROWS, RowKind, norm_params, norm_prim_func, rms_scale, rows, squared
from .spec import Target
from .tiling import padded


@register
class RMSNorm(RowKind):
    name = "rmsnorm"
    doc = "Y[M,N] = X * rsqrt(mean(X^2, row) + eps) * W[N]."
    params = norm_params(ROWS, 1e-6, "added to the mean square")

    residual = False  # add_rmsnorm: H = X + R first, stored as R' (Rout) and normalised

    def build_cpu(self, p):
        import tilelang.language as T

        M = rows(T, p)
        N, eps, dtype = p["N"], p["eps"], p["dtype"]
        residual = self.residual

        @T.macro
        def body(X, R, W, B, Y, Rout):
            with T.Kernel(M) as bx:
                ss = T.alloc_local((1,), "float32")
                if residual:
                    h = T.alloc_local((1,), "float32")
                ss[0] = 0
                for j in T.serial(N):
                    if residual:  # R' first: Y is computed from it, and R may be Rout
                        Rout[bx, j] = X[bx, j] + R[bx, j]
                        ss[0] += Rout[bx, j] * Rout[bx, j]
                    else:
                        ss[0] += X[bx, j] * X[bx, j]
                ss[0] = T.rsqrt(ss[0] / N + eps)
                for j in T.serial(N):
                    if residual:
                        h[0] = Rout[bx, j]
                        Y[bx, j] = h[0] * ss[0] * W[j]
                    else:
                        Y[bx, j] = X[bx, j] * ss[0] * W[j]

        return norm_prim_func(T, body, M, N, dtype, has_res=residual, has_bias=False)

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        M = rows(T, p)
        N, eps, dtype = p["N"], p["eps"], p["dtype"]
        threads = p["threads"]
        NP = padded(N, threads)
        scale = rms_scale(T, N, NP, eps)
        residual = self.residual

        @T.macro
        def body(X, R, W, B, Y, Rout):
            # One row per block, read once into registers: every input read once, every output written once.
            with T.Kernel(M, threads=threads) as bx:
                dependent_launch(target)
                if residual:
                    h = T.alloc_fragment((1, NP), dtype)
                    r = T.alloc_fragment((1, NP), dtype)
                x = T.alloc_fragment((1, NP), "float32")
                sq = T.alloc_fragment((1, NP), "float32")
                ss = T.alloc_fragment((1,), "float32")
                if residual:
                    T.copy(X[bx, 0:NP], h)
                    T.copy(R[bx, 0:NP], r)
                    for i, j in T.Parallel(1, NP):  # the fp32 sum, rounded once to the stored dtype
                        h[i, j] = T.cast(T.cast(h[i, j], "float32") + T.cast(r[i, j], "float32"), dtype)
                    T.copy(h, Rout[bx, 0:NP])
                    for i, j in T.Parallel(1, NP):
                        x[i, j] = T.cast(h[i, j], "float32")
                        sq[i, j] = squared(T, x, i, j, N, NP)
                else:
                    T.copy(X[bx, 0:NP], x)
                    for i, j in T.Parallel(1, NP):
                        sq[i, j] = squared(T, x, i, j, N, NP)
                scale(x, sq, ss, W, Y, bx)

        return norm_prim_func(T, body, M, N, dtype, has_res=residual, has_bias=False)

    def inputs(self, p, randn, size):
        return [randn(size("M"), p["N"]), randn(p["N"])]

    def reference(self, p, x):
        import torch

        return x[0] * torch.rsqrt(x[0].pow(2).mean(-1, keepdim=True) + p["eps"]) * x[1]
