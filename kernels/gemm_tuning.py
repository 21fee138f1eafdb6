"""The gemm kind's tuning policy: which schedule and tiles a CUDA spec gets, by dtype, target, N,
K and M. The TIR the tiles feed is kernels/gemm.py.

Pure Python (no TileLang): `Gemm.check` and `Gemm.dispatch` read it before any build. The tiles
and thresholds are the fastest of sweeps on an H200 under CUDA graphs, for weights N x K in
{14336, 4096, 6144} x 4096 and 4096 x 14336 (benchmark/kernel_speed.py, DECODE): docs/measured.md#decode-gemm;
the prefill tile, docs/measured.md#kernel-speed.
"""

from .tiling import SMS, smem_limit

# Every tiling knob; a range's overrides name all of them (None where its schedule has no use for one).
TILES = ("block_M", "block_N", "block_K", "num_stages", "threads", "split_k")
# The tiles of schedule "splitk" where a spec leaves them open.
SPLITK_TILES = {"block_M": 64, "block_N": 64, "block_K": 128, "num_stages": 4, "threads": 128, "split_k": 1}


def schedule(name, **tiles):
    """Complete overrides: the schedule and every tile param."""
    return {"schedule": name, **dict.fromkeys(TILES), **tiles}


def prefill_tiles(p, target):
    """The tile of schedule "tma" where a spec leaves it open: many rows, tensor-core bound."""
    if p["dtype"] == "float32" or smem_limit(target) < 200 * 1024:
        # tf32 (4-byte elements) or a pre-Hopper part: a tile that fits ~100 KiB
        return {"block_M": 128, "block_N": 128, "block_K": 32, "num_stages": 3 if smem_limit(target) >= 80 * 1024 else 2, "threads": 256}
    # 128x256x64 in 3 stages: the wgmma-friendly Hopper tile (docs/measured.md#kernel-speed)
    return {"block_M": 128, "block_N": 256, "block_K": 64, "num_stages": 3, "threads": 256}


def gemv_tiles(dtype):
    """The tile of schedule "gemv" where a spec leaves it open: 4 rows of A, 8 warps, four 16-byte loads in flight per thread."""
    vec = 4 if dtype == "float32" else 8
    return {"block_M": 4, "block_N": 8, "block_K": 32 * vec * 4}


def ranges(p, target):
    """The M ranges of a CUDA spec and each one's build: [(upper M inclusive, overrides), ..., (None, overrides)].

    Small M is a weight-streaming problem (decode): each weight is read once, so what counts is
    a grid that fills the SMs and enough loads in flight on each; the prefill tile leaves most
    SMs idle there (docs/measured.md#decode-gemm).
    """
    big = schedule("tma", **prefill_tiles(p, target))
    if p["dtype"] == "float32" or smem_limit(target) < 200 * 1024:
        return [(None, big)]
    n, k = p["N"] or 4096, p["K"]  # a runtime N: tuned for a 4096-wide layer

    def narrowest(widths):  # the narrowest column tile whose grid is one wave
        return next((bn for bn in widths if -(-n // bn) <= SMS), widths[-1])

    def whole_waves(m_tiles):
        """The widest of the 32-column multiples from 64 to 256 whose grid of m_tiles rows best fills whole waves:
        a last, part-filled wave leaves SMs idle for a whole tile's time (docs/measured.md#decode-gemm)."""

        def filled(bn):
            blocks = -(-n // bn) * m_tiles
            return blocks / (-(-blocks // SMS) * SMS)

        return max(range(256, 63, -32), key=lambda bn: (round(filled(bn), 2), bn))

    def deepest(bm, bn, bk, most):  # pipeline stages that fit beside the output tile, at most `most`
        return min(most, (smem_limit(target) - bm * bn * 2) // ((bm + bn) * bk * 2))

    table = []
    if p["trans_b"]:  # one row: CUDA cores, 16-byte loads, no tensor-core padding
        table.append((1, schedule("gemv", block_M=1, block_N=8, block_K=1024, threads=256)))
    # Up to 64 rows: one M tile, narrow column tiles, a deep TMA pipeline (>= 128 KiB in flight per SM).
    pipe = {
        (16, 64): (256, 4),
        (16, 128): (64, 8),
        (32, 32): (256, 4),
        (32, 64): (128, 6),
        (32, 128): (128, 4),
        (64, 32): (128, 6),
        (64, 64): (128, 4),
        (64, 128): (64, 6),
    }
    for bm, widths in ((16, (64, 128)), (32, (32, 64, 128)), (64, (32, 64, 128))):
        bn = narrowest(widths)
        bk, stages = pipe[bm, bn]
        table.append((bm, schedule("splitk", block_M=bm, block_N=bn, block_K=bk, num_stages=stages, threads=128, split_k=1)))
    # 65-512 rows: tensor-core bound as much as memory bound; bigger tiles, split K where N is narrow and K long.
    if -(-n // 128) >= 96 or (n > 4224 and k < 8192):
        bn = narrowest(range(16, 257, 16))  # any wgmma width
        mid = schedule("tma", block_M=128, block_N=bn, block_K=64, num_stages=deepest(128, bn, 64, 6), threads=256)
    elif k >= 8192:
        mid = schedule("splitk", block_M=128, block_N=128, block_K=64, num_stages=5, threads=256, split_k=4)
    else:
        mid = schedule("tma", block_M=64, block_N=64, block_K=128, num_stages=4, threads=128)
    table.append((128, mid))
    if n >= 12288:
        table.append((256, big))
    elif k >= 8192:
        table.append((256, schedule("splitk", block_M=128, block_N=256, block_K=64, num_stages=3, threads=256, split_k=4)))
    elif n <= 4224:
        table.append((256, schedule("tma", block_M=64, block_N=128, block_K=64, num_stages=6, threads=128)))
    else:
        table.append((256, schedule("tma", block_M=128, block_N=128, block_K=64, num_stages=5, threads=256)))
    bn = whole_waves(512 // 128)
    table.append((512, schedule("tma", block_M=128, block_N=bn, block_K=64, num_stages=deepest(128, bn, 64, 5), threads=256)))
    table.append((None, big))
    # Neighbours with one build become one range.
    return [(upper, o) for (upper, o), (_, after) in zip(table, table[1:] + [(None, None)]) if o != after]


def overrides_for(table, m):
    """The overrides of the range holding M = m."""
    return next(o for upper, o in table if upper is None or m <= upper)
