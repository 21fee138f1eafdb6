"""The split-KV rule of kv_attention: how many KV splits (flash-decoding) a CUDA call takes. This is
the one place that describes the rule. kernels/kv_attention.py builds the TIR around it, and
every other mention links here.

A build fixes the most splits per sequence (the `num_splits` param; by default
`default_max_splits`). Split-KV pays for small batches of few query rows, so a static q_len of at
most 16 gets DEFAULT_MAX_SPLITS. A chunked prefill (a larger or a runtime q_len) gets 1, because
its query blocks already give it parallelism enough.

A call picks its count on the host from its runtime sizes (`num_splits`, a TIR expression). The
count is the split kernel's grid x, which its device code reads back (kernels.launch.grid_x); the
combine kernel reads it once. The rule:
- A wave is the blocks that run at once: SMS times the blocks whose shared memory fits an SM.
  The default contiguous (TMA) block takes about 137 KiB, so one fits; the paged (gathered)
  block takes about 72 KiB, so three fit.
- A call whose head blocks fit one wave takes the most splits whose blocks fit in it. Each block
  then streams one split from start to end. On the TMA path, short splits (under 8 tiles, four
  or more of them) aim at three quarters of a wave instead. There the call takes as many splits
  as their whole tiles need.
- A larger call takes, on the TMA path, the splits that fill its last wave (`filling_splits`).
  Gathered, it takes the splits that make at least GATHER_TARGET_BLOCKS blocks.
- A TMA split reads at least one tile. A gathered split reads at least MIN_SPLIT_KEYS keys and
  two tiles: below that a block is mostly pipeline prologue. The exception is a call that would
  then leave over half the SMs idle: its splits may be just two tiles.
- A paged split's pages fit the page ids a block stages (kv_attention.PAGE_WINDOW), where the
  build's most splits allow.
- A call never takes more splits than its build's most, and always at least one.

The expression is kept small: TileLang's lowering pays for its size at every use of the grid it
sizes (tests/test_kv_attention.py holds it under 100 nodes).

The measurements behind every threshold: docs/measured.md#decode-attention, and the runs before
them in docs/measured-log.md.
"""

from .tiling import SM_SMEM, SMS

DEFAULT_MAX_SPLITS = 32
GATHER_TARGET_BLOCKS = 1056
MIN_SPLIT_KEYS = 256


def cdiv(T, a, b):
    # a >= 0 over b >= 1, by C division: floordiv by a runtime divisor lowers to sign fix-ups
    # whose let-bound values TileLang 0.1.15's ThreadSync misreads as thread ranges.
    return T.truncdiv(a + b - 1, b)


def default_max_splits(p):
    """The build's most splits where the spec leaves num_splits open."""
    return DEFAULT_MAX_SPLITS if p["q_len"] is not None and p["q_len"] <= 16 else 1


def filling_splits(T, blocks, wave, tiles):
    """Splits for a TMA-path call of more head blocks than one wave (one block per SM). With one
    split, the last wave can be left nearly empty. Let w be the waves one split takes. The count is
    the most splits whose blocks fit 2w + 1 waves, provided that fills the waves at least 5 points
    better than one split and leaves each split 4 tiles; otherwise one split. It is a single
    candidate, not a search, because lowering pays for this host expression's size."""
    waves = T.ceildiv(blocks, wave)
    s = T.max(1, T.truncdiv((2 * waves + 1) * wave, blocks))
    s_waves = T.ceildiv(s * blocks, wave)
    # s*blocks / (s_waves*wave) >= blocks / (waves*wave) + 1/20, in integers
    better = 20 * (s * blocks * waves - blocks * s_waves) >= s_waves * waves * wave
    return T.if_then_else(T.And(better, 4 * s <= tiles), s, 1)


def num_splits(T, p, batch, q_len, span, block_bytes, gather, page_window):
    """Splits per sequence of a CUDA call with canonical params `p`, as a TIR expression of its
    runtime sizes. `batch` and `q_len` are the call's sizes and `span` is the keys the cache holds
    per sequence. `block_bytes` is one split block's shared memory, `gather` says whether K/V
    arrive by cp.async, and `page_window` is how many page ids a block stages."""
    if p["num_splits"] == 1:
        return 1
    bn = p["block_N"]
    rows = q_len * (p["heads"] // p["kv_heads"])
    blocks = batch * p["kv_heads"] * T.ceildiv(rows, p["block_H"])  # per split
    wave = SMS * max(1, SM_SMEM // block_bytes)
    tiles = T.ceildiv(span, bn)
    fit = T.truncdiv(wave, blocks)  # the most splits whose blocks fit one wave
    if gather:
        few = blocks * T.ceildiv(span, MIN_SPLIT_KEYS) < SMS // 2  # splits of MIN_SPLIT_KEYS leave over half the SMs idle
        many = cdiv(T, GATHER_TARGET_BLOCKS, blocks)
        fewest_keys = T.if_then_else(few, 2 * bn, max(MIN_SPLIT_KEYS, 2 * bn))
    else:
        many, fewest_keys = filling_splits(T, blocks, wave, tiles), bn
        # Short splits aim at three quarters of a wave: four or more of them, under 8 tiles each
        # (longer splits take as long either way; fewer than 4 ran slower). As many splits as their
        # whole tiles need: 16 tiles over 12 splits is 8 splits of 2 (12 would leave 4 blocks empty).
        three_quarters = T.truncdiv(wave * 3 // 4, blocks)
        short = T.And(three_quarters >= 4, tiles < 8 * fit)
        fit = T.if_then_else(short, T.ceildiv(tiles, T.ceildiv(tiles, T.max(1, three_quarters))), fit)
    want = T.if_then_else(blocks <= wave, fit, many)
    if p["paged"]:
        want = T.max(want, T.ceildiv(span, page_window * p["page_size"]))
    return T.max(1, T.min(p["num_splits"], T.min(want, T.ceildiv(span, fewest_keys))))
