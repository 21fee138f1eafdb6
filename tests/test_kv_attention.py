"""kv_attention: attention of new queries against a KV cache (decode, chunked prefill; contiguous
or paged; GQA; split-KV). CPU numerics through the daemon, the spec's rules, CUDA lowering for
sm_90a (cross-compiled here), and GPU numerics where a GPU is visible. Sizes are ragged: no
multiple of any tile, seq_lens differing per sequence."""

import re

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import reference
from tests.lowering import cuda_source
from tests.marks import needs_gpu

KIND = "kv_attention"


def close(out, ref, tol=1e-4):
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    assert err < tol, f"relative error {err:.2e}"


def make(p, lens=None, seed=0, device="cpu", **runtime):
    ins = reference.make_inputs(KIND, p, device, runtime=runtime, seed=seed)
    if lens is not None:
        ins[3] = torch.tensor(lens, dtype=torch.int32, device=device)
    return ins


# ----- the spec


def test_cuda_defaults():
    decode = kernels.canonicalize(KIND, dict(batch=None, heads=32, kv_heads=8, head_dim=128, dtype="float16"), "sm_90a").params
    assert decode["q_len"] == 1 and not decode["paged"] and decode["page_size"] is None
    assert (decode["num_splits"], decode["block_H"], decode["block_N"], decode["num_stages"], decode["threads"]) == (32, 16, 128, 2, 128)
    paged = kernels.canonicalize(KIND, dict(batch=None, heads=32, kv_heads=8, head_dim=128, dtype="float16", paged=True), "sm_90a").params
    assert paged["page_size"] == 16 and paged["num_stages"] == 2  # paged caches are gathered into two buffers
    prefill = kernels.canonicalize(KIND, dict(batch=None, q_len=None, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16"), "sm_90a").params
    assert prefill["num_splits"] == 1
    cpu = kernels.canonicalize(KIND, dict(batch=2, heads=4, kv_heads=2, head_dim=8, dtype="float32"), "c").params
    assert (cpu["num_splits"], cpu["block_H"], cpu["block_N"]) == (1, 16, 16)


@pytest.mark.parametrize(
    "changes,target,field,words",
    [
        (dict(kv_heads=3), "sm_90a", "kv_heads", "multiple"),
        (dict(page_size=16), "sm_90a", "page_size", "paged=True"),
        (dict(paged=True, page_size=24), "sm_90a", "page_size", "power of two"),
        (dict(paged=True, page_size=8), "sm_90a", "page_size", "power of two"),
        (dict(dtype="float32"), "sm_90a", "dtype", "float16"),
        (dict(num_splits=200), "sm_90a", "num_splits", "at most"),
        (dict(block_H=64, threads=256), "sm_90a", "block_H", "warpgroup"),
        (dict(paged=True, num_stages=5), "sm_90a", "num_stages", "cp_async"),
        (dict(paged=True, load="tma"), "sm_90a", "load", "paged"),
        (dict(load="tma", dtype="float32"), "c", "load", "CUDA"),
        (dict(head_dim=72), "sm_90a", "head_dim", "multiple of 16"),
        (dict(threads=128, dtype="float32"), "c", "threads", "CUDA"),
        (dict(), "c", "dtype", "float32"),
    ],
)
def test_invalid_specs_name_the_field(changes, target, field, words):
    params = {**dict(batch=None, heads=32, kv_heads=8, head_dim=128, dtype="float16"), **changes}
    with pytest.raises(kernels.InvalidSpec) as err:
        kernels.canonicalize(KIND, params, target)
    assert err.value.field == field and words in str(err.value)


# ----- the reference itself, against torch's SDPA and against the contiguous form


def test_reference_is_sdpa_for_full_sequences():
    p = kernels.canonicalize(KIND, dict(batch=None, q_len=None, heads=6, kv_heads=2, head_dim=8, dtype="float32"), "c").params
    q, k, v, _ = make(p, batch=2, q_len=4, max_kv=9)
    lens = torch.tensor([9, 9], dtype=torch.int32)
    # Query i sees keys 0..5+i: SDPA's causal mask aligned to the bottom right.
    visible = torch.ones(4, 9, dtype=torch.bool).tril(diagonal=5)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible, enable_gqa=True).transpose(1, 2)
    close(kernels.get_kind(KIND).reference(p, [q, k, v, lens]), want, 1e-5)


def test_reference_of_pages_is_the_contiguous_one():
    p = kernels.canonicalize(KIND, dict(batch=None, q_len=2, heads=4, kv_heads=1, head_dim=8, dtype="float32", paged=True), "c").params
    q, kp, vp, lens, table = make(p, batch=3, max_kv=40)
    assert sorted(table.flatten().tolist()) != list(range(table.numel()))  # pages in a random order
    k, v = kp[table.long()].flatten(1, 2), vp[table.long()].flatten(1, 2)  # [batch, blocks*page, kv_heads, d]
    contiguous = dict(p, paged=False, page_size=None)
    kind = kernels.get_kind(KIND)
    close(kind.reference(p, [q, kp, vp, lens, table]), kind.reference(contiguous, [q, k, v, lens]), 1e-6)


# ----- CPU numerics, through the daemon and the client's loader

CPU_CASES = [
    # (params, runtime sizes, seq_lens or None for the input maker's ragged ones)
    (dict(batch=None, heads=8, kv_heads=2, head_dim=24), dict(batch=3, max_kv=77), [77, 1, 40]),
    (dict(batch=None, heads=8, kv_heads=2, head_dim=24, num_splits=3), dict(batch=3, max_kv=77), [77, 5, 33]),
    (dict(batch=2, q_len=None, heads=6, kv_heads=3, head_dim=16, num_splits=2, block_H=4, block_N=8), dict(q_len=5, max_kv=70), None),
    (dict(batch=None, q_len=3, heads=4, kv_heads=4, head_dim=16, paged=True, num_splits=4), dict(batch=3, max_kv=70), None),
    (dict(batch=None, q_len=None, heads=8, kv_heads=2, head_dim=16, paged=True, page_size=32, block_N=8), dict(batch=2, q_len=7, max_kv=100), [7, 100]),
]


@pytest.mark.parametrize("params,runtime,lens", CPU_CASES)
def test_cpu_matches_the_reference(cpu_kernel, params, runtime, lens):
    k = cpu_kernel(KIND, dtype="float32", **params)
    assert k.input_names == ["Q", "K", "V", "seq_lens"] + (["block_table"] if params.get("paged") else [])  # scratch is the loader's
    p = k.spec["params"]
    ins = make(p, lens, **runtime)
    close(k(*ins), reference.reference(KIND, p, ins))


def test_cpu_queries_that_see_no_key_get_zeros(cpu_kernel):
    """seq_lens[b] < q_len: query i sees keys 0..seq_lens[b]-q_len+i, none for the first ones."""
    k = cpu_kernel(KIND, batch=None, q_len=None, heads=4, kv_heads=2, head_dim=8, dtype="float32", num_splits=3, block_H=4)
    p = k.spec["params"]
    ins = make(p, [2, 0, 9], batch=3, q_len=6, max_kv=9)
    out = k(*ins)
    assert out[0, :4].abs().max() == 0 and out[0, 4:].abs().min() > 0 and out[1].abs().max() == 0
    close(out, reference.reference(KIND, p, ins))


def test_cpu_decode_runtime_sizes_one_kernel(cpu_kernel):
    k = cpu_kernel(KIND, batch=None, heads=4, kv_heads=1, head_dim=8, dtype="float32", paged=True, num_splits=2)
    p = k.spec["params"]
    for batch, max_kv in ((1, 3), (4, 50)):
        ins = make(p, seed=batch, batch=batch, max_kv=max_kv)
        close(k(*ins), reference.reference(KIND, p, ins))


# ----- CUDA: lowered for sm_90a on any machine (TileLang cross-compiles)

DECODE = dict(batch=None, heads=32, kv_heads=8, head_dim=128, dtype="float16")


def _splits(params, keys):
    """The KV splits an sm_90a build's host code picks for a call with `keys` per sequence."""
    import tilelang.language as T
    import tvm
    from tvm import tirx

    kind = kernels.get_kind(KIND)
    p = dict(kernels.canonicalize(KIND, params, "sm_90a").params)
    s = kind._shapes(T, p)
    expr = kind._num_splits(T, p, s)
    if isinstance(expr, int):  # fixed by the build
        return expr
    runtime = {"max_kv": keys, "max_blocks": keys // (p["page_size"] or 1)}
    found = {}
    tirx.stmt_functor.post_order_visit(expr, lambda x: found.setdefault(x.name, x) if isinstance(x, tirx.Var) else None)
    return int(tvm.arith.Analyzer().simplify(tirx.stmt_functor.substitute(expr, {v: runtime[n] for n, v in found.items()})))


def test_decode_splits_fill_one_wave_of_sms():
    """A call whose blocks fit one wave takes the most splits that fit it: 132 SMs times the
    blocks whose shared memory fits one (a TMA block: one; a page-gather block: three). A larger
    gathered call aims for GATHER_TARGET_BLOCKS; a gathered split reads at least MIN_SPLIT_KEYS
    keys (two tiles when that would leave over half the SMs idle), a TMA split one tile."""
    assert [_splits(dict(DECODE, batch=8), n) for n in (1024, 4096, 32768)] == [2, 2, 2]  # 8 x 8 heads x 2 = 128 blocks, not 256
    assert [_splits(dict(DECODE, batch=1), n) for n in (1024, 4096, 32768)] == [8, 11, 16]  # 1k: 8 one-tile splits; 4k: 3/4 of a wave, 3 tiles each
    assert _splits(dict(DECODE, batch=64), 32768) == 1
    paged = dict(DECODE, paged=True)
    assert [_splits(dict(paged, batch=8), n) for n in (1024, 4096, 32768)] == [4, 6, 6]  # 256 keys: four 64-key tiles; 384 of 396 blocks
    assert [_splits(dict(paged, batch=1), n) for n in (1024, 2048, 4096)] == [8, 16, 16]  # 4 splits of 256 keys would be 32 blocks
    assert _splits(dict(paged, batch=2), 32768) == 24  # 384 blocks, not 32 splits' 512 (1.3 waves)
    assert _splits(dict(paged, batch=64), 4096) == 3  # 512 head blocks are more than a wave: 1536 >= 1056
    assert _splits(dict(DECODE, batch=8, num_splits=1), 4096) == 1


def test_decode_splits_past_one_wave_fill_the_last_wave():
    """A TMA call of more head blocks than a wave splits when one split would leave its last wave
    part-filled (kv_splits.filling_splits): batch 17 is 136 head blocks, a full wave and 4 more;
    as 4 splits, 544 blocks fill 5 waves to 82% (H200: 0.70x -> 1.00x SDPA at 16k keys). A
    batch whose one split already fills its waves keeps it, as does a cache too short for 4
    tiles a split."""
    got = {b: _splits(dict(DECODE, batch=b), 16384) for b in (17, 20, 24, 28, 36, 44, 56, 64)}
    assert got == {17: 4, 20: 4, 24: 3, 28: 1, 36: 3, 44: 1, 56: 2, 64: 1}
    assert [_splits(dict(DECODE, batch=17), n) for n in (1024, 2048)] == [1, 4]  # 8 tiles: 4 splits would read 2 each


def test_split_rule_stays_a_small_host_expression():
    """The split count is a TIR expression of the call's sizes, and TileLang's lowering pays for
    its size at every use of the grid it sizes (sm_90a, this machine): one split past a wave, 20
    nodes, lowered in 8 s; the kept rule, 86 nodes, 13 s; a search over 1-4 splits at two fill
    thresholds, 152 nodes, 51 s, and with a wave cap, 315 nodes, 510 s."""
    import tilelang.language as T
    from tvm import tirx

    kind = kernels.get_kind(KIND)
    for params in (DECODE, dict(DECODE, paged=True)):
        p = dict(kernels.canonicalize(KIND, params, "sm_90a").params)
        nodes = []
        tirx.stmt_functor.post_order_visit(kind._num_splits(T, p, kind._shapes(T, p)), nodes.append)
        assert len(nodes) <= 100, (params, len(nodes))


def test_split_kernel_reads_its_split_count_from_the_grid():
    """The split count is computed once a call, on the host, as the split kernel's grid x; the
    kernel reads it back (gridDim.x) instead of carrying the rule into its device code, where it
    was inlined at each use (a wider rule there: 251 -> 336 us at batch 64, same splits, H200). The rule
    reads the cache's length (max_kv); the split kernel itself never needs it (TMA reads K and V)."""
    src = cuda_source(KIND, DECODE)
    split_kernel = src.split("__launch_bounds__")[1]  # its definition, up to the combine kernel's
    assert "int splits = grid_x();" in split_kernel
    assert not re.search(r"\bmax_kv\b", split_kernel.split("{", 1)[1])


@pytest.mark.parametrize(
    "params,tma",
    [
        (DECODE, True),  # split-KV decode: TMA pipeline, then the combine kernel
        (dict(DECODE, paged=True, page_size=64), False),  # every paged cache is gathered (KVAttention._gather)
        (dict(DECODE, paged=True), False),  # 16-key pages: gathered
        (dict(DECODE, load="cp_async", block_N=64), False),  # a contiguous cache by cp.async
        (dict(DECODE, q_len=None, heads=12, kv_heads=4, head_dim=64, dtype="bfloat16", block_H=64), True),
    ],
)
def test_cuda_lowering_for_sm90a(params, tma):
    src = cuda_source(KIND, params)
    assert ("tma_load" in src) == tma
    split = kernels.canonicalize(KIND, params, "sm_90a").params["num_splits"] > 1
    assert src.count("__global__ void") == (4 if split else 2)  # declaration and definition per kernel


# ----- GPU numerics (the H200 host; skipped without a GPU)

GPU_CASES = [
    (DECODE, dict(batch=7, max_kv=1111), None),
    (dict(DECODE, paged=True), dict(batch=7, max_kv=1111), None),
    (dict(DECODE, paged=True, page_size=64, dtype="bfloat16"), dict(batch=3, max_kv=2000), [1, 1999, 2000]),
    (dict(DECODE, q_len=None, num_splits=4), dict(batch=2, q_len=7, max_kv=1000), [3, 1000]),
    (dict(DECODE, q_len=None, heads=12, kv_heads=4, head_dim=64, dtype="bfloat16", paged=True, num_splits=3), dict(batch=3, q_len=6, max_kv=500), [6, 2, 500]),
    (dict(DECODE, heads=16, kv_heads=16, block_H=64), dict(batch=2, max_kv=3000), None),
    # Gathered tiles of part of a page (128-key pages, 64-key tiles) and of two pages with fewer threads.
    (dict(DECODE, paged=True, page_size=128, dtype="bfloat16"), dict(batch=3, max_kv=1000), [1, 999, 1000]),
    (dict(DECODE, paged=True, block_N=32, threads=64), dict(batch=5, max_kv=777), None),
    (dict(DECODE, load="cp_async", block_N=64), dict(batch=7, max_kv=1111), None),
    (dict(DECODE, paged=True, block_N=32, num_stages=3, dtype="bfloat16"), dict(batch=4, max_kv=1500), [1, 33, 1000, 1500]),
    # One warp a block, contiguous (TMA) and paged.
    (dict(DECODE, block_N=32, threads=32), dict(batch=2, max_kv=700), [1, 700]),
    (dict(DECODE, paged=True, block_N=32, threads=32), dict(batch=3, max_kv=500), None),
    # Past one wave: 136 head blocks in 4 splits (kv_splits.filling_splits); 264 in one, the combine one idle block.
    (DECODE, dict(batch=17, max_kv=2100), None),
    (DECODE, dict(batch=33, max_kv=600), None),
]


@needs_gpu
def test_gpu_matches_the_reference(make_daemon):
    import os

    c = make_daemon(workers=min(8, os.cpu_count() or 2)).client()
    built = c.prefetch([{"kind": KIND, "target": "auto", **params} for params, _, _ in GPU_CASES])  # compiled side by side
    for (params, runtime, lens), k in zip(GPU_CASES, built):
        assert not isinstance(k, Exception), k
        p = k.spec["params"]
        ins = make(p, lens, device="cuda", **runtime)
        want = reference.reference(KIND, p, ins)
        torch.testing.assert_close(k(*ins).float(), want.float(), **reference.tolerance(p["dtype"]), msg=lambda m, p=p: f"{p}: {m}")
