"""LayerNorm over rows: Y = (H - mean(H)) * rsqrt(var(H) + eps) * W [+ B], fp32 arithmetic,
with H = X, or H = X + R (rounded to the dtype, stored as the new residual R') when `residual`.

The variance is the biased one (torch.nn.functional.layer_norm's), computed from the row
held in registers as mean((H - mean)^2): two reductions, still one pass over memory.
As in add_rmsnorm, the rounded sum R' is what is normalised.
"""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .launch import dependent_launch
from .registry import register
from .rows import TOKENS, RowKind, norm_params, norm_prim_func, rows, squared
from .spec import Param, Target
from .tiling import padded


@register
class LayerNorm(RowKind):
    name = "layernorm"
    warm_up = ({"M": 256, "N": 1024, "dtype": "float16", "bias": True},)
    multi_output = True  # one output, or two with `residual`: the torch op returns a list
    doc = "Y[M,N] = (H - mean) * rsqrt(var + eps) * W[N] (+ B[N]) over rows, H = X or, with residual, R' = X + R[M,N]; returns Y, or (Y, R') with residual (out=(Y, R) updates R in place)."
    params = norm_params(
        TOKENS,
        1e-5,
        "added to the variance (torch's default 1e-5)",
        Param("bias", bool, default=False, doc="add a B[N] input (after W)"),
        Param("residual", bool, default=False, doc="add an R[M,N] input (after X) first, and return the sum R' as a second output"),
    )

    def output_slots(self, p):
        return (-2, -1) if p["residual"] else (-1,)

    def inplace(self, p):
        # One row per block (a thread on the CPU), read whole before any output is written.
        return {"Y": "X", "Rout": "R"} if p["residual"] else {"Y": "X"}

    def build_cpu(self, p):
        import tilelang.language as T

        M = rows(T, p)
        N, eps, dtype = p["N"], p["eps"], p["dtype"]
        has_res, has_bias = p["residual"], p["bias"]

        def h(X, Rout, i, j):  # the normalised row: R' when there is a residual (a call, not a rebinding, keeps the buffers' names)
            return Rout[i, j] if has_res else X[i, j]

        @T.macro
        def body(X, R, W, B, Y, Rout):
            with T.Kernel(M) as bx:
                s = T.alloc_local((2,), "float32")  # mean, then rstd
                d = T.alloc_local((1,), "float32")
                s[0] = 0
                for j in T.serial(N):
                    if has_res:  # R' first: the norm reads it, and R may be Rout
                        Rout[bx, j] = X[bx, j] + R[bx, j]
                    s[0] += h(X, Rout, bx, j)
                s[0] = s[0] / N
                s[1] = 0
                for j in T.serial(N):
                    d[0] = h(X, Rout, bx, j) - s[0]
                    s[1] += d[0] * d[0]
                s[1] = T.rsqrt(s[1] / N + eps)
                for j in T.serial(N):
                    d[0] = (h(X, Rout, bx, j) - s[0]) * s[1] * W[j]
                    if has_bias:
                        d[0] += B[j]
                    Y[bx, j] = d[0]

        return norm_prim_func(T, body, M, N, dtype, has_res, has_bias)

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        M = rows(T, p)
        N, eps, dtype = p["N"], p["eps"], p["dtype"]
        has_res, has_bias = p["residual"], p["bias"]
        threads = p["threads"]
        NP = padded(N, threads)

        @T.macro
        def body(X, R, W, B, Y, Rout):
            # One row per block, held in registers: every input read once, every output written once.
            with T.Kernel(M, threads=threads) as bx:
                dependent_launch(target)
                h = T.alloc_fragment((1, NP), dtype)
                x = T.alloc_fragment((1, NP), "float32")
                sq = T.alloc_fragment((1, NP), "float32")
                mean = T.alloc_fragment((1,), "float32")
                rstd = T.alloc_fragment((1,), "float32")
                T.copy(X[bx, 0:NP], h)
                if has_res:
                    r = T.alloc_fragment((1, NP), dtype)
                    T.copy(R[bx, 0:NP], r)
                    for i, j in T.Parallel(1, NP):  # the fp32 sum, rounded once to the stored dtype
                        h[i, j] = T.cast(T.cast(h[i, j], "float32") + T.cast(r[i, j], "float32"), dtype)
                    T.copy(h, Rout[bx, 0:NP])
                for i, j in T.Parallel(1, NP):  # padding columns are zeros: they add nothing to the sums
                    x[i, j] = T.if_then_else(j < N, T.cast(h[i, j], "float32"), 0) if NP != N else T.cast(h[i, j], "float32")
                T.reduce_sum(x, mean, dim=1)
                for i in T.Parallel(1):
                    mean[i] = mean[i] / N
                for i, j in T.Parallel(1, NP):
                    x[i, j] = x[i, j] - mean[i]
                    sq[i, j] = squared(T, x, i, j, N, NP)
                T.reduce_sum(sq, rstd, dim=1)
                for i in T.Parallel(1):
                    rstd[i] = T.rsqrt(rstd[i] / N + eps)
                for i, j in T.Parallel(1, NP):  # W and B are small and L2-resident: read them in place
                    if has_bias:
                        x[i, j] = x[i, j] * rstd[i] * W[T.min(j, N - 1)] + B[T.min(j, N - 1)]
                    else:
                        x[i, j] = x[i, j] * rstd[i] * W[T.min(j, N - 1)]
                T.copy(x, Y[bx, 0:NP])

        return norm_prim_func(T, body, M, N, dtype, has_res, has_bias)

    def inputs(self, p, randn, size):
        m, n = size("M"), p["N"]
        ins = [randn(m, n, scale=2.0)]
        if p["residual"]:
            ins.append(randn(m, n))
        ins.append(randn(n))
        if p["bias"]:
            ins.append(randn(n))
        return ins

    def reference(self, p, x):
        import torch
        import torch.nn.functional as F

        h, rest = x[0], list(x[1:])
        if p["residual"]:
            h = (h + rest.pop(0)).to(getattr(torch, p["dtype"])).float()  # the rounded sum is what is normalised
        w = rest.pop(0)
        b = rest.pop(0) if p["bias"] else None
        y = F.layer_norm(h, (p["N"],), w, b, p["eps"])
        return (y, h) if p["residual"] else y
