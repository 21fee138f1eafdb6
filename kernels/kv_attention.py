"""Attention of new queries against a KV cache: decode (q_len=1) and chunked prefill, contiguous
or paged (vLLM/FlashInfer NHD pages), GQA, split-KV (flash-decoding) with a log-sum-exp combine.
How many splits a call takes is kernels/kv_splits.py."""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

import math
from dataclasses import replace

from .heads import HEAD_DIM, HEADS, KV_HEADS, check_gqa
from .kv_splits import cdiv, default_max_splits, num_splits
from .launch import dependent_launch, grid_x
from .online_softmax import online_softmax
from .registry import register
from .spec import InvalidSpec, KernelKind, Param, Target, dim, dtype_param, tile
from .tiling import cpu_attention_tiles, cuda_attention_dims, cuda_only, pow2, smem_limit

LOG2E = 1.4426950408889634
# Page ids a block stages in shared memory before its loop (its split's first pages): the
# gather then never waits on a block_table load. Paged splits are sized to fit when num_splits allows.
PAGE_WINDOW = 512
LOADS = ("auto", "tma", "cp_async")


@register
class KVAttention(KernelKind):
    name = "kv_attention"
    compile_cost = 3.0
    warm_up = (  # the two read paths generate different headers
        {"batch": 1, "heads": 8, "kv_heads": 8, "q_len": 1, "head_dim": 128, "dtype": "float16"},
        {"batch": 1, "heads": 8, "kv_heads": 8, "q_len": 1, "head_dim": 128, "paged": True, "dtype": "float16"},
    )
    doc = (
        "O = softmax(Q K^T / sqrt(d)) V of Q,O [batch,q_len,heads,head_dim] against a KV cache: K,V [batch,max_kv,kv_heads,head_dim], "
        "or with paged [num_pages,page_size,kv_heads,head_dim] plus block_table int32 [batch,max_blocks]; seq_lens int32 [batch] keys "
        "per sequence; query i sees keys 0..seq_lens[b]-q_len+i (a query that sees none gets zeros)."
    )
    params = (
        dim("batch", "sequences; None makes it a runtime size", dynamic=True),
        replace(dim("q_len", "new queries per sequence (1: decode); None makes it a runtime size", dynamic=True), default=1),
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        Param("paged", bool, default=False, doc="K,V are pages [num_pages,page_size,kv_heads,head_dim] found through block_table"),
        Param("page_size", int, default=None, min=1, max=1024, nullable=True, doc="keys per page (paged only; default 16)"),
        dtype_param(),
        tile("num_splits", "most KV splits per sequence (split-KV); the kernel uses fewer when batch or the cache is large"),
        tile("block_H", "query rows (query x head of a GQA group) per block"),
        tile("block_N", "keys per inner step"),
        Param(
            "load",
            str,
            default="auto",
            choices=LOADS,
            doc="CUDA: how K/V tiles reach shared memory: 'tma' (a pipeline of bulk copies; contiguous caches only), "
            "'cp_async' (double-buffered cp.async copies, a page at a time when paged); 'auto': cp_async when paged, else tma",
        ),
        tile("num_stages", "K/V pipeline depth (CUDA only)"),
        tile("threads", "threads per block (CUDA only)"),
    )

    def check(self, p, target):
        check_gqa(p)
        if not p["paged"] and p["page_size"] is not None:
            raise InvalidSpec("page_size", "applies only with paged=True")
        if p["paged"]:
            p["page_size"] = p["page_size"] or 16
            pow2("page_size", p["page_size"], 16, 1024)
        cuda_only(p, target, "num_stages", "threads")
        if target.is_cpu and p["load"] != "auto":
            raise InvalidSpec("load", f"applies only to CUDA targets, not {target.describe()}")
        if p["num_splits"] is None:
            p["num_splits"] = 1 if target.is_cpu else default_max_splits(p)
        if p["num_splits"] > 128:
            raise InvalidSpec("num_splits", f"must be at most 128, got {p['num_splits']}")
        if target.is_cpu:
            cpu_attention_tiles(p, "block_H", target)
            return p
        d = cuda_attention_dims(p, "kv_attention")
        # Defaults: 128-key tiles in 2 stages for a contiguous cache, 64-key cp.async gathers for a
        # paged one, the best of the tiles tried at decode (docs/measured.md#decode-attention).
        p["block_H"] = p["block_H"] or 16
        p["block_N"] = p["block_N"] or (64 if p["paged"] else 128)
        p["threads"] = p["threads"] or 128
        pow2("block_H", p["block_H"], 16, 128)
        pow2("block_N", p["block_N"], 16, 256)
        if p["threads"] not in (32, 64, 128, 256):
            raise InvalidSpec("threads", f"must be 32, 64, 128 or 256, got {p['threads']}")
        if p["block_H"] >= 64 and p["block_H"] != p["threads"] // 2:
            want = p["threads"] // 2
            raise InvalidSpec("block_H", f"64 or more rows take 64 rows per 128-thread warpgroup: {want} for {p['threads']} threads, got {p['block_H']}")
        if p["paged"] and p["block_N"] < p["page_size"] and p["page_size"] % p["block_N"]:
            raise InvalidSpec("block_N", f"must divide page_size ({p['page_size']}) or be a multiple of it, got {p['block_N']}")
        if p["load"] == "auto":
            p["load"] = "cp_async" if p["paged"] else "tma"
        if p["paged"] and p["load"] == "tma":
            raise InvalidSpec("load", "a paged cache is read with cp_async (the TMA form of pages hung on the H200, see KVAttention._gather)")
        if self._gather(p):
            p["num_stages"] = p["num_stages"] or 2
            if not 2 <= p["num_stages"] <= 4:
                raise InvalidSpec("num_stages", f"must be 2, 3 or 4 with load='cp_async' (buffers of tiles in flight), got {p['num_stages']}")
        # The largest pipeline that fits, when left open.
        for stages in (p["num_stages"],) if p["num_stages"] else (2, 1) if p["block_N"] >= 128 else (4, 3, 2, 1):
            if self._smem(p["block_H"], p["block_N"], stages, d) <= smem_limit(target):
                break
        p["num_stages"] = stages
        if not 1 <= stages <= 6:
            raise InvalidSpec("num_stages", f"must be in [1, 6], got {stages}")
        smem = self._smem(p["block_H"], p["block_N"], stages, d)
        if smem > smem_limit(target):
            limit = smem_limit(target) // 1024
            raise InvalidSpec("num_stages", f"tiles need {smem // 1024} KiB of shared memory, over the {limit} KiB a block gets on {target}; use fewer stages")
        regs = (p["block_H"] * p["block_N"] + p["block_H"] * d) // p["threads"]
        if regs > 160:
            tile_text = f"a {p['block_H']}x{p['block_N']} tile with head_dim {d}"
            raise InvalidSpec("block_H", f"{tile_text} needs {regs} fp32 registers per thread (max 160); use a smaller block_N or more threads")
        return p

    @staticmethod
    def _gather(p):
        """K/V tiles come by cp.async into two buffers, a page (or the part of one a tile holds) per
        copy. Every paged cache takes it: pages of block_N keys or more could go through the TMA
        pipeline a page per copy, but that form hung on the H200 (docs/measured.md#decode-attention)."""
        return p["load"] == "cp_async"

    def scratch(self, p):
        # Partial outputs and their log2-sum-exp, one slice per split (a 1-element stub without splits).
        return ("O_part", "LSE")

    @staticmethod
    def _smem(bh, bn, stages, d):
        """Bytes of shared memory: the Q and probability tiles, plus K and V tiles per stage (16-bit)."""
        return 2 * (bh * d + bh * bn + stages * 2 * bn * d)

    # ----- shapes and the PrimFunc signature

    def _shapes(self, T, p):
        batch = p["batch"] if p["batch"] is not None else T.dynamic("batch")
        q_len = p["q_len"] if p["q_len"] is not None else T.dynamic("q_len")
        h, kvh, d = p["heads"], p["kv_heads"], p["head_dim"]
        if p["paged"]:
            kv_shape = (T.dynamic("num_pages"), p["page_size"], kvh, d)
            table = (batch, T.dynamic("max_blocks"))
        else:
            kv_shape, table = (batch, T.dynamic("max_kv"), kvh, d), None
        split = p["num_splits"] > 1
        part = (p["num_splits"], batch, q_len, h, d) if split else (1,)
        lse = (p["num_splits"], batch, q_len, h) if split else (1,)
        return {"batch": batch, "q_len": q_len, "q": (batch, q_len, h, d), "kv": kv_shape, "table": table, "part": part, "lse": lse}

    def _num_splits(self, T, p, s):
        """Splits per sequence of a CUDA call, chosen at run time on the host (kernels/kv_splits.py)."""
        block_bytes = self._smem(p["block_H"], p["block_N"], p["num_stages"], p["head_dim"])
        return num_splits(T, p, s["batch"], s["q_len"], self._kv_span(s), block_bytes, self._gather(p), PAGE_WINDOW)

    @staticmethod
    def _kv_span(s):
        """Keys the cache holds per sequence: max_kv, or max_blocks pages."""
        return s["kv"][1] if s["table"] is None else s["table"][1] * s["kv"][1]

    @staticmethod
    def _prim_func(T, s, dtype, split_body, combine_body):
        """The PrimFunc of the ABI (Q, K, V, seq_lens[, block_table], O_part, LSE, O)."""
        if s["table"] is not None:

            @T.prim_func
            def main(
                Q: T.Tensor(s["q"], dtype),
                K: T.Tensor(s["kv"], dtype),
                V: T.Tensor(s["kv"], dtype),
                seq_lens: T.Tensor((s["batch"],), "int32"),
                block_table: T.Tensor(s["table"], "int32"),
                O_part: T.Tensor(s["part"], "float32"),
                LSE: T.Tensor(s["lse"], "float32"),
                O: T.Tensor(s["q"], dtype),
            ):
                split_body(Q, K, V, seq_lens, block_table, O_part, LSE, O)
                combine_body(O_part, LSE, O)
        else:

            @T.prim_func
            def main(
                Q: T.Tensor(s["q"], dtype),
                K: T.Tensor(s["kv"], dtype),
                V: T.Tensor(s["kv"], dtype),
                seq_lens: T.Tensor((s["batch"],), "int32"),
                O_part: T.Tensor(s["part"], "float32"),
                LSE: T.Tensor(s["lse"], "float32"),
                O: T.Tensor(s["q"], dtype),
            ):
                split_body(Q, K, V, seq_lens, None, O_part, LSE, O)
                combine_body(O_part, LSE, O)

        return main

    # ----- CPU: the same split and combine, in plain loops

    def build_cpu(self, p):
        import tilelang.language as T

        s = self._shapes(T, p)
        batch, q_len = s["batch"], s["q_len"]
        d, kvh, heads, dtype = p["head_dim"], p["kv_heads"], p["heads"], p["dtype"]
        bh, bn, nsplit, paged, ps = p["block_H"], p["block_N"], p["num_splits"], p["paged"], p["page_size"]
        group = heads // kvh
        rows = q_len * group  # query rows of one KV head: row f is query f // group, head f % group of the group
        scale = LOG2E / math.sqrt(d)
        ninf = -T.infinity("float32")
        softmax_step = online_softmax(T, bh, bn, d)

        @T.macro
        def split_body(Q, K, V, seq_lens, block_table, O_part, LSE, O):
            with T.Kernel(nsplit, kvh * T.ceildiv(rows, bh), batch) as (sid, hq, b):
                sc = T.alloc_local((bh, bn), "float32")
                acc = T.alloc_local((bh, d), "float32")
                m = T.alloc_local((bh,), "float32")
                m_prev = T.alloc_local((bh,), "float32")
                lsum = T.alloc_local((bh,), "float32")
                h, f0 = hq % kvh, hq // kvh * bh
                # Keys this block's queries see end at `kend`; split `sid` takes its share, in whole tiles.
                kend = seq_lens[b] - q_len + T.ceildiv(T.min(rows, f0 + bh), group)
                chunk = T.ceildiv(T.ceildiv(T.max(kend, 0), nsplit), bn) * bn
                start = sid * chunk
                stop = T.min(kend, start + chunk)
                for i, c in T.grid(bh, d):
                    acc[i, c] = 0
                for i in T.serial(bh):
                    m[i] = ninf
                    lsum[i] = 0
                for kb in T.serial(T.ceildiv(T.max(stop - start, 0), bn)):
                    for i, j in T.grid(bh, bn):
                        f, k = f0 + i, start + kb * bn + j
                        sc[i, j] = ninf
                        if f < rows and k < stop and k <= seq_lens[b] - q_len + f // group:
                            sc[i, j] = 0
                            for c in T.serial(d):
                                if paged:
                                    sc[i, j] += Q[b, f // group, h * group + f % group, c] * K[block_table[b, k // ps], k % ps, h, c]
                                else:
                                    sc[i, j] += Q[b, f // group, h * group + f % group, c] * K[b, k, h, c]
                            sc[i, j] = sc[i, j] * scale
                    softmax_step(sc, m, m_prev, lsum, acc)
                    for i, j, c in T.grid(bh, bn, d):
                        k = start + kb * bn + j
                        if k < stop:
                            if paged:
                                acc[i, c] += sc[i, j] * V[block_table[b, k // ps], k % ps, h, c]
                            else:
                                acc[i, c] += sc[i, j] * V[b, k, h, c]
                for i, c in T.grid(bh, d):
                    f = f0 + i
                    if f < rows:
                        if nsplit == 1:
                            O[b, f // group, h * group + f % group, c] = T.if_then_else(lsum[i] > 0, acc[i, c] / lsum[i], 0)
                        else:
                            O_part[sid, b, f // group, h * group + f % group, c] = T.if_then_else(lsum[i] > 0, acc[i, c] / lsum[i], 0)
                if nsplit > 1:
                    for i in T.serial(bh):
                        f = f0 + i
                        if f < rows:
                            LSE[sid, b, f // group, h * group + f % group] = T.if_then_else(lsum[i] > 0, T.log2(lsum[i]) + m[i], ninf)

        @T.macro
        def combine_body(O_part, LSE, O):
            if nsplit > 1:
                with T.Kernel(heads, q_len, batch) as (hh, i, b):
                    acc = T.alloc_local((d,), "float32")
                    mx = T.alloc_local((1,), "float32")
                    tot = T.alloc_local((1,), "float32")
                    mx[0] = ninf
                    tot[0] = 0
                    for c in T.serial(d):
                        acc[c] = 0
                    for sp in T.serial(nsplit):
                        mx[0] = T.max(mx[0], LSE[sp, b, i, hh])
                    for sp in T.serial(nsplit):
                        w = T.if_then_else(mx[0] == ninf, 0, T.exp2(LSE[sp, b, i, hh] - mx[0]))
                        tot[0] += w
                        for c in T.serial(d):
                            acc[c] += w * O_part[sp, b, i, hh, c]
                    for c in T.serial(d):
                        O[b, i, hh, c] = T.if_then_else(tot[0] > 0, acc[c] / tot[0], 0)

        return self._prim_func(T, s, dtype, split_body, combine_body)

    # ----- CUDA

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        s = self._shapes(T, p)
        batch, q_len = s["batch"], s["q_len"]
        d, kvh, heads, dtype = p["head_dim"], p["kv_heads"], p["heads"], p["dtype"]
        bh, bn, paged, ps, max_splits = p["block_H"], p["block_N"], p["paged"], p["page_size"], p["num_splits"]
        group = heads // kvh
        rows = q_len * group
        # Below 64 rows (mma.sync, one warp's rows) the warps share the score tile; the
        # probabilities reach the second product through shared memory.
        p_in_regs = bh >= 64
        gather = self._gather(p)
        decode = p["q_len"] == 1  # every row of a block sees the same keys: no per-row causal mask
        scale = LOG2E / math.sqrt(d)
        acc_t = "float32"
        ninf = -T.infinity(acc_t)
        qblocks = T.ceildiv(rows, bh)
        nsplit = self._num_splits(T, p, s)

        def page_of(block_table, b, idx, end):
            # Pages from key `end` on are never read from block_table (page 0 stands in; masked).
            return T.if_then_else(idx < T.ceildiv(end, ps), block_table[b, idx], 0)

        def page_at(pages_s, block_table, b, idx, first, seq_len):
            # From the staged window when it holds page `idx`, else from block_table.
            return T.if_then_else(idx - first < PAGE_WINDOW, pages_s[T.min(idx - first, PAGE_WINDOW - 1)], page_of(block_table, b, idx, seq_len))

        @T.macro
        def load_tile(Src, b, h, k0, Dst):  # load="tma": a contiguous cache, through the pipeline
            T.copy(Src[b, k0 : k0 + bn, h, :], Dst)

        # A tile of bn keys spans `copies` pages (or is part of one page): one cp.async copy each.
        span = min(bn, ps) if paged else bn
        copies = bn // span
        stages = p["num_stages"]

        @T.macro
        def gather_tile(K, V, pages_s, block_table, b, h, k0, start, seq_len, K_g, V_g, slot, page_ids):
            # Page ids go to registers first: read from shared memory between the copies, they would
            # make TileLang's sync pass put a barrier before every copy.
            if paged:
                for c in T.unroll(copies):
                    page_ids[c] = page_at(pages_s, block_table, b, (k0 + c * span) // ps, start // ps, seq_len)
                for c in T.unroll(copies):
                    T.async_copy(K[page_ids[c], (k0 + c * span) % ps : (k0 + c * span) % ps + span, h, :], K_g[slot, c * span : (c + 1) * span, :])
                for c in T.unroll(copies):
                    T.async_copy(V[page_ids[c], (k0 + c * span) % ps : (k0 + c * span) % ps + span, h, :], V_g[slot, c * span : (c + 1) * span, :])
            else:
                T.async_copy(K[b, k0 : k0 + bn, h, :], K_g[slot, :, :])
                T.async_copy(V[b, k0 : k0 + bn, h, :], V_g[slot, :, :])

        @T.macro
        def prefetch(K, V, pages_s, block_table, b, h, start, t, steps, seq_len, K_g, V_g, page_ids):
            if t < steps:
                gather_tile(K, V, pages_s, block_table, b, h, start + t * bn, start, seq_len, K_g, V_g, t % stages, page_ids)
            else:
                for _ in T.unroll(2 * copies):
                    T.ptx_commit_group()

        @T.macro
        def score_tile(Q_s, Kt, sc, m, m_prev, m_use, r, row_sum, lsum, acc, k0, stop, seq_len, f0):
            """sc = the tile's probabilities (unnormalized), m/lsum/acc rescaled: one online-softmax step."""
            T.clear(sc)
            T.gemm(Q_s, Kt, sc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            # Masked after the product: a cache slot past seq_lens may hold anything, NaN included.
            for i, j in T.Parallel(bh, bn):
                if decode:
                    sc[i, j] = T.if_then_else(k0 + j < stop, sc[i, j], ninf)
                else:
                    sc[i, j] = T.if_then_else((k0 + j < stop) & (k0 + j <= seq_len - q_len + (f0 + i) // group), sc[i, j], ninf)
            T.copy(m, m_prev)
            T.reduce_max(sc, m, dim=1, clear=False)
            # A row with no visible key yet keeps m = -inf; it scales by 0, never exp2(NaN).
            for i in T.Parallel(bh):
                m_use[i] = T.if_then_else(m[i] == ninf, 0, m[i] * scale)
                r[i] = T.exp2(m_prev[i] * scale - m_use[i])
            for i, j in T.Parallel(bh, bn):
                sc[i, j] = T.exp2(sc[i, j] * scale - m_use[i])
            T.reduce_sum(sc, row_sum, dim=1)
            for i in T.Parallel(bh):
                lsum[i] = lsum[i] * r[i] + row_sum[i]
            for i, c in T.Parallel(bh, d):
                acc[i, c] *= r[i]

        @T.macro
        def value_tile(sc, sc_cast, P_s, Vt, acc):
            if p_in_regs:
                T.copy(sc, sc_cast)
                T.gemm(sc_cast, Vt, acc, policy=T.GemmWarpPolicy.FullRow)
            else:
                T.copy(sc, P_s)
                T.gemm(P_s, Vt, acc, policy=T.GemmWarpPolicy.FullRow)

        @T.macro
        def split_body(Q, K, V, seq_lens, block_table, O_part, LSE, O):
            with T.Kernel(nsplit, kvh * qblocks, batch, threads=p["threads"]) as (sid, hq, b):
                dependent_launch(target)
                Q_s = T.alloc_shared((bh, d), dtype)
                K_s = T.alloc_shared((1 if gather else bn, d), dtype)
                V_s = T.alloc_shared((1 if gather else bn, d), dtype)
                K_g = T.alloc_shared((stages if gather else 1, bn, d), dtype)
                V_g = T.alloc_shared((stages if gather else 1, bn, d), dtype)
                page_ids = T.alloc_local((copies,), "int32")
                sc = T.alloc_fragment((bh, bn), acc_t)
                sc_cast = T.alloc_fragment((bh, bn), dtype)
                P_s = T.alloc_shared((bh, bn), dtype)
                pages_s = T.alloc_shared((PAGE_WINDOW if paged else 1,), "int32")
                acc = T.alloc_fragment((bh, d), acc_t)
                m = T.alloc_fragment((bh,), acc_t)
                m_prev = T.alloc_fragment((bh,), acc_t)
                m_use = T.alloc_fragment((bh,), acc_t)
                r = T.alloc_fragment((bh,), acc_t)
                row_sum = T.alloc_fragment((bh,), acc_t)
                lsum = T.alloc_fragment((bh,), acc_t)

                h, f0 = hq % kvh, hq // kvh * bh
                seq_len = seq_lens[b]
                kend = seq_len - q_len + T.ceildiv(T.min(rows, f0 + bh), group)
                splits = grid_x() if max_splits > 1 else 1  # nsplit, as the host launched it
                chunk = T.ceildiv(cdiv(T, T.max(kend, 0), splits), bn) * bn
                start = sid * chunk
                stop = T.min(kend, start + chunk)
                # At least one step, all masked when the split is empty: the pipeline never runs zero times.
                steps = T.max(T.ceildiv(T.max(stop - start, 0), bn), 1)

                # Rows past the last query are zeros (their outputs are never stored).
                for i, c in T.Parallel(bh, d):
                    f = T.min(f0 + i, rows - 1)
                    Q_s[i, c] = T.if_then_else(f0 + i < rows, Q[b, f // group, h * group + f % group, c], 0)
                if paged:
                    for t in T.Parallel(PAGE_WINDOW):  # the split's own pages only
                        pages_s[t] = page_of(block_table, b, start // ps + t, stop)
                # Q and the page ids are written by all threads and read by all (the TMA producer, the
                # gather, the consumers): one full barrier (TileLang's sync pass leaves it out when paged).
                T.sync_threads()
                T.fill(acc, 0)
                T.fill(lsum, 0)
                T.fill(m, ninf)
                if gather:
                    # num_stages buffers: tiles kb+1 .. kb+stages-1 are in flight while tile kb is used.
                    # Each tile is 2*copies cp.async groups (its K pages, then its V pages); a tile past
                    # the split commits empty groups instead, so the wait counts hold on every step.
                    for t in T.unroll(stages - 1):
                        prefetch(K, V, pages_s, block_table, b, h, start, t, steps, seq_len, K_g, V_g, page_ids)
                    for kb in T.serial(steps):
                        k0 = start + kb * bn
                        prefetch(K, V, pages_s, block_table, b, h, start, kb + stages - 1, steps, seq_len, K_g, V_g, page_ids)
                        T.ptx_wait_group((2 * stages - 1) * copies)  # this tile's K
                        T.sync_threads()
                        score_tile(Q_s, K_g[kb % stages, :, :], sc, m, m_prev, m_use, r, row_sum, lsum, acc, k0, stop, seq_len, f0)
                        T.ptx_wait_group(2 * (stages - 1) * copies)  # and its V
                        T.sync_threads()
                        value_tile(sc, sc_cast, P_s, V_g[kb % stages, :, :], acc)
                        T.sync_threads()  # every thread is done with this buffer before it is refilled
                else:
                    for kb in T.Pipelined(steps, num_stages=p["num_stages"]):
                        k0 = start + kb * bn
                        load_tile(K, b, h, k0, K_s)
                        score_tile(Q_s, K_s, sc, m, m_prev, m_use, r, row_sum, lsum, acc, k0, stop, seq_len, f0)
                        load_tile(V, b, h, k0, V_s)
                        value_tile(sc, sc_cast, P_s, V_s, acc)
                for i in T.Parallel(bh):
                    r[i] = T.if_then_else(lsum[i] > 0, 1 / lsum[i], 0)
                    row_sum[i] = T.if_then_else(lsum[i] > 0, T.log2(lsum[i]) + m[i] * scale, ninf)
                for i, c in T.Parallel(bh, d):
                    acc[i, c] *= r[i]
                if splits == 1:
                    for i, c in T.Parallel(bh, d):
                        f = f0 + i
                        if f < rows:
                            O[b, f // group, h * group + f % group, c] = acc[i, c]
                else:
                    for i, c in T.Parallel(bh, d):
                        f = f0 + i
                        if f < rows:
                            O_part[sid, b, f // group, h * group + f % group, c] = acc[i, c]
                    for i in T.Parallel(bh):
                        f = f0 + i
                        if f < rows:
                            LSE[sid, b, f // group, h * group + f % group] = row_sum[i]

        @T.macro
        def combine_body(O_part, LSE, O):
            if max_splits > 1:
                # One idle block when the split kernel wrote O itself: a full grid of idle blocks was
                # slower (docs/measured.md#decode-attention).
                combines = T.if_then_else(nsplit > 1, heads, 1)
                with T.Kernel(combines, q_len, T.if_then_else(nsplit > 1, batch, 1), threads=d) as (hh, i, b):
                    dependent_launch(target)
                    # The splits' log-sum-exps are loaded once, a thread each, and read from shared
                    # memory; the partial outputs are summed over the splits this call made, not the
                    # build's most: loops over num_splits cost in proportion
                    # (docs/measured.md#decode-attention).
                    lse_s = T.alloc_shared((max_splits,), acc_t)
                    splits = T.alloc_local((1,), "int32")  # the rule evaluated once, not at each use
                    mx = T.alloc_local((1,), acc_t)
                    tot = T.alloc_local((1,), acc_t)
                    acc = T.alloc_fragment((d,), acc_t)
                    splits[0] = nsplit
                    if splits[0] > 1:  # else the split kernel wrote O
                        for sp in T.Parallel(max_splits):
                            lse_s[sp] = T.if_then_else(sp < splits[0], LSE[T.min(sp, max_splits - 1), b, i, hh], ninf)
                        mx[0] = ninf
                        for sp in T.serial(splits[0]):
                            mx[0] = T.max(mx[0], lse_s[sp])
                        tot[0] = 0
                        for sp in T.serial(splits[0]):
                            tot[0] += T.if_then_else(mx[0] == ninf, 0, T.exp2(lse_s[sp] - mx[0]))
                        for c in T.Parallel(d):
                            acc[c] = 0
                            for sp in T.serial(splits[0]):
                                acc[c] += T.if_then_else(mx[0] == ninf, 0, T.exp2(lse_s[sp] - mx[0])) * O_part[sp, b, i, hh, c]
                            O[b, i, hh, c] = T.if_then_else(tot[0] > 0, acc[c] / tot[0], 0)

        return self._prim_func(T, s, dtype, split_body, combine_body)

    # ----- inputs and reference

    def inputs(self, p, randn, size):
        """Q, K, V, seq_lens[, block_table]: ragged seq_lens in [q_len, max_kv] with one sequence full;
        pages a random permutation (drawn from the same generator: argsort of normals)."""
        import torch

        b, q, kvh, d = size("batch"), size("q_len"), p["kv_heads"], p["head_dim"]
        max_kv = max(size("max_kv"), q)
        u = torch.special.ndtr(randn(b).float())  # uniform in (0, 1)
        lens = (q + (u * (max_kv - q + 1)).long().clamp_max(max_kv - q)).to(torch.int32)
        lens[0] = max_kv
        qt = randn(b, q, p["heads"], d)
        if not p["paged"]:
            return [qt, randn(b, max_kv, kvh, d), randn(b, max_kv, kvh, d), lens]
        ps = p["page_size"]
        blocks = -(-max_kv // ps)
        pages = b * blocks + 1  # one spare page: never referenced
        table = torch.argsort(randn(pages).float())[: b * blocks].reshape(b, blocks).to(torch.int32)
        return [qt, randn(pages, ps, kvh, d), randn(pages, ps, kvh, d), lens, table.contiguous()]

    def reference(self, p, x):
        """fp32, one sequence at a time; x as make_inputs gives it (the int inputs arrive as floats)."""
        import torch

        q, k, v, lens = x[:4]
        out = torch.zeros_like(q)
        group = p["heads"] // p["kv_heads"]
        q_len = q.shape[1]
        for b in range(q.shape[0]):
            n = int(lens[b])
            if p["paged"]:
                pages = x[4][b].long()
                kb = k[pages].flatten(0, 1)[:n]
                vb = v[pages].flatten(0, 1)[:n]
            else:
                kb, vb = k[b, :n], v[b, :n]
            kb = kb.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, n, d]
            vb = vb.repeat_interleave(group, dim=1).transpose(0, 1)
            qb = q[b].transpose(0, 1)  # [heads, q_len, d]
            scores = qb @ kb.transpose(1, 2) / math.sqrt(p["head_dim"])
            # Query i sees keys 0 .. n - q_len + i.
            visible = torch.arange(n, device=q.device)[None, :] <= (n - q_len + torch.arange(q_len, device=q.device))[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no key: zeros
            out[b] = (probs @ vb).transpose(0, 1)
        return out
