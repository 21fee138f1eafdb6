"""A plain @tilelang.jit factory, as agents write them: served with one entry-point line."""

import tilelang
import tilelang.language as T


@tilelang.jit(out_idx=[-1])
def row_scale_kernel(N, scale=2.0, dtype="float32"):
    """Y[M,N] = X * scale * W[N], rows of a runtime count M."""
    M = T.dynamic("M")

    @T.prim_func
    def main(X: T.Tensor((M, N), dtype), W: T.Tensor((N,), dtype), Y: T.Tensor((M, N), dtype)):
        with T.Kernel(M) as bx:
            for j in T.serial(N):
                Y[bx, j] = X[bx, j] * scale * W[j]

    return main
