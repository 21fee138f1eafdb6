"""out = silu(gate) * up (`swiglu`) or gelu(gate) * up (`geglu`), elementwise, computed in fp32.

Gate and up come as two tensors, or with `packed` as one X[M, 2N] = [gate | up] along
the last dim: a fused gate/up GEMM's output (vLLM's silu_and_mul / gelu_and_mul layout).
"""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .launch import dependent_launch
from .registry import register
from .spec import InvalidSpec, KernelKind, Param, Target, dim, dtype_param, tile
from .tiling import check_row_alignment, pow2


def _silu_mul(T, g, u):
    g = T.cast(g, "float32")
    return g / (1.0 + T.exp(-g)) * T.cast(u, "float32")


def _gelu_mul(T, g, u, approximate):
    """torch's F.gelu(g, approximate=...) * u."""
    g = T.cast(g, "float32")
    if approximate == "tanh":
        act = 0.5 * g * (1.0 + T.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))  # sqrt(2/pi)
    else:
        act = 0.5 * g * (1.0 + T.erf(g * 0.7071067811865476))  # 1/sqrt(2)
    return act * T.cast(u, "float32")


def prim_func(T, body, M, N, dtype, packed):
    """The PrimFunc of the ABI (G, U, Y), or (X, Y) when packed, around `body(G, U, up, Y)`:
    up[i, j] is U[i, up + j] (up = N in X, where G and U are both X)."""
    if packed:

        @T.prim_func
        def main(X: T.Tensor((M, 2 * N), dtype), Y: T.Tensor((M, N), dtype)):
            body(X, X, N, Y)
    else:

        @T.prim_func
        def main(G: T.Tensor((M, N), dtype), U: T.Tensor((M, N), dtype), Y: T.Tensor((M, N), dtype)):
            body(G, U, 0, Y)

    return main


@register
class SwiGLU(KernelKind):
    name = "swiglu"
    warm_up = ({"M": 256, "N": 1024, "dtype": "float16"},)
    compile_cost = 0.5
    doc = "out[M,N] = silu(gate[M,N]) * up[M,N]; packed: one X[M,2N] = [gate | up] (vLLM's silu_and_mul)."
    params = (
        dim("M", "rows; None makes it a runtime size", dynamic=True),
        dim("N", "row length (intermediate size)"),
        dtype_param(),
        Param("packed", bool, default=False, doc="one input X[M, 2N] = [gate | up] along the last dim (a fused gate/up GEMM's output) instead of gate and up"),
        tile("block_M", "rows per block"),
        tile("block_N", "columns per block"),
    )

    @staticmethod
    def act_mul(T, p, g, u):
        """The gated product of one element, in fp32."""
        return _silu_mul(T, g, u)

    def inplace(self, p):
        # Elementwise: each element read, then written, by one thread. Packed, Y is half X's size.
        return {} if p["packed"] else {"Y": "G"}

    def check(self, p, target):
        # GPU: 8192 elements per block of 256 threads, 32 (four 16-byte vectors) per thread, in
        # tiles of columns that divide N when a power of two from 1024 down to 128 does: a ragged
        # last tile of columns (N 1152 in 1024s) runs guarded and mostly idle.
        bm, bn = (4, 64) if target.is_cpu else (8, 1024)
        if not target.is_cpu and not p["block_N"]:
            bn = next((b for b in (1024, 512, 256, 128) if p["N"] % b == 0), 1024)
            bm = 8192 // bn
        p["block_M"] = p["block_M"] or bm
        p["block_N"] = p["block_N"] or bn
        for name in ("block_M", "block_N"):
            pow2(name, p[name], 1, 1024)
        if not target.is_cpu:
            per_thread = p["block_M"] * p["block_N"] // 256
            if not 8 <= per_thread <= 64:
                raise InvalidSpec("block_N", f"block_M*block_N must be 2048..16384 on CUDA (8..64 elements per thread), got {p['block_M'] * p['block_N']}")
            check_row_alignment(p)  # packed, this also keeps the up half (at column N) 16-byte aligned
        return p

    def build_cpu(self, p):
        import tilelang.language as T

        M = p["M"] if p["M"] is not None else T.dynamic("M")
        N, dtype, bm, bn = p["N"], p["dtype"], p["block_M"], p["block_N"]

        @T.macro
        def body(G, U, up, Y):
            with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm)) as (bx, by):
                for i, j in T.grid(bm, bn):
                    if by * bm + i < M and bx * bn + j < N:
                        Y[by * bm + i, bx * bn + j] = self.act_mul(T, p, G[by * bm + i, bx * bn + j], U[by * bm + i, up + bx * bn + j])

        return prim_func(T, body, M, N, dtype, p["packed"])

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        M = p["M"] if p["M"] is not None else T.dynamic("M")
        N, dtype, bm, bn = p["N"], p["dtype"], p["block_M"], p["block_N"]

        @T.macro
        def body(G, U, up, Y):
            with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), threads=256) as (bx, by):
                dependent_launch(target)
                g = T.alloc_fragment((bm, bn), dtype)
                u = T.alloc_fragment((bm, bn), dtype)
                # T.copy guards the ragged edges and vectorizes the rest. Packed, a gate tile
                # past column N reads up values (inside X) that no stored column uses.
                T.copy(G[by * bm, bx * bn], g)
                T.copy(U[by * bm, up + bx * bn], u)
                for i, j in T.Parallel(bm, bn):
                    g[i, j] = self.act_mul(T, p, g[i, j], u[i, j])
                T.copy(g, Y[by * bm, bx * bn])

        return prim_func(T, body, M, N, dtype, p["packed"])

    def inputs(self, p, randn, size):
        if p["packed"]:
            return [randn(size("M"), 2 * p["N"])]
        return [randn(size("M"), p["N"]), randn(size("M"), p["N"])]

    def reference(self, p, x):
        import torch.nn.functional as F

        gate, up = x[0].chunk(2, dim=-1) if p["packed"] else x
        return self.torch_act(F, p, gate) * up

    @staticmethod
    def torch_act(F, p, gate):
        """The activation in torch, for reference()."""
        return F.silu(gate)


@register
class GeGLU(SwiGLU):
    name = "geglu"
    warm_up = ()  # swiglu's warm-up parses the same headers
    doc = "out[M,N] = gelu(gate[M,N]) * up[M,N] (torch's F.gelu, exact or tanh); packed: one X[M,2N] = [gate | up] (vLLM's gelu_and_mul)."
    params = (
        *SwiGLU.params,
        Param("approximate", str, default="none", choices=("none", "tanh"), doc="as torch's F.gelu: 'none' (erf) or 'tanh'"),
    )

    @staticmethod
    def act_mul(T, p, g, u):
        return _gelu_mul(T, g, u, p["approximate"])

    @staticmethod
    def torch_act(F, p, gate):
        return F.gelu(gate, approximate=p["approximate"])
