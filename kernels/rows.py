"""What the one-row-per-block kinds (rmsnorm, add_rmsnorm, layernorm, softmax) share: their
validation, in-place rule and parameters, the PrimFunc of the norms' ABI and the RMS scaling step."""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .spec import KernelKind, Param, dim, dtype_param, tile
from .tiling import check_row

# The row kinds' shared parameters.
ROWS = dim("M", "rows; None makes it a runtime size", dynamic=True)
TOKENS = dim("M", "rows (tokens); None makes it a runtime size", dynamic=True)
HIDDEN = dim("N", "row length (hidden size)")
THREADS = tile("threads", "threads per row (CUDA only)")


def norm_params(rows, eps, eps_doc, *options):
    """A norm's parameters, in their order (the spec's): `rows` (ROWS or TOKENS), N, eps (its
    default and what it is added to), dtype, then the kind's `options`, then threads."""
    eps_param = Param("eps", float, default=eps, min=0.0, max=1.0, doc=eps_doc)
    return (rows, HIDDEN, eps_param, dtype_param(), *options, THREADS)


class RowKind(KernelKind):
    """A kind that holds one row per block (a thread on the CPU), X[M, N] in and Y[M, N] out."""

    warm_up = ({"M": 256, "N": 1024, "dtype": "float16"},)
    compile_cost = 0.5

    def inplace(self, p):
        return {"Y": "X"}  # one row per block (a thread), read whole before it is written

    def check(self, p, target):
        return check_row(p, target)


def rows(T, p):
    """M, or a runtime size when the spec leaves it open."""
    return p["M"] if p["M"] is not None else T.dynamic("M")


def squared(T, x, i, j, N, NP):
    """x[i, j]^2, and 0 in the padding columns past N: they add nothing to the sum."""
    return T.if_then_else(j < N, x[i, j] * x[i, j], 0) if NP != N else x[i, j] * x[i, j]


def rms_scale(T, N, NP, eps):
    """The CUDA RMS step: with sq = x^2 (fp32 fragments of one row), Y = x * rsqrt(mean + eps) * W."""

    @T.macro
    def scale(x, sq, ss, W, Y, bx):
        T.reduce_sum(sq, ss, dim=1)
        for i in T.Parallel(1):
            ss[i] = T.rsqrt(ss[i] / N + eps)
        for i, j in T.Parallel(1, NP):  # W is small and L2-resident: read it in place
            x[i, j] = x[i, j] * ss[i] * W[T.min(j, N - 1)]
        T.copy(x, Y[bx, 0:NP])

    return scale


def norm_prim_func(T, body, M, N, dtype, has_res, has_bias):
    """The PrimFunc of the norms' ABI (X[, R], W[, B], Y[, Rout]) around `body(X, R, W, B, Y, Rout)`."""
    row, vec = (M, N), (N,)
    if has_res and has_bias:

        @T.prim_func
        def main(
            X: T.Tensor(row, dtype),
            R: T.Tensor(row, dtype),
            W: T.Tensor(vec, dtype),
            B: T.Tensor(vec, dtype),
            Y: T.Tensor(row, dtype),
            Rout: T.Tensor(row, dtype),
        ):
            body(X, R, W, B, Y, Rout)
    elif has_res:

        @T.prim_func
        def main(X: T.Tensor(row, dtype), R: T.Tensor(row, dtype), W: T.Tensor(vec, dtype), Y: T.Tensor(row, dtype), Rout: T.Tensor(row, dtype)):
            body(X, R, W, None, Y, Rout)
    elif has_bias:

        @T.prim_func
        def main(X: T.Tensor(row, dtype), W: T.Tensor(vec, dtype), B: T.Tensor(vec, dtype), Y: T.Tensor(row, dtype)):
            body(X, None, W, B, Y, None)
    else:

        @T.prim_func
        def main(X: T.Tensor(row, dtype), W: T.Tensor(vec, dtype), Y: T.Tensor(row, dtype)):
            body(X, None, W, None, Y, None)

    return main
