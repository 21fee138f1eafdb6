"""FlashAttention-style forward: O = softmax(Q K^T / sqrt(d)) V, online softmax, GQA; optionally
a padded batch (per-sequence key ranges) and a sliding window in the same call."""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

import math

from .barriers import sync_shared, without_thread_sync
from .heads import HEAD_DIM, HEADS, KV_HEADS, check_gqa
from .launch import dependent_launch, grid_x
from .online_softmax import online_softmax
from .registry import register
from .spec import MAX_DIM, InvalidSpec, KernelKind, Param, Target, dim, dtype_param, tile
from .tiling import cpu_attention_tiles, cuda_attention_dims, cuda_only, pow2, smem_limit

LOG2E = 1.4426950408889634
# CUDA (block_M, block_N, num_stages) defaults, largest first; the first that fits shared memory wins.
DEFAULT_TILES = ((128, 128, 2), (128, 64, 2), (128, 64, 1), (64, 64, 2), (64, 64, 1), (64, 32, 1))


def _conjunction(T, rules):
    """All of `rules` (TIR conditions), as one."""
    out = rules[0]
    for c in rules[1:]:
        out = T.And(out, c)
    return out


@register
class Attention(KernelKind):
    name = "attention"
    warm_up = ({"batch": 1, "heads": 8, "kv_heads": 8, "seq_len": 256, "head_dim": 128, "causal": True, "dtype": "float16"},)
    compile_cost = 3.0
    # --use_fast_math, as FlashAttention is built: each score's exp2 is ex2.approx.ftz (no
    # denormal handling around it) and the final division approximate, not IEEE.
    compile_options = {"pass_configs": {"tl.enable_fast_math": True}}
    doc = (
        "O[b,s,h,d] = softmax(Q K^T / sqrt(d)) V with Q,O [batch,seq_len,heads,head_dim], K,V [batch,seq_len,kv_heads,head_dim]; "
        "varlen: also key_range int32 [batch,2] (after V)."
    )
    params = (
        dim("batch", "None makes it a runtime size", dynamic=True),
        HEADS,
        KV_HEADS,
        dim("seq_len", "query and key length; None makes it a runtime size", dynamic=True),
        HEAD_DIM,
        Param("causal", bool, default=False, doc="query i sees keys 0..i"),
        Param("window", int, default=0, min=0, max=MAX_DIM, doc="query i sees only keys j with |i - j| <= window (0: no window)"),
        Param(
            "varlen",
            bool,
            default=False,
            doc="a padded batch: takes key_range int32 [batch,2]; sequence b is rows and keys key_range[b,0] <= j < key_range[b,1]; "
            "rows outside it, and rows that see no key, get zeros",
        ),
        dtype_param(),
        tile("block_M", "query rows per block"),
        tile("block_N", "keys per inner step"),
        tile("num_stages", "K/V pipeline depth (CUDA only)"),
        tile("threads", "threads per block: 128 or 256 (CUDA only)"),
    )

    def check(self, p, target):
        check_gqa(p)
        cuda_only(p, target, "num_stages", "threads")
        if target.is_cpu:
            cpu_attention_tiles(p, "block_M", target)
            return p
        d = cuda_attention_dims(p, "attention")
        # Each warpgroup (128 threads) owns one 64-row tile of queries (one wgmma M),
        # so block_M and threads go together: 64 with 128 threads, 128 with 256.
        if p["threads"] not in (None, 128, 256):
            raise InvalidSpec("threads", f"must be 128 or 256, got {p['threads']}")
        if p["block_M"] is None and p["threads"] is not None:
            p["block_M"] = p["threads"] // 2
        # TileLang 0.1.15's cp.async pipeline (pre-Hopper) cannot code-generate a variable
        # trip count (causal, a runtime seq_len, key ranges or a window): one stage there.
        if target.compute_capability < 90 and (p["causal"] or p["seq_len"] is None or self._masked(p)):
            if p["num_stages"] not in (None, 1):
                raise InvalidSpec("num_stages", f"must be 1 on {target} when causal, varlen, windowed or seq_len is a runtime size")
            p["num_stages"] = 1
        # Defaults: the largest tiles that fit, among those the caller left open (128x128 keys
        # in 2 stages for d=128 on Hopper; docs/measured.md#kernel-speed).
        for bm, bn, st in DEFAULT_TILES:
            if 0 < p["window"] < 128 and bn > 64:  # a narrow window reads a fraction of a 128-key block
                continue
            if self._masked(p) and d <= 64 and bm > 64:  # masked short heads: smaller blocks, several per SM
                continue
            chosen = (p["block_M"] or bm, p["block_N"] or bn, p["num_stages"] or st)
            if self._smem(*chosen, d) <= smem_limit(target):
                break
        p["block_M"], p["block_N"], p["num_stages"] = chosen  # the smallest, if none fits: rejected below
        p["threads"] = p["threads"] or (2 * p["block_M"] if p["block_M"] in (64, 128) else 256)
        bm, bn = p["block_M"], p["block_N"]
        if bm != p["threads"] // 2:
            raise InvalidSpec("block_M", f"must be threads/2 (64 rows per 128-thread warpgroup): {p['threads'] // 2} for {p['threads']} threads, got {bm}")
        pow2("block_N", bn, 32, 256)
        if not 1 <= p["num_stages"] <= 4:
            raise InvalidSpec("num_stages", f"must be in [1, 4], got {p['num_stages']}")
        # Per thread: the scores tile and the output accumulator, in fp32 registers.
        regs = (bm * bn + bm * d) // p["threads"]
        if regs > 192:
            raise InvalidSpec(
                "block_M", f"a {bm}x{bn} tile with head_dim {d} needs {regs} fp32 registers per thread (max 192); use smaller blocks or more threads"
            )
        smem = self._smem(bm, bn, p["num_stages"], d)
        if smem > smem_limit(target):
            raise InvalidSpec(
                "num_stages", f"tiles need {smem // 1024} KiB of shared memory, over the {smem_limit(target) // 1024} KiB a block gets on {target}"
            )
        return p

    def host_side_dims(self, p, target):
        # With TMA (sm_90 and newer) batch and, when causal, seq_len only size the grid and the
        # descriptors, except where TileLang lowers a static size otherwise: batch 1 (block z
        # is 0), or so few key blocks that it unrolls the pipeline's barrier phases.
        if target.is_cpu or target.compute_capability < 90 or self._masked(p):
            return ()  # masked forms: not claimed (they are served with runtime sizes)
        dims = () if p["batch"] == 1 else ("batch",)
        if p["causal"] and (p["seq_len"] is None or -(-p["seq_len"] // p["block_N"]) > 2 * p["num_stages"]):
            dims += ("seq_len",)
        return dims

    @staticmethod
    def _masked(p):
        """Key ranges or a window: the forms whose rows may see no key at all."""
        return p["varlen"] or p["window"] > 0

    @staticmethod
    def _smem(bm, bn, stages, d):
        """Bytes of shared memory: Q and O tiles, plus K and V tiles per stage (16-bit)."""
        return 2 * (2 * bm * d + stages * 2 * bn * d)

    def _shapes(self, T, p):
        batch = p["batch"] if p["batch"] is not None else T.dynamic("batch")
        seq = p["seq_len"] if p["seq_len"] is not None else T.dynamic("seq_len")
        return batch, seq, (batch, seq, p["heads"], p["head_dim"]), (batch, seq, p["kv_heads"], p["head_dim"])

    def build_cpu(self, p):
        import tilelang.language as T

        batch, seq, q_shape, kv_shape = self._shapes(T, p)
        d, causal = p["head_dim"], p["causal"]
        bm, bn = p["block_M"], p["block_N"]
        group = p["heads"] // p["kv_heads"]
        scale = LOG2E / math.sqrt(d)  # exp2 of pre-scaled scores: one multiply per score

        masked, window = self._masked(p), p["window"]
        softmax_step = online_softmax(T, bm, bn, d)

        @T.macro
        def body(Q, K, V, R, O):
            with T.Kernel(T.ceildiv(seq, bm), p["heads"], batch) as (bx, h, b):
                s = T.alloc_local((bm, bn), "float32")
                acc = T.alloc_local((bm, d), "float32")
                m = T.alloc_local((bm,), "float32")
                m_prev = T.alloc_local((bm,), "float32")
                lsum = T.alloc_local((bm,), "float32")
                for i, j in T.grid(bm, d):
                    acc[i, j] = 0
                for i in T.serial(bm):
                    m[i] = -T.infinity("float32")
                    lsum[i] = 0
                for kb in T.serial(T.ceildiv(seq, bn)):
                    # Scores, with keys past seq_len (and, when causal, past the query) at -inf.
                    for i, j in T.grid(bm, bn):
                        q, k = bx * bm + i, kb * bn + j
                        s[i, j] = -T.infinity("float32")
                        if q < seq and k < seq and (not causal or k <= q) and (not masked or self._visible(T, R, b, q, k, window)):
                            s[i, j] = 0
                            for c in T.serial(d):
                                s[i, j] += Q[b, q, h, c] * K[b, k, h // group, c]
                            s[i, j] = s[i, j] * scale
                    softmax_step(s, m, m_prev, lsum, acc)
                    for i, j, c in T.grid(bm, bn, d):
                        if kb * bn + j < seq:
                            acc[i, c] += s[i, j] * V[b, kb * bn + j, h // group, c]
                for i, c in T.grid(bm, d):
                    if bx * bm + i < seq:
                        if masked:  # a row that saw no key: zeros
                            O[b, bx * bm + i, h, c] = T.if_then_else(lsum[i] == 0, 0, acc[i, c] / lsum[i])
                        else:
                            O[b, bx * bm + i, h, c] = acc[i, c] / lsum[i]

        return self._prim_func(T, p, q_shape, kv_shape, batch, body)

    @staticmethod
    def _visible(T, R, b, q, k, window):
        """The CPU form's rule beyond causal: query q and key k inside sequence b's range
        (varlen: R is key_range), and k within the window of q. (The CUDA form tests keys only:
        `_keys_seen`.)"""
        rule = []
        if R is not None:
            rule += [R[b, 0] <= q, q < R[b, 1], R[b, 0] <= k, k < R[b, 1]]
        if window:
            rule += [T.abs(q - k) <= window]
        return _conjunction(T, rule)

    @staticmethod
    def _keys_seen(T, lo, hi, q, k, window, causal):
        """The CUDA form's rule for one score: key k inside the sequence's range [lo, hi), within
        the window of query q and (causal) at or before it. Rows outside the range are not tested
        here: their outputs are zeroed once at the end, which keeps the per-score test short."""
        rule = [k < hi] if isinstance(lo, int) and lo == 0 else [lo <= k, k < hi]
        if window:  # as |q - k|: two comparisons made TileLang's ThreadSync pass fail on sm_90a (a 252-thread guard)
            rule += [T.abs(q - k) <= window]
        if causal:
            rule += [k <= q]
        return _conjunction(T, rule)

    @staticmethod
    def _whole(T, lo, hi, q0, bm, k0, bn, window, causal):
        """Whether every query row of [q0, q0 + bm) sees every key of [k0, k0 + bn) by
        `_keys_seen`: the keys inside the sequence's range [lo, hi), within the window of each
        row, and (causal) at or before the first row."""
        rule = [lo <= k0, k0 + bn <= hi]
        if window:
            rule += [q0 + bm - 1 - k0 <= window, k0 + bn - 1 - q0 <= window]
        if causal:
            rule += [k0 + bn - 1 <= q0]
        return _conjunction(T, rule)

    @staticmethod
    def _prim_func(T, p, q_shape, kv_shape, batch, body):
        """The PrimFunc of the ABI: (Q, K, V[, key_range], O)."""
        dtype = p["dtype"]
        if p["varlen"]:

            @T.prim_func
            def main(
                Q: T.Tensor(q_shape, dtype),
                K: T.Tensor(kv_shape, dtype),
                V: T.Tensor(kv_shape, dtype),
                key_range: T.Tensor((batch, 2), "int32"),
                O: T.Tensor(q_shape, dtype),
            ):
                body(Q, K, V, key_range, O)
        else:

            @T.prim_func
            def main(Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype), O: T.Tensor(q_shape, dtype)):
                body(Q, K, V, None, O)

        return main

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        batch, seq, q_shape, kv_shape = self._shapes(T, p)
        d, dtype, causal = p["head_dim"], p["dtype"], p["causal"]
        bm, bn = p["block_M"], p["block_N"]
        group = p["heads"] // p["kv_heads"]
        scale = LOG2E / math.sqrt(d)
        acc_t = "float32"
        masked, window = self._masked(p), p["window"]

        @T.macro
        def exponentiate(s, m, m_prev, r):
            # The online softmax's step: r rescales what the rows summed so far; s becomes exp2.
            for i in T.Parallel(bm):
                r[i] = T.exp2(m_prev[i] * scale - m[i] * scale)
            for i, j in T.Parallel(bm, bn):
                s[i, j] = T.exp2(s[i, j] * scale - m[i] * scale)

        @T.macro
        def exponentiate_masked(s, m, m_prev, r):
            # A row that has seen no key yet keeps m = -inf; exp2 of that must not be NaN.
            for i in T.Parallel(bm):
                r[i] = T.if_then_else(m[i] == -T.infinity(acc_t), 1, T.exp2(m_prev[i] * scale - m[i] * scale))
            for i, j in T.Parallel(bm, bn):
                s[i, j] = T.if_then_else(m[i] == -T.infinity(acc_t), 0, T.exp2(s[i, j] * scale - m[i] * scale))

        @T.macro
        def body(Q, K, V, R, O):
            with T.Kernel(T.ceildiv(seq, bm), p["heads"], batch, threads=p["threads"]) as (bid, h, b):
                dependent_launch(target)
                # Causal blocks differ in work (query block i reads i + 1 key blocks): the longest
                # start first, so the last wave is short ones (docs/measured.md#kernel-speed).
                # The block count is read on the device (gridDim.x), so seq_len stays out of the device code (host_side_dims).
                bx = grid_x() - 1 - bid if causal else bid
                Q_s = T.alloc_shared((bm, d), dtype)
                K_s = T.alloc_shared((bn, d), dtype)
                V_s = T.alloc_shared((bn, d), dtype)
                O_s = T.alloc_shared((bm, d), dtype)
                s = T.alloc_fragment((bm, bn), acc_t)
                s_cast = T.alloc_fragment((bm, bn), dtype)
                acc = T.alloc_fragment((bm, d), acc_t)
                m = T.alloc_fragment((bm,), acc_t)
                m_prev = T.alloc_fragment((bm,), acc_t)
                r = T.alloc_fragment((bm,), acc_t)
                row_sum = T.alloc_fragment((bm,), acc_t)
                lsum = T.alloc_fragment((bm,), acc_t)

                T.copy(Q[b, bx * bm : (bx + 1) * bm, h, :], Q_s)
                sync_shared(target)  # the barriers ThreadSync places (kernels/barriers.py)
                T.fill(acc, 0)
                T.fill(lsum, 0)
                T.fill(m, -T.infinity(acc_t))
                # Causal blocks stop at the diagonal: keys past the last query row are all masked.
                # No min with seq_len: past it only the last block's rows look, at keys the mask
                # hides and TMA zero-fills; so seq_len stays out of the device code (host_side_dims).
                if masked:
                    # Only the key blocks that some row of this block sees: [k0, k1) from the rows'
                    # range [r0, r1) and the window. This skipping is what makes a padded or windowed
                    # batch cheap. A block whose rows see nothing still takes one (fully masked) step:
                    # the pipeline's first step is what waits for the Q tile's TMA load, which must
                    # not outlive the block.
                    # The range read once into registers (not again in every score's test).
                    lo = T.alloc_var("int32", init=R[b, 0]) if R is not None else 0
                    hi = T.alloc_var("int32", init=R[b, 1]) if R is not None else seq
                    r0, r1 = T.max(bx * bm, lo), T.min((bx + 1) * bm, hi)
                    k0 = T.max(lo, r0 - window) if window else lo
                    k1 = T.min(hi, r1 + window) if window else hi
                    k1 = T.min(k1, r1) if causal else k1
                    kb0 = k0 // bn
                    kb1 = T.if_then_else(T.And(r0 < r1, k0 < k1), T.ceildiv(k1, bn), kb0 + 1)
                else:
                    steps = T.ceildiv((bx + 1) * bm, bn) if causal else T.ceildiv(seq, bn)
                stages = p["num_stages"]
                for kb in T.Pipelined(kb0, kb1, num_stages=stages) if masked else T.Pipelined(steps, num_stages=stages):
                    T.copy(K[b, kb * bn : (kb + 1) * bn, h // group, :], K_s)
                    # The mask rides in the accumulator's initial value: 0 where visible, -inf where not.
                    if masked:
                        # A key block that every row of the block sees whole (most of a padded batch's)
                        # needs no mask, and leaves no row without a key.
                        whole = self._whole(T, lo, hi, bx * bm, bm, kb * bn, bn, window, causal)
                        if whole:
                            T.clear(s)
                        else:
                            for i, j in T.Parallel(bm, bn):
                                seen = self._keys_seen(T, lo, hi, bx * bm + i, kb * bn + j, window, causal)
                                s[i, j] = T.if_then_else(seen, 0, -T.infinity(acc_t))
                    else:
                        for i, j in T.Parallel(bm, bn):
                            if causal:
                                s[i, j] = T.if_then_else(kb * bn + j <= bx * bm + i, 0, -T.infinity(acc_t))
                            else:
                                s[i, j] = T.if_then_else(kb * bn + j < seq, 0, -T.infinity(acc_t))
                    T.gemm(Q_s, K_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.copy(m, m_prev)
                    T.reduce_max(s, m, dim=1, clear=False)
                    if masked:
                        if whole:
                            exponentiate(s, m, m_prev, r)
                        else:
                            exponentiate_masked(s, m, m_prev, r)
                    else:
                        exponentiate(s, m, m_prev, r)
                    T.reduce_sum(s, row_sum, dim=1)
                    for i in T.Parallel(bm):
                        lsum[i] = lsum[i] * r[i] + row_sum[i]
                    T.copy(s, s_cast)
                    for i, j in T.Parallel(bm, d):
                        acc[i, j] *= r[i]
                    T.copy(V[b, kb * bn : (kb + 1) * bn, h // group, :], V_s)
                    T.gemm(s_cast, V_s, acc, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bm, d):
                    if masked:  # a row outside the sequence's range, or that saw no key: zeros
                        q = bx * bm + i
                        zero = T.Or(T.Or(q < lo, hi <= q), lsum[i] == 0) if R is not None else lsum[i] == 0
                        acc[i, j] = T.if_then_else(zero, 0, acc[i, j] / lsum[i])
                    else:
                        acc[i, j] /= lsum[i]
                sync_shared(target, p["threads"])
                T.copy(acc, O_s)
                sync_shared(target, p["threads"])
                T.copy(O_s, O[b, bx * bm : (bx + 1) * bm, h, :])

        return without_thread_sync(self._prim_func(T, p, q_shape, kv_shape, batch, body), target)

    def inputs(self, p, randn, size):
        b, s = size("batch"), size("seq_len")
        q = randn(b, s, p["heads"], p["head_dim"])
        x = [q, randn(b, s, p["kv_heads"], p["head_dim"]), randn(b, s, p["kv_heads"], p["head_dim"])]
        if p["varlen"]:  # ragged ranges: the first sequence whole, the others padded on either side
            import torch

            u = (randn(b, 2).float().abs() * 0.4).clamp_max(0.45) * s
            lo, hi = u[:, 0].long(), s - u[:, 1].long()
            lo[0], hi[0] = 0, s
            x.append(torch.stack((lo, hi), 1).to(device=q.device, dtype=torch.int32))
        return x

    def reference(self, p, x):
        import torch

        q, k, v = (t.transpose(1, 2) for t in x[:3])  # -> [batch, heads, seq, dim]
        groups = p["heads"] // p["kv_heads"]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if not self._masked(p):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=p["causal"]).transpose(1, 2)
        s = q.shape[2]
        i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
        see = torch.ones(1, s, s, dtype=torch.bool, device=q.device)
        if p["causal"]:
            see = see & (j <= i)
        if p["window"]:
            see = see & ((i - j).abs() <= p["window"])
        if p["varlen"]:
            lo, hi = (x[3][:, c, None, None].long() for c in (0, 1))
            see = see & (lo <= i) & (i < hi) & (lo <= j) & (j < hi)
        # A masked softmax; a row that sees no key is zeros.
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(p["head_dim"])
        scores = scores.masked_fill(~see[:, None], -torch.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return (probs @ v).transpose(1, 2)
