"""Tiling rules shared by several kinds: validation helpers and the one-row-per-block layout.

Pure Python (no TileLang): used by `check`, before any build.
"""

from .spec import InvalidSpec

# Shared memory a block may use, by compute capability (KiB, leaving room for
# barriers): Hopper/B200 227, A100 163, consumer parts 99, Turing 64.
_SMEM_KIB = {90: 220, 100: 220, 103: 220, 80: 160, 87: 160, 75: 64}
# An H100/H200 SXM: the decode kernels size their grids to whole waves of these SMs.
SMS = 132
SM_SMEM = 228 * 1024  # shared memory per SM, which its resident blocks divide (NVIDIA Hopper tuning guide)


def smem_limit(target):
    return _SMEM_KIB.get(target.compute_capability, 96) * 1024


# Row kernels (softmax, rmsnorm) hold one row in one block's registers.
MAX_ROW_CUDA = 16384
MAX_PER_THREAD = 64


def pow2(name, value, lo, hi):
    if value & (value - 1) or not lo <= value <= hi:
        raise InvalidSpec(name, f"must be a power of two in [{lo}, {hi}], got {value}")


def cuda_only(p, target, *names):
    if target.is_cpu:
        for name in names:
            if p[name] is not None:
                raise InvalidSpec(name, f"applies only to CUDA targets, not {target.describe()}")


# An attention kernel on the CPU keeps its scores and output tiles as C stack arrays: well under a thread's stack.
CPU_SCRATCH = 256 * 1024


def cpu_attention_tiles(p, rows, target):
    """An attention kind's tiles on the CPU: `rows` (its query-rows parameter) and block_N, 16 by
    default, powers of two, whose fp32 scratch, rows x (block_N + head_dim), fits CPU_SCRATCH."""
    p[rows] = p[rows] or 16
    p["block_N"] = p["block_N"] or 16
    pow2(rows, p[rows], 1, 128)
    pow2("block_N", p["block_N"], 1, 128)
    scratch = 4 * p[rows] * (p["block_N"] + p["head_dim"])
    if scratch > CPU_SCRATCH:
        raise InvalidSpec(
            "head_dim",
            f"{rows}*(block_N+head_dim) fp32 scratch is {scratch // 1024} KiB, over {CPU_SCRATCH // 1024} KiB on target {target.describe()}; "
            f"use a smaller {rows}",
        )


def cuda_attention_dims(p, kind):
    """An attention kind's head_dim and dtype on CUDA (wgmma widths, 16-bit inputs); returns head_dim."""
    d = p["head_dim"]
    if d % 16 or d > 256:
        raise InvalidSpec("head_dim", f"must be a multiple of 16 up to 256 on CUDA, got {d}")
    if p["dtype"] == "float32":
        raise InvalidSpec("dtype", f"float32 {kind} is not supported on CUDA; use float16 or bfloat16")
    return d


def default_row_threads(n, dtype):
    """Fewest threads (128..1024) holding at most 64 elements each, preferring a
    count that gives every thread whole 16-byte vectors (docs/measured.md#kernel-speed)."""
    vec = 4 if dtype == "float32" else 8
    fits = [t for t in (128, 256, 512, 1024) if -(-n // t) <= MAX_PER_THREAD]
    return next((t for t in fits if n % (t * vec) == 0), fits[0])


def check_row_alignment(p):
    """Vector loads and TMA move 16-byte pieces, so each row must be whole pieces."""
    align = 4 if p["dtype"] == "float32" else 8
    if p["N"] % align:
        raise InvalidSpec("N", f"must be a multiple of {align} for {p['dtype']} on CUDA (16-byte rows), got {p['N']}")


def check_row(p, target):
    """Validation and default `threads` for the one-row-per-block kinds."""
    cuda_only(p, target, "threads")
    if target.is_cpu:
        return p
    if p["N"] > MAX_ROW_CUDA:
        raise InvalidSpec("N", f"rows longer than {MAX_ROW_CUDA} are not supported on CUDA (a row is held in one block's registers), got {p['N']}")
    check_row_alignment(p)
    if p["threads"] is None:
        p["threads"] = default_row_threads(p["N"], p["dtype"])
    t = p["threads"]
    if t & (t - 1) or not 32 <= t <= 1024:
        raise InvalidSpec("threads", f"must be a power of two in [32, 1024], got {t}")
    if -(-p["N"] // t) > MAX_PER_THREAD:
        raise InvalidSpec("threads", f"{t} threads would hold {-(-p['N'] // t)} elements each (max {MAX_PER_THREAD}); use more threads")
    return p


def padded(n, threads):
    """n rounded up to a multiple of threads: a fragment's layout needs the multiple."""
    return -(-n // threads) * threads
