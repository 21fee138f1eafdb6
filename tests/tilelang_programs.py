"""TileLang code as engines write it, for target "c", compiled through TileLang's own API
(`@tilelang.jit`, `tilelang.compile`, `par_compile`): what tests/test_tilelang_cache.py runs in
processes with KERNEL_SERVICE_TILELANG=1. Nothing here knows about the kernel service."""

import tilelang
import tilelang.language as T


@tilelang.jit(target="c", out_idx=[-1])
def scale(N, s=2.0, dtype="float32"):
    """Y = X * s, lazy style, runtime rows."""
    M = T.dynamic("M")

    @T.prim_func
    def main(X: T.Tensor((M, N), dtype), Y: T.Tensor((M, N), dtype)):
        with T.Kernel(M) as bx:
            for j in T.serial(N):
                Y[bx, j] = X[bx, j] * s

    return main


@tilelang.jit(target="c")
def eager_add(A, B):
    """C = A + B, eager style: sizes from T.const, the output from T.empty."""
    M, N = T.const("M, N")
    A: T.Tensor((M, N), T.float32)
    B: T.Tensor((M, N), T.float32)
    C = T.empty((M, N), T.float32)
    with T.Kernel(M) as bx:
        for j in T.serial(N):
            C[bx, j] = A[bx, j] + B[bx, j]
    return C


def shift(N, by: float):
    """Y = X + by, a plain PrimFunc for tilelang.compile / par_compile."""

    @T.prim_func
    def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            for j in T.serial(N):
                Y[j] = X[j] + by

    return main


@tilelang.jit(target="c", out_idx=[-1])
def with_include(N):
    """Y = X * 3 with a C prelude that includes a header: C source, which does not travel."""

    @T.prim_func
    def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            T.import_source("#include <math.h>\n")
            for j in T.serial(N):
                Y[j] = X[j] * 3.0

    return main


def with_source(N, source: str):
    """Y = X * 3 with `source` as a C prelude (T.import_source): what an attacker would send."""

    @T.prim_func
    def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            T.import_source(source)
            for j in T.serial(N):
                Y[j] = X[j] * 3.0

    return main


def calling(N, name: str):
    """Y = X with a call to the extern function `name`: its name reaches the C source as written."""

    @T.prim_func
    def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
        with T.Kernel(1):
            T.evaluate(T.call_extern("int32", name))
            for j in T.serial(N):
                Y[j] = X[j]

    return main
