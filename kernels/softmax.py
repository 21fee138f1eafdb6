"""Row-wise softmax, max-subtracted for stability, fp32 arithmetic."""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .registry import register
from .spec import InvalidSpec, KernelKind, Target, dim, dtype_param, tile

LOG2E = 1.4426950408889634
MAX_ROW_CUDA = 16384  # one row lives in one block's registers: at most 64 fp32 per thread
MAX_PER_THREAD = 64


def default_threads(n, dtype):
    """Fewest threads (128..1024) holding at most 64 elements each, preferring a
    count that gives every thread whole 16-byte vectors."""
    vec = 4 if dtype == "float32" else 8
    fits = [t for t in (128, 256, 512, 1024) if -(-n // t) <= MAX_PER_THREAD]
    return next((t for t in fits if n % (t * vec) == 0), fits[0])


def check_row(p, target):
    """Shared by the one-row-per-block kinds (softmax, rmsnorm)."""
    if target.is_cpu:
        if p["threads"] is not None:
            raise InvalidSpec("threads", "applies only to CUDA targets")
        return p
    if p["N"] > MAX_ROW_CUDA:
        raise InvalidSpec("N", f"rows longer than {MAX_ROW_CUDA} are not supported on CUDA (a row is held in one block's registers), got {p['N']}")
    if p["N"] % 8:
        raise InvalidSpec("N", f"must be a multiple of 8 on CUDA (16-byte rows), got {p['N']}")
    if p["threads"] is None:
        p["threads"] = default_threads(p["N"], p["dtype"])
    t = p["threads"]
    if t & (t - 1) or not 32 <= t <= 1024:
        raise InvalidSpec("threads", f"must be a power of two in [32, 1024], got {t}")
    if -(-p["N"] // t) > MAX_PER_THREAD:
        raise InvalidSpec("threads", f"{t} threads would hold {-(-p['N'] // t)} elements each (max {MAX_PER_THREAD}); use more threads")
    return p


def padded(n, threads):
    """n rounded up to a multiple of threads: a fragment's layout needs the multiple."""
    return -(-n // threads) * threads


@register
class Softmax(KernelKind):
    name = "softmax"
    doc = "Y[M,N] = softmax(X[M,N]) along each row."
    params = (
        dim("M", "rows; None makes it a runtime size", dynamic=True),
        dim("N", "row length"),
        dtype_param(),
        tile("threads", "threads per row (CUDA only)"),
    )

    def check(self, p, target):
        return check_row(p, target)

    def build_cpu(self, p):
        import tilelang.language as T

        M = p["M"] if p["M"] is not None else T.dynamic("M")
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

        M = p["M"] if p["M"] is not None else T.dynamic("M")
        N, dtype = p["N"], p["dtype"]
        threads = p["threads"]
        NP = padded(N, threads)

        @T.prim_func
        def main(X: T.Tensor((M, N), dtype), Y: T.Tensor((M, N), dtype)):
            # One row per block, read once into registers: one pass over memory each way.
            with T.Kernel(M, threads=threads) as bx:
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
