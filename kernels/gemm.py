"""C = act(A @ B + bias), B given as [K, N] or [N, K] when trans_b; fp32 accumulation.
The schema, its checks and the TIR of each schedule; which schedule and tiles a spec gets is
kernels/gemm_tuning.py."""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

import math

from .barriers import sync_shared, without_thread_sync
from .gemm_tuning import SPLITK_TILES, TILES, gemv_tiles, overrides_for, prefill_tiles, ranges
from .launch import dependent_launch, launch_dependents
from .registry import register
from .spec import InvalidSpec, KernelKind, Param, Target, dim, dtype_param, tile
from .tiling import cuda_only, pow2, smem_limit

ACTS = ("none", "gelu", "silu", "relu")
SCHEDULES = ("auto", "tma", "splitk", "gemv")


def check_cpu(p):
    for name, value in {"block_M": 32, "block_N": 32, "block_K": 32}.items():
        if p[name] is None:
            p[name] = value
        pow2(name, p[name], 1, 128)
    return p


def unused(p, *names):
    for name in names:
        if p[name] is not None:
            raise InvalidSpec(name, f"does not apply to schedule {p['schedule']!r}; leave it unset")


def fill(p, defaults):
    for name, value in defaults.items():
        if p[name] is None:
            p[name] = value


def check_mma_tile(p, target):
    """A tensor-core tile staged through shared memory (schedules tma and splitk)."""
    bm, bn, bk = p["block_M"], p["block_N"], p["block_K"]
    pow2("block_M", bm, 16, 256)
    if bn % 16 or not 16 <= bn <= 256:  # wgmma widths; not only powers of two, so grids can fit whole waves
        raise InvalidSpec("block_N", f"must be a multiple of 16 in [16, 256], got {bn}")
    pow2("block_K", bk, 16, 256)
    if p["threads"] not in (128, 256):
        raise InvalidSpec("threads", f"must be 128 or 256, got {p['threads']}")
    if not 1 <= p["num_stages"] <= 8:
        raise InvalidSpec("num_stages", f"must be in [1, 8], got {p['num_stages']}")
    # Each thread holds bm*bn/threads fp32 accumulators; past 128 they spill.
    if bm * bn // p["threads"] > 128:
        raise InvalidSpec(
            "block_N", f"a {bm}x{bn} tile needs {bm * bn // p['threads']} accumulator registers per thread (max 128); use smaller tiles or more threads"
        )
    # Every warp needs at least a 16x16 piece of the tile.
    if bm * bn < p["threads"] // 32 * 16 * 16:
        raise InvalidSpec("block_M", f"a {bm}x{bn} tile is too small for {p['threads']} threads")
    size = 4 if p["dtype"] == "float32" else 2
    smem = p["num_stages"] * (bm * bk + bk * bn) * size + bm * bn * size
    if smem > smem_limit(target):
        raise InvalidSpec("num_stages", f"tiles need {smem // 1024} KiB of shared memory, over the {smem_limit(target) // 1024} KiB a block gets on {target}")
    return p


def check_tma(p, target):
    unused(p, "split_k")
    fill(p, prefill_tiles(p, target))
    return check_mma_tile(p, target)


def check_splitk(p, target):
    fill(p, SPLITK_TILES)
    if not 1 <= p["split_k"] <= 16:
        raise InvalidSpec("split_k", f"must be in [1, 16], got {p['split_k']}")
    if p["split_k"] > -(-p["K"] // p["block_K"]):
        raise InvalidSpec("split_k", f"{p['split_k']} slices of K={p['K']} leave some without a single block_K={p['block_K']} tile; use fewer")
    return check_mma_tile(p, target)


def check_gemv(p, target):
    """CUDA-core GEMV: one warp per row of B, 16-byte loads along K, block_M rows of A per block."""
    unused(p, "num_stages", "split_k")
    if not p["trans_b"]:
        raise InvalidSpec("schedule", "'gemv' reads B as [N, K] rows: it needs trans_b=True; use schedule 'splitk'")
    vec = 4 if p["dtype"] == "float32" else 8
    fill(p, gemv_tiles(p["dtype"]))
    fill(p, {"threads": 32 * p["block_N"]})
    pow2("block_M", p["block_M"], 1, 16)
    pow2("block_N", p["block_N"], 1, 32)
    pow2("block_K", p["block_K"], 32 * vec, 32 * vec * 8)
    if p["threads"] != 32 * p["block_N"]:
        raise InvalidSpec("threads", f"schedule 'gemv' runs one warp per row: threads must be 32 * block_N = {32 * p['block_N']}, got {p['threads']}")
    return p


SCHEDULE_CHECKS = {"tma": check_tma, "splitk": check_splitk, "gemv": check_gemv}


def activation(T, x, act):
    """The epilogue's activation as a TIR expression on fp32 `x` (traced, so shared by both forms)."""
    if act == "gelu":  # exact erf form, as torch's default GELU
        return 0.5 * x * (1.0 + T.erf(x * (1.0 / math.sqrt(2.0))))
    if act == "silu":
        return x / (1.0 + T.exp(-x))
    if act == "relu":
        return T.max(x, T.float32(0))
    return x


def runtime_sizes(T, p):
    """M and N as the PrimFunc takes them: a size the spec leaves None is a runtime one."""
    return tuple(p[name] if p[name] is not None else T.dynamic(name) for name in ("M", "N"))


def epilogue(T, x, act, Bias, R, row, col):
    """What a GEMM stores at (row, col) for its fp32 sum `x`: plus the bias, through the activation,
    plus the residual; Bias and R are None where the kernel has none (traced, as `activation`)."""
    if Bias is not None:
        x += T.cast(Bias[col], "float32")
    x = activation(T, x, act)
    if R is not None:
        x += T.cast(R[row, col], "float32")
    return x


def prim_func(T, body, M, N, K, b_shape, dtype, has_bias, has_res, w_shape=None):
    """The PrimFunc of the ABI (A, B[, Bias][, R][, W], C) around `body(A, B, Bias, R, W, C)`;
    W (fp32, `w_shape`) is per-call scratch (Gemm.scratch), there only when a schedule needs one."""
    if w_shape is not None:
        return prim_func_scratch(T, body, M, N, K, b_shape, dtype, has_bias, has_res, w_shape)
    if has_bias and has_res:

        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), Bias: T.Tensor((N,), dtype), R: T.Tensor((M, N), dtype), C: T.Tensor((M, N), dtype)):
            body(A, B, Bias, R, None, C)
    elif has_bias:

        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), Bias: T.Tensor((N,), dtype), C: T.Tensor((M, N), dtype)):
            body(A, B, Bias, None, None, C)
    elif has_res:

        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), R: T.Tensor((M, N), dtype), C: T.Tensor((M, N), dtype)):
            body(A, B, None, R, None, C)
    else:

        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), C: T.Tensor((M, N), dtype)):
            body(A, B, None, None, None, C)

    return main


def prim_func_scratch(T, body, M, N, K, b_shape, dtype, has_bias, has_res, w_shape):
    if has_bias and has_res:

        @T.prim_func
        def main(
            A: T.Tensor((M, K), dtype),
            B: T.Tensor(b_shape, dtype),
            Bias: T.Tensor((N,), dtype),
            R: T.Tensor((M, N), dtype),
            W: T.Tensor(w_shape, "float32"),
            C: T.Tensor((M, N), dtype),
        ):
            body(A, B, Bias, R, W, C)
    elif has_bias:

        @T.prim_func
        def main(
            A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), Bias: T.Tensor((N,), dtype), W: T.Tensor(w_shape, "float32"), C: T.Tensor((M, N), dtype)
        ):
            body(A, B, Bias, None, W, C)
    elif has_res:

        @T.prim_func
        def main(
            A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), R: T.Tensor((M, N), dtype), W: T.Tensor(w_shape, "float32"), C: T.Tensor((M, N), dtype)
        ):
            body(A, B, None, R, W, C)
    else:

        @T.prim_func
        def main(A: T.Tensor((M, K), dtype), B: T.Tensor(b_shape, dtype), W: T.Tensor(w_shape, "float32"), C: T.Tensor((M, N), dtype)):
            body(A, B, None, None, W, C)

    return main


@register
class Gemm(KernelKind):
    name = "gemm"
    # One per family of generated headers: the wgmma tiles, and the small-M split-K tiles (rows <= 32).
    warm_up = ({"M": 256, "N": 256, "K": 256, "dtype": "float16", "trans_b": True}, {"M": 16, "N": 256, "K": 256, "dtype": "float16", "trans_b": True})
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
        Param(
            "schedule",
            str,
            default="auto",
            choices=SCHEDULES,
            doc="CUDA kernel: 'tma' (prefill tile), 'splitk' (narrow tiles for few rows, K split over split_k blocks), 'gemv' (CUDA cores, trans_b); 'auto' picks by M (dispatch), or 'tma' when tiles are given; the CPU has one kernel",
        ),
        tile("block_M"),
        tile("block_N"),
        tile("block_K"),
        tile("num_stages", "shared-memory pipeline depth (CUDA only)"),
        tile("threads", "threads per block: 128 or 256 (CUDA only; gemv: 32 * block_N)"),
        tile("split_k", "K slices of schedule 'splitk' (CUDA only)"),
    )

    def inplace(self, p):
        # Each block reads its tile of R in the epilogue, before it stores that tile of C.
        return {"C": "R"} if p["residual"] else {}

    def check(self, p, target):
        cuda_only(p, target, *TILES[3:])
        if target.is_cpu:
            p["schedule"] = "auto"  # one CPU kernel, whatever was asked: one key per CPU spec
            return check_cpu(p)
        size = 4 if p["dtype"] == "float32" else 2
        # TMA / cp.async / vector loads move 16-byte-aligned rows: rows of A, B and C have K or N elements.
        for name in ("K", "N"):  # a runtime N must be one too: the call's TMA descriptor refuses others
            if p[name] is not None and p[name] % (16 // size):
                raise InvalidSpec(name, f"must be a multiple of {16 // size} for {p['dtype']} on CUDA (16-byte rows)")
        if p["schedule"] == "auto":
            table = ranges(p, target)
            if any(p[name] is not None for name in TILES):
                p["schedule"] = "tma"  # explicit tiles meant the prefill kernel before schedules existed
            elif len(table) == 1:
                p.update(table[0][1])  # nothing to choose (fp32, pre-Hopper): the prefill kernel
            elif p["M"] is None:
                return p  # the dispatching spec: dispatch() names the build of each M range
            else:
                p.update(overrides_for(table, p["M"]))
        return SCHEDULE_CHECKS[p["schedule"]](p, target)

    def scratch(self, p):
        # splitk's fp32 partials: every element the reduction reads is written first (build_mma).
        return ("W",) if p["schedule"] == "splitk" and p["split_k"] > 1 else ()

    def dispatch(self, p: dict, target) -> tuple[str, list[tuple[int | None, dict]]] | None:
        """("M", [(upper M inclusive, overrides), ..., (None, overrides)]) on CUDA where M has
        several ranges: for the dispatching spec (M left to run time, schedule "auto") and for
        a static M (check pinned its range's overrides); one build per range, correct for any M."""
        if target.is_cpu or (p["M"] is None and p["schedule"] != "auto"):
            return None  # the CPU's one kernel, or one range's build
        table = ranges(p, target)
        return ("M", table) if len(table) > 1 else None

    def host_side_dims(self, p, target):
        # With TMA (sm_90 and newer) M and N only size the grid and the tensors' descriptors,
        # so every value, multiple of the tile or not, runs the same device code; except where
        # TileLang lowers a static size of a single tile otherwise, and a bias reads N.
        if target.is_cpu or target.compute_capability < 90 or not (p["schedule"] == "tma" or p["schedule"] == "splitk" and p["split_k"] == 1):
            return ()  # gemv and split-K partials index rows and columns in device code; "auto" builds depend on N's table
        if p["residual"] or any(p[d] is not None and p[d] <= p[f"block_{d}"] for d in ("M", "N")):
            return ()  # a residual's tile is read by TMA too, but that claim is not checked (tests/test_shared_builds.py)
        return ("M",) if p["bias"] else ("M", "N")

    def build_cpu(self, p):
        import tilelang.language as T

        M, N = runtime_sizes(T, p)
        K, dtype = p["K"], p["dtype"]
        bm, bn, bk = p["block_M"], p["block_N"], p["block_K"]
        trans_b, act, has_bias, has_res = p["trans_b"], p["act"], p["bias"], p["residual"]
        b_shape = (N, K) if trans_b else (K, N)

        @T.macro
        def body(A, B, Bias, R, W, C):
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
        if p["schedule"] == "auto":  # the dispatching spec built whole: its last range is correct for every M
            p = self.canonicalize({**p, **ranges(p, target)[-1][1]}, target).params
        if p["schedule"] == "gemv":
            return self.build_gemv(p, target)
        return self.build_mma(p, target)

    def build_mma(self, p, target):
        """Schedules tma and splitk: a tensor-core tile fed by a TMA (cp.async before Hopper) pipeline.
        splitk with split_k > 1 gives each block one K slice, its fp32 partial tile going to the
        scratch W[split_k, M, N]; a second kernel sums the slices and applies the epilogue."""
        import tilelang.language as T

        M, N = runtime_sizes(T, p)
        K, dtype = p["K"], p["dtype"]
        bm, bn, bk = p["block_M"], p["block_N"], p["block_K"]
        trans_b, act, has_bias, has_res = p["trans_b"], p["act"], p["bias"], p["residual"]
        b_shape = (N, K) if trans_b else (K, N)
        b_tile = (bn, bk) if trans_b else (bk, bn)
        split = p["split_k"] or 1
        k_tiles = -(-K // bk)
        per = -(-k_tiles // split)  # K tiles per slice; a last slice past K reads TMA's zero fill
        # Grouped block order keeps a panel of B tiles hot in L2 (many M tiles share it); a
        # narrow grid (decode) reads each B tile once, in launch order.
        swizzle = p["schedule"] == "tma"
        rn = 256  # columns per block of the split-K reduction
        # On Hopper each warpgroup takes whole rows of the tile, so one wgmma spans its width
        # (m64n256 for 128x256, CUTLASS's cooperative layout) where the default policy splits
        # it into narrower ones (docs/measured.md#decode-gemm).
        wide = target.compute_capability >= 90 and bm >= 64
        policy = T.GemmWarpPolicy.FullRow if wide else T.GemmWarpPolicy.Square

        @T.macro
        def body(A, B, Bias, R, W, C):
            with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), split, threads=p["threads"]) as (bx, by, bz):
                # The next kernel may launch once this block's K loop is done, not before: a decode
                # GEMM's one wave ran slower with the trigger at its start
                # (docs/measured.md#programmatic-dependent-launch).
                dependent_launch(target, trigger=False)
                A_s = T.alloc_shared((bm, bk), dtype)
                B_s = T.alloc_shared(b_tile, dtype)
                C_s = T.alloc_shared((bm, bn), dtype)
                C_f = T.alloc_fragment((bm, bn), "float32")
                if swizzle:
                    T.use_swizzle(panel_size=10)
                T.clear(C_f)
                for ko in T.Pipelined(per, num_stages=p["num_stages"]):
                    k0 = (bz * per + ko) * bk
                    T.copy(A[by * bm, k0], A_s)
                    if trans_b:
                        T.copy(B[bx * bn, k0], B_s)
                    else:
                        T.copy(B[k0, bx * bn], B_s)
                    T.gemm(A_s, B_s, C_f, transpose_B=trans_b, policy=policy)
                launch_dependents(target)
                if split > 1:
                    # Every (slice, row < M, column < N) is written, so the reduction reads no stale scratch.
                    for i, j in T.Parallel(bm, bn):
                        if by * bm + i < M and bx * bn + j < N:
                            W[bz, by * bm + i, bx * bn + j] = C_f[i, j]
                else:
                    if has_bias or act != "none":
                        for i, j in T.Parallel(bm, bn):
                            if has_bias:  # clamped: columns past N are computed but never stored
                                C_f[i, j] += T.cast(Bias[T.min(bx * bn + j, N - 1)], "float32")
                            C_f[i, j] = activation(T, C_f[i, j], act)
                    if has_res:
                        # The residual's tile comes in through shared memory, coalesced; it is
                        # read whole before this block stores its tile of C: C may be R.
                        sync_shared(target, p["threads"])
                        T.copy(R[by * bm, bx * bn], C_s)
                        sync_shared(target, p["threads"])
                        for i, j in T.Parallel(bm, bn):
                            C_f[i, j] += T.cast(C_s[i, j], "float32")
                    # Staging through shared memory makes the store coalesced (TMA on Hopper).
                    sync_shared(target, p["threads"])
                    T.copy(C_f, C_s)
                    sync_shared(target, p["threads"])
                    T.copy(C_s, C[by * bm, bx * bn])
            if split > 1:
                with T.Kernel(T.ceildiv(N, rn), M, threads=128) as (bx, row):
                    dependent_launch(target)
                    acc = T.alloc_fragment((rn,), "float32")
                    T.clear(acc)
                    for z in T.serial(split):
                        for j in T.Parallel(rn):  # clamped: columns past N are summed but never stored
                            acc[j] += W[z, row, T.min(bx * rn + j, N - 1)]
                    for j in T.Parallel(rn):
                        col = bx * rn + j
                        if col < N:
                            C[row, col] = T.cast(epilogue(T, acc[j], act, Bias, R, row, col), dtype)

        w_shape = (split, M, N) if split > 1 else None
        return without_thread_sync(prim_func(T, body, M, N, K, b_shape, dtype, has_bias, has_res, w_shape), target)

    def build_gemv(self, p, target):
        """Schedule gemv: CUDA cores, one warp per row of B ([N, K]) streaming it with 16-byte
        loads, `unroll` of them in flight per thread, each reused for block_M rows of A (from
        L1/L2: every block reads the same A); a warp shuffle sums the lanes' partial dot products.
        After TileLang's examples/gemv (splitk_gemv_vectorized), written for this ABI."""
        import tilelang.language as T

        M, N = runtime_sizes(T, p)
        K, dtype = p["K"], p["dtype"]
        bm, bn, bk = p["block_M"], p["block_N"], p["block_K"]
        act, has_bias, has_res = p["act"], p["bias"], p["residual"]
        vec = 4 if dtype == "float32" else 8  # 16 bytes
        unroll = bk // (32 * vec)

        @T.macro
        def body(A, B, Bias, R, W, C):
            with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), threads=(32, bn)) as (bx, by):
                dependent_launch(target)
                lane = T.get_thread_binding(0)
                n = bx * bn + T.get_thread_binding(1)
                acc = T.alloc_local((bm,), "float32")
                a = T.alloc_local((vec,), dtype)
                b = T.alloc_local((unroll, vec), dtype)
                for i in T.unroll(bm):
                    acc[i] = 0
                for ko in T.serial(T.ceildiv(K, bk)):
                    # All loads of B first: `unroll` 16-byte loads in flight per thread.
                    for u in T.unroll(unroll):
                        k = ko * bk + (u * 32 + lane) * vec
                        if n < N and k < K:  # K is a multiple of vec: a vector is wholly in or out
                            for v in T.vectorized(vec):
                                b[u, v] = B[n, k + v]
                        else:
                            for v in T.vectorized(vec):
                                b[u, v] = T.cast(0, dtype)
                    for u in T.unroll(unroll):
                        k = ko * bk + (u * 32 + lane) * vec
                        for i in T.unroll(bm):
                            if by * bm + i < M and k < K:
                                for v in T.vectorized(vec):
                                    a[v] = A[by * bm + i, k + v]
                                for v in T.unroll(vec):
                                    acc[i] += T.cast(a[v], "float32") * T.cast(b[u, v], "float32")
                for i in T.unroll(bm):
                    acc[i] = T.warp_reduce_sum(acc[i])
                for i in T.unroll(bm):
                    row = by * bm + i
                    if lane == 0 and n < N and row < M:
                        C[row, n] = T.cast(epilogue(T, acc[i], act, Bias, R, row, n), dtype)

        b_shape = (N, K)
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
