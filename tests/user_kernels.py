"""User TileLang kernels as agents write them, in CPU style (target "c"), several in one module:
`serve --kernel-module tests.user_kernels` serves each @tilelang.jit / @autotune object here
under its name."""

import tilelang
import tilelang.language as T
from tilelang.autotuner import autotune

from kernels.jit import serve


@tilelang.jit
def eager_matmul(A, B, block_K=4, dtype=T.float32, accum_dtype=T.float32):
    """C = A @ B, eager style: sizes from T.const, the output from T.empty."""
    M, N, K = T.const("M, N, K")
    A: T.Tensor((M, K), dtype)
    B: T.Tensor((K, N), dtype)
    C = T.empty((M, N), dtype)
    with T.Kernel(M) as bx:
        acc = T.alloc_local((1,), accum_dtype)
        for j in T.serial(N):
            acc[0] = 0
            for ko in T.serial(T.ceildiv(K, block_K)):
                for ki in T.serial(block_K):
                    if ko * block_K + ki < K:
                        acc[0] += A[bx, ko * block_K + ki] * B[ko * block_K + ki, j]
            C[bx, j] = acc[0]
    return C


@tilelang.jit
def eager_rmsnorm(X, W, eps=1e-6, dtype=T.float32, accum_dtype=T.float32):
    """Y = X * rsqrt(mean(X^2) + eps) * W, eager style."""
    M, N = T.const("M, N")
    X: T.Tensor((M, N), dtype)
    W: T.Tensor((N,), dtype)
    Y = T.empty((M, N), dtype)
    with T.Kernel(M) as bx:
        ss = T.alloc_local((1,), accum_dtype)
        ss[0] = 0
        for j in T.serial(N):
            ss[0] += X[bx, j] * X[bx, j]
        ss[0] = T.rsqrt(ss[0] / N + eps)
        for j in T.serial(N):
            Y[bx, j] = X[bx, j] * ss[0] * W[j]
    return Y


@tilelang.jit(out_idx=[-1])
def gemm_kernel(N, K, trans_b, M=None, num_stages=0, dtype="float32"):
    """C = A @ B (B given [N, K] when trans_b), lazy style; M=None: a runtime row count."""
    rows = T.dynamic("M") if M is None else M
    b_shape = (N, K) if trans_b else (K, N)

    @T.prim_func
    def main(A: T.Tensor((rows, K), dtype), B: T.Tensor(b_shape, dtype), C: T.Tensor((rows, N), dtype)):
        with T.Kernel(rows) as bx:
            acc = T.alloc_local((1,), "float32")
            for j in T.serial(N):
                acc[0] = 0
                for k in T.serial(K):
                    acc[0] += A[bx, k] * (B[j, k] if trans_b else B[k, j])
                C[bx, j] = acc[0] + num_stages  # num_stages=0 is meaningful: it adds nothing

    return main


@autotune(configs=[{"unroll": 1}, {"unroll": 2}])
@tilelang.jit(out_idx=[-1])
def tuned_scale(N, unroll, scale=2.0, dtype="float32"):
    """Y = X * scale, autotuned over `unroll` (served with the config the request gives)."""
    M = T.dynamic("M")

    @T.prim_func
    def main(X: T.Tensor((M, N), dtype), Y: T.Tensor((M, N), dtype)):
        with T.Kernel(M) as bx:
            for jo in T.serial(T.ceildiv(N, unroll)):
                for ji in T.serial(unroll):
                    if jo * unroll + ji < N:
                        Y[bx, jo * unroll + ji] = X[bx, jo * unroll + ji] * scale

    return main


@serve(outputs=(), writes=("X",))
@tilelang.jit
def scale_rows_(N, scale: float, dtype="float32"):
    """X *= scale in place: no output."""
    M = T.dynamic("M")

    @T.prim_func
    def main(X: T.Tensor((M, N), dtype)):
        with T.Kernel(M) as bx:
            for j in T.serial(N):
                X[bx, j] = X[bx, j] * scale

    return main


@tilelang.jit
def eager_accumulate(A, B, C, dtype=T.float32):
    """C += A @ B, eager style with no T.empty (TileLang's splitK GEMM example): no output, C updated."""
    M, N, K = T.const("M, N, K")
    A: T.Tensor((M, K), dtype)
    B: T.Tensor((K, N), dtype)
    C: T.Tensor((M, N), dtype)
    with T.Kernel(M) as bx:
        for j in T.serial(N):
            for k in T.serial(K):
                C[bx, j] = C[bx, j] + A[bx, k] * B[k, j]


@tilelang.jit(target="cuda")
def cuda_only(N, dtype="float16"):
    """Declared for CUDA only by its decorator."""

    @T.prim_func
    def main(X: T.Tensor((N,), dtype), Y: T.Tensor((N,), dtype)):
        with T.Kernel(1):
            for i in T.serial(N):
                Y[i] = X[i]

    return main
