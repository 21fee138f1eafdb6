"""C = act(A @ B + bias), B given as [K, N] or [N, K] when trans_b; fp32 accumulation."""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

import math

from .registry import register
from .spec import InvalidSpec, KernelKind, Param, Target, dim, dtype_param, tile
from .tiling import cuda_only, pow2, smem_limit

ACTS = ("none", "gelu", "silu", "relu")


def activation(T, x, act):
    """The epilogue's activation as a TIR expression on fp32 `x` (traced, so shared by both forms)."""
    if act == "gelu":  # exact erf form, as torch's default GELU
        return 0.5 * x * (1.0 + T.erf(x * (1.0 / math.sqrt(2.0))))
    if act == "silu":
        return x / (1.0 + T.exp(-x))
    if act == "relu":
        return T.max(x, T.float32(0))
    return x


def prim_func(T, body, M, N, K, b_shape, dtype, has_bias, has_res):
    """The PrimFunc of the ABI (A, B[, Bias][, R], C) around `body(A, B, Bias, R, C)`."""
    if has_bias and has_res:
        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), Bias: T.Tensor((N,), dtype), R: T.Tensor((M, N), dtype), C: T.Tensor((M, N), dtype)):
            body(A, B, Bias, R, C)
    elif has_bias:
        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), Bias: T.Tensor((N,), dtype), C: T.Tensor((M, N), dtype)):
            body(A, B, Bias, None, C)
    elif has_res:
        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), R: T.Tensor((M, N), dtype), C: T.Tensor((M, N), dtype)):
            body(A, B, None, R, C)
    else:
        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), C: T.Tensor((M, N), dtype)):
            body(A, B, None, None, C)
    return main


@register
class Gemm(KernelKind):
    name = "gemm"
    warm_up = ({"M": 256, "N": 256, "K": 256, "dtype": "float16", "trans_b": True},)
    doc = "C[M,N] = act(A[M,K] @ B + bias[N]) + R[M,N], with B as [K,N] or, when trans_b, [N,K]; bias and R optional; C may be written over R."
    params = (
        dim("M", "rows of A and C; None makes it a runtime size", dynamic=True),
        dim("N", "columns of C; None makes it a runtime size", dynamic=True),
        dim("K", "reduction length"),
        dtype_param(),
        Param("trans_b", bool, default=False, doc="B is stored [N, K], the layout of linear weights"),
        Param("bias", bool, default=False, doc="add a bias[N] input (after B) to every row"),
        Param("act", str, default="none", choices=ACTS, doc="activation applied in the epilogue (gelu is the exact erf form)"),
        Param("residual", bool, default=False, doc="add an R[M,N] input (last) after the activation; `out=R` updates it in place"),
        tile("block_M"),
        tile("block_N"),
        tile("block_K"),
        tile("num_stages", "shared-memory pipeline depth (CUDA only)"),
        tile("threads", "threads per block: 128 or 256 (CUDA only)"),
    )

    def inplace(self, p):
        # Each block reads its tile of R in the epilogue, before it stores that tile of C.
        return {"C": "R"} if p["residual"] else {}

    def check(self, p, target):
        cuda_only(p, target, "num_stages", "threads")
        if target.is_cpu:
            defaults = {"block_M": 32, "block_N": 32, "block_K": 32}
        elif p["dtype"] == "float32" or smem_limit(target) < 200 * 1024:
            # tf32 (4-byte elements) or a pre-Hopper part: a tile that fits ~100 KiB
            defaults = {"block_M": 128, "block_N": 128, "block_K": 32, "num_stages": 3 if smem_limit(target) >= 80 * 1024 else 2, "threads": 256}
        else:  # 128x256x64 in 3 stages: the wgmma-friendly Hopper tile (measured 0.96x cuBLAS on H200)
            defaults = {"block_M": 128, "block_N": 256, "block_K": 64, "num_stages": 3, "threads": 256}
        for name, value in defaults.items():
            if p[name] is None:
                p[name] = value
        bm, bn, bk = p["block_M"], p["block_N"], p["block_K"]
        if target.is_cpu:
            for name in ("block_M", "block_N", "block_K"):
                pow2(name, p[name], 1, 128)
            return p
        pow2("block_M", bm, 16, 256)
        pow2("block_N", bn, 16, 256)
        pow2("block_K", bk, 16, 128)
        if p["threads"] not in (128, 256):
            raise InvalidSpec("threads", f"must be 128 or 256, got {p['threads']}")
        if not 1 <= p["num_stages"] <= 6:
            raise InvalidSpec("num_stages", f"must be in [1, 6], got {p['num_stages']}")
        # Each thread holds bm*bn/threads fp32 accumulators; past 128 they spill.
        if bm * bn // p["threads"] > 128:
            raise InvalidSpec("block_N", f"a {bm}x{bn} tile needs {bm * bn // p['threads']} accumulator registers per thread (max 128); use smaller tiles or more threads")
        # Every warp needs at least a 16x16 piece of the tile.
        if bm * bn < p["threads"] // 32 * 16 * 16:
            raise InvalidSpec("block_M", f"a {bm}x{bn} tile is too small for {p['threads']} threads")
        size = 4 if p["dtype"] == "float32" else 2
        smem = p["num_stages"] * (bm * bk + bk * bn) * size + bm * bn * size
        if smem > smem_limit(target):
            raise InvalidSpec("num_stages", f"tiles need {smem // 1024} KiB of shared memory, over the {smem_limit(target) // 1024} KiB a block gets on {target}")
        # TMA / cp.async move 16-byte-aligned rows: rows of A, B and C have K or N elements.
        align = 16 // size
        for name in ("K", "N"):  # a runtime N must be one too: the call's TMA descriptor refuses others
            if p[name] is not None and p[name] % align:
                raise InvalidSpec(name, f"must be a multiple of {align} for {p['dtype']} on CUDA (16-byte rows)")
        return p

    def host_side_dims(self, p, target):
        # With TMA (sm_90 and newer) M and N only size the grid and the tensors' descriptors,
        # so every value, multiple of the tile or not, runs the same device code; except where
        # TileLang lowers a static size of a single tile otherwise, and a bias reads N.
        if target.is_cpu or target.compute_capability < 90:
            return ()
        if p["residual"] or any(p[d] is not None and p[d] <= p[f"block_{d}"] for d in ("M", "N")):
            return ()  # a residual's tile is read by TMA too, but that claim is not checked (tests/test_shared_builds.py)
        return ("M",) if p["bias"] else ("M", "N")

    def build_cpu(self, p):
        import tilelang.language as T

        M = p["M"] if p["M"] is not None else T.dynamic("M")
        N = p["N"] if p["N"] is not None else T.dynamic("N")
        K, dtype = p["K"], p["dtype"]
        bm, bn, bk = p["block_M"], p["block_N"], p["block_K"]
        trans_b, act, has_bias, has_res = p["trans_b"], p["act"], p["bias"], p["residual"]
        b_shape = (N, K) if trans_b else (K, N)

        @T.macro
        def body(A, B, Bias, R, C):
            with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm)) as (bx, by):
                acc = T.alloc_local((bm, bn), "float32")
                for i, j in T.grid(bm, bn):
                    acc[i, j] = 0
                for ko in T.serial(T.ceildiv(K, bk)):
                    for i, j, k in T.grid(bm, bn, bk):
                        row, col, kk = by * bm + i, bx * bn + j, ko * bk + k
                        if row < M and col < N and kk < K:
                            if trans_b:
                                acc[i, j] += A[row, kk] * B[col, kk]
                            else:
                                acc[i, j] += A[row, kk] * B[kk, col]
                for i, j in T.grid(bm, bn):
                    row, col = by * bm + i, bx * bn + j
                    if row < M and col < N:
                        if has_bias:
                            acc[i, j] += Bias[col]
                        if has_res:
                            C[row, col] = activation(T, acc[i, j], act) + R[row, col]
                        else:
                            C[row, col] = activation(T, acc[i, j], act)

        return prim_func(T, body, M, N, K, b_shape, dtype, has_bias, has_res)

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        M = p["M"] if p["M"] is not None else T.dynamic("M")
        N = p["N"] if p["N"] is not None else T.dynamic("N")
        K, dtype = p["K"], p["dtype"]
        bm, bn, bk = p["block_M"], p["block_N"], p["block_K"]
        trans_b, act, has_bias, has_res = p["trans_b"], p["act"], p["bias"], p["residual"]
        b_shape = (N, K) if trans_b else (K, N)
        b_tile = (bn, bk) if trans_b else (bk, bn)

        @T.macro
        def body(A, B, Bias, R, C):
            with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), threads=p["threads"]) as (bx, by):
                A_s = T.alloc_shared((bm, bk), dtype)
                B_s = T.alloc_shared(b_tile, dtype)
                C_s = T.alloc_shared((bm, bn), dtype)
                C_f = T.alloc_fragment((bm, bn), "float32")
                # Grouped block order keeps a panel of B tiles hot in L2.
                T.use_swizzle(panel_size=10)
                T.clear(C_f)
                for ko in T.Pipelined(T.ceildiv(K, bk), num_stages=p["num_stages"]):
                    T.copy(A[by * bm, ko * bk], A_s)
                    if trans_b:
                        T.copy(B[bx * bn, ko * bk], B_s)
                    else:
                        T.copy(B[ko * bk, bx * bn], B_s)
                    T.gemm(A_s, B_s, C_f, transpose_B=trans_b)
                if has_bias or act != "none":
                    for i, j in T.Parallel(bm, bn):
                        if has_bias:  # clamped: columns past N are computed but never stored
                            C_f[i, j] += T.cast(Bias[T.min(bx * bn + j, N - 1)], "float32")
                        C_f[i, j] = activation(T, C_f[i, j], act)
                if has_res:
                    # The residual's tile comes in through shared memory (TMA on Hopper), coalesced;
                    # it is read whole before this block stores its tile of C: C may be R.
                    T.copy(R[by * bm, bx * bn], C_s)
                    for i, j in T.Parallel(bm, bn):
                        C_f[i, j] += T.cast(C_s[i, j], "float32")
                # Staging through shared memory makes the store coalesced (TMA on Hopper).
                T.copy(C_f, C_s)
                T.copy(C_s, C[by * bm, bx * bn])

        return prim_func(T, body, M, N, K, b_shape, dtype, has_bias, has_res)

    def inputs(self, p, randn, size):
        scale = 1 / math.sqrt(p["K"])  # keeps 16-bit outputs well inside range
        b_shape = (p["N"], p["K"]) if p["trans_b"] else (p["K"], p["N"])
        ins = [randn(size("M"), p["K"]), randn(*b_shape, scale=scale)]
        if p.get("bias"):
            ins.append(randn(p["N"]))
        if p.get("residual"):
            ins.append(randn(size("M"), p["N"]))
        return ins

    def reference(self, p, x):
        import torch.nn.functional as F

        a, b = x[0], x[1]
        out = a @ (b.T if p["trans_b"] else b)
        if p.get("bias"):
            out = out + x[2]
        act = p.get("act", "none")
        out = {"none": lambda t: t, "relu": F.relu, "silu": F.silu, "gelu": lambda t: F.gelu(t, approximate="none")}[act](out)
        return out + x[-1] if p.get("residual") else out
