"""Rotary position embedding of queries and keys, vLLM's layout and styles, fp32 arithmetic.

cos_sin_cache[max_position, rotary_dim] holds cos(pos * f_i) in its first rotary_dim/2
columns and sin(pos * f_i) in the rest (vLLM's RotaryEmbedding.cos_sin_cache). For each
token t at p = positions[t] and each head, the first rotary_dim elements are rotated in
pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with (cos, sin) of pair i:
  neox: pairs (i, i + rotary_dim/2): the two halves (GPT-NeoX, Llama);
  gptj: pairs (2i, 2i + 1): interleaved (GPT-J).
Elements past rotary_dim (partial rotary) are copied unchanged.

With `packed` the input is one QKV[tokens, heads + 2*kv_heads, head_dim]: a fused QKV GEMM's
output viewed per head, Q heads first, then K, then V. Q and K are rotated into new
contiguous outputs; V is left in QKV for the caller (the paged cache takes it as a view),
or with `v_out` (packed only) copied unchanged into a third new output Vout[tokens, kv_heads,
head_dim] in the same launch, for a caller that needs V contiguous (an attention kernel).

With `write_cache` (packed only) the kernel also stores each token's rotated K heads and its
V heads into K_cache and V_cache [num_slots, kv_heads, head_dim] at row slots[t] (int64):
vLLM's slot mapping into a paged cache viewed as [num_pages * page_size, kv_heads, head_dim].
A slot outside [0, num_slots) is not written (vLLM marks padding tokens with -1). The two
caches are inputs the kernel updates in place (KernelKind.writes): one launch where the
decode step would otherwise run two index_copy_ kernels after rope.

positions are int64 (what torch and vLLM use) and must lie in [0, max_position); one outside
is not reported, but it never reads past the cache: its cos/sin row reads as zeros (its
rotated elements come out zero).
"""
# No `from __future__ import annotations` here: TileLang reads the T.Tensor
# annotations of the PrimFuncs below at trace time.

from .launch import dependent_launch
from .registry import register
from .spec import InvalidSpec, KernelKind, Param, Target, dim, dtype_param, tile
from .tiling import cuda_only, pow2, smem_limit

STYLES = ("neox", "gptj")


def _sizes(T, p):
    tokens = p["tokens"] if p["tokens"] is not None else T.dynamic("tokens")
    max_pos = p["max_position"] if p["max_position"] is not None else T.dynamic("max_position")
    return tokens, max_pos


def prim_func(T, body, p, tokens, max_pos):
    """The PrimFunc of the ABI (positions, Q, K, cos_sin_cache, Qout, Kout), or with `packed`
    (positions, QKV, cos_sin_cache, Qout, Kout), or with `write_cache` too (positions, QKV,
    cos_sin_cache, slots, K_cache, V_cache, Qout, Kout), each packed form with a last output Vout
    with `v_out`, around `body(positions, Q, q0, K, k0, cos_sin_cache, Qout, Kout, slots, K_cache,
    V_cache, Vout)`: query head h is Q[t, q0 + h], key head h K[t, k0 + h], value head h
    K[t, k0 + kv_heads + h] (Q and K both QKV when packed; the slots and caches None unless
    written, Vout None unless asked)."""
    dtype, heads, kv_heads, d = p["dtype"], p["heads"], p["kv_heads"], p["head_dim"]
    q_shape, k_shape, cs_shape = (tokens, heads, d), (tokens, kv_heads, d), (max_pos, p["rotary_dim"])
    qkv_shape = (tokens, heads + 2 * kv_heads, d)
    if p["write_cache"] and p["v_out"]:
        cache_shape = (T.dynamic("num_slots"), kv_heads, d)

        @T.prim_func
        def main(
            positions: T.Tensor((tokens,), "int64"),
            QKV: T.Tensor(qkv_shape, dtype),
            cos_sin_cache: T.Tensor(cs_shape, dtype),
            slots: T.Tensor((tokens,), "int64"),
            K_cache: T.Tensor(cache_shape, dtype),
            V_cache: T.Tensor(cache_shape, dtype),
            Qout: T.Tensor(q_shape, dtype),
            Kout: T.Tensor(k_shape, dtype),
            Vout: T.Tensor(k_shape, dtype),
        ):
            body(positions, QKV, 0, QKV, heads, cos_sin_cache, Qout, Kout, slots, K_cache, V_cache, Vout)
    elif p["write_cache"]:
        cache_shape = (T.dynamic("num_slots"), kv_heads, d)

        @T.prim_func
        def main(
            positions: T.Tensor((tokens,), "int64"),
            QKV: T.Tensor(qkv_shape, dtype),
            cos_sin_cache: T.Tensor(cs_shape, dtype),
            slots: T.Tensor((tokens,), "int64"),
            K_cache: T.Tensor(cache_shape, dtype),
            V_cache: T.Tensor(cache_shape, dtype),
            Qout: T.Tensor(q_shape, dtype),
            Kout: T.Tensor(k_shape, dtype),
        ):
            body(positions, QKV, 0, QKV, heads, cos_sin_cache, Qout, Kout, slots, K_cache, V_cache, None)
    elif p["v_out"]:

        @T.prim_func
        def main(
            positions: T.Tensor((tokens,), "int64"),
            QKV: T.Tensor(qkv_shape, dtype),
            cos_sin_cache: T.Tensor(cs_shape, dtype),
            Qout: T.Tensor(q_shape, dtype),
            Kout: T.Tensor(k_shape, dtype),
            Vout: T.Tensor(k_shape, dtype),
        ):
            body(positions, QKV, 0, QKV, heads, cos_sin_cache, Qout, Kout, None, None, None, Vout)
    elif p["packed"]:

        @T.prim_func
        def main(
            positions: T.Tensor((tokens,), "int64"),
            QKV: T.Tensor(qkv_shape, dtype),
            cos_sin_cache: T.Tensor(cs_shape, dtype),
            Qout: T.Tensor(q_shape, dtype),
            Kout: T.Tensor(k_shape, dtype),
        ):
            body(positions, QKV, 0, QKV, heads, cos_sin_cache, Qout, Kout, None, None, None, None)
    else:

        @T.prim_func
        def main(
            positions: T.Tensor((tokens,), "int64"),
            Q: T.Tensor(q_shape, dtype),
            K: T.Tensor(k_shape, dtype),
            cos_sin_cache: T.Tensor(cs_shape, dtype),
            Qout: T.Tensor(q_shape, dtype),
            Kout: T.Tensor(k_shape, dtype),
        ):
            body(positions, Q, 0, K, 0, cos_sin_cache, Qout, Kout, None, None, None, None)

    return main


@register
class RoPE(KernelKind):
    name = "rope"
    warm_up = ({"tokens": None, "heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "float16"},)
    compile_cost = 0.5
    outputs = (-2, -1)
    doc = (
        "Rotary embedding: Q[tokens,heads,head_dim], K[tokens,kv_heads,head_dim] rotated by cos_sin_cache[positions[t]] "
        "(int64 positions; cache [max_position, rotary_dim], cos then sin); returns (Q', K'); out=(Q, K) rotates in place. "
        "packed: one QKV[tokens,heads+2*kv_heads,head_dim] (Q, K, then V heads) in place of Q and K; V stays in QKV. "
        "write_cache (packed): also stores K' and V at rows slots[t] (int64) of K_cache, V_cache [num_slots,kv_heads,head_dim], in place. "
        "v_out (packed): also copies V into a new contiguous Vout[tokens,kv_heads,head_dim]; returns (Q', K', V)."
    )
    params = (
        dim("tokens", "tokens (rows of positions, Q, K); None makes it a runtime size", dynamic=True),
        dim("heads", "query heads"),
        dim("kv_heads", "key heads"),
        dim("head_dim"),
        Param(
            "rotary_dim",
            int,
            default=None,
            min=2,
            max=1 << 20,
            nullable=True,
            doc="leading elements of each head rotated (even, at most head_dim); None: head_dim",
        ),
        Param("style", str, default="neox", choices=STYLES, doc="neox: rotate halves; gptj: rotate interleaved pairs"),
        Param("max_position", int, default=None, min=1, max=1 << 24, nullable=True, doc="rows of cos_sin_cache; None (default) makes it a runtime size"),
        dtype_param("element type of Q, K and cos_sin_cache"),
        Param("packed", bool, default=False, doc="one input QKV[tokens, heads + 2*kv_heads, head_dim] (a fused QKV GEMM's output) in place of Q and K"),
        Param(
            "write_cache",
            bool,
            default=False,
            doc="packed only: also write K' and V into K_cache, V_cache [num_slots, kv_heads, head_dim] at rows slots[t] "
            "(int64, vLLM's slot mapping; a slot outside the cache is skipped), updating them in place",
        ),
        Param(
            "v_out",
            bool,
            default=False,
            doc="packed only: also copy QKV's V heads, unchanged, into a third new output Vout[tokens, kv_heads, head_dim] "
            "(contiguous, for an attention kernel), in the same launch",
        ),
        tile("threads", "threads per token (CUDA only)"),
    )

    def output_slots(self, p):
        return (-3, -2, -1) if p["v_out"] else (-2, -1)

    def inplace(self, p):
        # One token per block (a thread on the CPU): its heads are read whole before they are written.
        # Packed, the outputs are shaped unlike QKV: always new tensors.
        return {} if p["packed"] else {"Qout": "Q", "Kout": "K"}

    def writes(self, p):
        return ("K_cache", "V_cache") if p["write_cache"] else ()

    def check(self, p, target):
        d = p["head_dim"]
        p["rotary_dim"] = p["rotary_dim"] or d
        rot = p["rotary_dim"]
        if rot > d or rot % 2:
            raise InvalidSpec("rotary_dim", f"must be even and at most head_dim ({d}), got {rot}; leave it unset to rotate the whole head")
        if p["write_cache"] and not p["packed"]:
            raise InvalidSpec("write_cache", "needs packed=True (the V heads come from QKV)")
        if p["v_out"] and not p["packed"]:
            raise InvalidSpec("v_out", "needs packed=True (the V heads come from QKV)")
        cuda_only(p, target, "threads")
        if target.is_cpu:
            return p
        align = 4 if p["dtype"] == "float32" else 8
        for name in ("head_dim", "rotary_dim"):  # heads and cos/sin rows move in 16-byte pieces
            if p[name] % align:
                raise InvalidSpec(name, f"must be a multiple of {align} for {p['dtype']} on CUDA (16-byte vectors), got {p[name]}")
        p["threads"] = p["threads"] or 128
        pow2("threads", p["threads"], 32, 1024)
        elems = (p["heads"] + p["kv_heads"]) * d
        size = 4 if p["dtype"] == "float32" else 2
        staged_v = p["write_cache"] or p["v_out"]
        if (2 * elems + staged_v * p["kv_heads"] * d + rot) * size > smem_limit(target):  # inputs and results staged
            raise InvalidSpec(
                "heads",
                f"(heads + kv_heads) * head_dim = {elems} elements per token{' (and V: kv_heads * head_dim)' if staged_v else ''} "
                f"do not fit one block's shared memory on {target}; use fewer heads per call",
            )
        return p

    def build_cpu(self, p):
        import tilelang.language as T

        tokens, max_pos = _sizes(T, p)
        d, rot = p["head_dim"], p["rotary_dim"]
        half, neox = rot // 2, p["style"] == "neox"

        @T.macro
        def rotate(src, h0, dst, t, heads, cs):
            # Both elements of a pair are read before either is written: dst may be src.
            x = T.alloc_local((2,), "float32")
            for h, i in T.grid(heads, half):
                a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
                x[0] = src[t, h0 + h, a]
                x[1] = src[t, h0 + h, b]
                dst[t, h, a] = x[0] * cs[i] - x[1] * cs[half + i]
                dst[t, h, b] = x[1] * cs[i] + x[0] * cs[half + i]
            for h, j in T.grid(heads, d - rot):
                dst[t, h, rot + j] = src[t, h0 + h, rot + j]

        @T.macro
        def body(positions, Q, q0, K, k0, cos_sin_cache, Qout, Kout, slots, K_cache, V_cache, Vout):
            with T.Kernel(tokens) as t:
                # The position's cos/sin row; a position outside the cache reads zeros, as the CUDA form's
                # bounds-checked copy does, never memory past the cache.
                cs = T.alloc_local((rot,), "float32")
                last = T.cast(max_pos, "int64") - 1
                for i in T.serial(rot):
                    cs[i] = T.if_then_else(positions[t] >= 0 and positions[t] <= last, cos_sin_cache[T.max(T.min(positions[t], last), 0), i], 0)
                rotate(Q, q0, Qout, t, p["heads"], cs)
                rotate(K, k0, Kout, t, p["kv_heads"], cs)
                if p["write_cache"]:
                    if slots[t] >= 0 and slots[t] < K_cache.shape[0]:
                        for h, c in T.grid(p["kv_heads"], d):
                            K_cache[slots[t], h, c] = Kout[t, h, c]
                            V_cache[slots[t], h, c] = K[t, k0 + p["kv_heads"] + h, c]
                if p["v_out"]:
                    for h, c in T.grid(p["kv_heads"], d):
                        Vout[t, h, c] = K[t, k0 + p["kv_heads"] + h, c]

        return prim_func(T, body, p, tokens, max_pos)

    def build_cuda(self, p, target: Target):
        import tilelang.language as T

        tokens, max_pos = _sizes(T, p)
        dtype, d, rot = p["dtype"], p["head_dim"], p["rotary_dim"]
        heads, kv_heads, threads = p["heads"], p["kv_heads"], p["threads"]
        half, neox = rot // 2, p["style"] == "neox"

        @T.macro
        def rotate(src, dst, n_heads, cs):
            # One thread per pair: both elements are read (from shared memory) and both written.
            for h, i in T.Parallel(n_heads, half):
                a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
                c, s = T.cast(cs[i], "float32"), T.cast(cs[half + i], "float32")
                dst[h, a] = T.cast(T.cast(src[h, a], "float32") * c - T.cast(src[h, b], "float32") * s, dtype)
                dst[h, b] = T.cast(T.cast(src[h, b], "float32") * c + T.cast(src[h, a], "float32") * s, dtype)
            if rot != d:  # partial rotary: the rest of each head unchanged
                for h, j in T.Parallel(n_heads, d - rot):
                    dst[h, rot + j] = src[h, rot + j]

        @T.macro
        def body(positions, Q, q0, K, k0, cos_sin_cache, Qout, Kout, slots, K_cache, V_cache, Vout):
            # One token per block. Its heads (packed: the Q and K heads of its QKV row, and its V
            # heads only to write the cache or Vout) and its cos/sin row are staged in shared memory with
            # 16-byte coalesced loads, so a pair's two elements (other threads' loads) are both
            # readable; the results are staged there too and stored with 16-byte stores.
            # Everything is read before anything is written: Qout may be Q, Kout K.
            with T.Kernel(tokens, threads=threads) as t:
                dependent_launch(target)
                q_s = T.alloc_shared((heads, d), dtype)
                k_s = T.alloc_shared((kv_heads, d), dtype)
                qo_s = T.alloc_shared((heads, d), dtype)
                ko_s = T.alloc_shared((kv_heads, d), dtype)
                cs_s = T.alloc_shared((rot,), dtype)
                v_s = T.alloc_shared((kv_heads if p["write_cache"] or p["v_out"] else 1, d), dtype)
                T.copy(Q[t, q0 : q0 + heads, :], q_s)
                T.copy(K[t, k0 : k0 + kv_heads, :], k_s)
                if p["write_cache"] or p["v_out"]:
                    T.copy(K[t, k0 + kv_heads : k0 + 2 * kv_heads, :], v_s)
                T.copy(cos_sin_cache[positions[t], :], cs_s)
                rotate(q_s, qo_s, heads, cs_s)
                rotate(k_s, ko_s, kv_heads, cs_s)
                T.copy(qo_s, Qout[t, :, :])
                T.copy(ko_s, Kout[t, :, :])
                if p["v_out"]:
                    T.copy(v_s, Vout[t, :, :])
                if p["write_cache"]:
                    if slots[t] >= 0 and slots[t] < K_cache.shape[0]:
                        T.copy(ko_s, K_cache[slots[t], :, :])
                        T.copy(v_s, V_cache[slots[t], :, :])

        return prim_func(T, body, p, tokens, max_pos)

    def inputs(self, p, randn, size):
        import torch

        tokens, max_pos = size("tokens"), size("max_position")
        heads = [p["heads"] + 2 * p["kv_heads"]] if p["packed"] else [p["heads"], p["kv_heads"]]
        qk = [randn(tokens, h, p["head_dim"]) for h in heads]
        positions = (torch.arange(tokens, device=qk[0].device) * 7 + 3) % max_pos  # spread over the cache, repeats included
        cache = cos_sin_cache(max_pos, p["rotary_dim"] or p["head_dim"], device=qk[0].device).to(qk[0].dtype)
        if not p["write_cache"]:
            return [positions.to(torch.int64), *qk, cache]
        # Twice the tokens' slots, in shuffled order; the last token is padding (-1: not written).
        num_slots = 2 * tokens + 3
        slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(tokens))[:tokens].to(qk[0].device)
        slots[-1] = -1
        caches = [randn(num_slots, p["kv_heads"], p["head_dim"]) for _ in range(2)]
        return [positions.to(torch.int64), *qk, cache, slots, *caches]

    def reference(self, p, x):
        """(Q', K'), or (Q', K', V) with v_out; with write_cache the caches' new rows are cache_rows_reference's."""
        positions, *qk, cache = x[:-3] if p["write_cache"] else x  # without slots, K_cache, V_cache
        if p["v_out"]:
            q, k, v = split_qkv(qk[0], p["heads"], p["kv_heads"])
            return (*rope_reference(positions, q, k, cache, p["style"]), v.contiguous())
        q, k = split_qkv(qk[0], p["heads"], p["kv_heads"])[:2] if p["packed"] else qk
        return rope_reference(positions, q, k, cache, p["style"])


def cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0, device="cpu"):
    """vLLM's cache layout in fp32: [max_position, rotary_dim], cos of each frequency, then sin."""
    import torch

    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    angles = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def cache_rows_reference(k_rotated, v, slots, k_cache, v_cache):
    """The caches after a write_cache call, in torch: rows slots[t] set to K'[t] and V[t], where
    the slot lies in the cache; the inputs stay as they are."""
    valid = (slots >= 0) & (slots < k_cache.shape[0])
    k_out, v_out = k_cache.clone(), v_cache.clone()
    k_out[slots[valid]] = k_rotated[valid].to(k_cache.dtype)
    v_out[slots[valid]] = v[valid].to(v_cache.dtype)
    return k_out, v_out


def split_qkv(qkv, heads: int, kv_heads: int):
    """(Q, K, V) views of a packed QKV[tokens, heads + 2*kv_heads, head_dim]."""
    return qkv.split([heads, kv_heads, kv_heads], dim=1)


def rope_reference(positions, q, k, cache, style: str):
    """(Q', K') in torch, for either style; rotary_dim is the cache's width."""
    import torch

    rot = cache.shape[-1]
    cos, sin = cache[positions.long()].chunk(2, dim=-1)  # [tokens, rot/2] each
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()

    def apply(x):
        r, rest = x[..., :rot].float(), x[..., rot:]
        if style == "neox":
            x1, x2 = r.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([out.to(x.dtype), rest], dim=-1)

    return apply(q), apply(k)
