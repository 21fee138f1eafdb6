"""The fused kinds agents used to write by hand: add_rmsnorm, layernorm, rope (issue #18), geglu, and
the packed forms of rope, swiglu and geglu that take a fused QKV or gate/up GEMM's output.

CPU numerics through the session daemon (float32, ragged sizes, in-place use through
`out=`); validation; CUDA lowering for sm_90a on this machine (and a full nvcc build
where nvcc is installed); on a GPU, correctness at ragged sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import InvalidSpec
from kernels.rope import cache_rows_reference, cos_sin_cache, rope_reference, split_qkv
from tests.lowering import cuda_source
from tests.marks import needs_gpu, needs_nvcc, needs_nvrtc


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def close(out, ref, tol=1e-5):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    assert err < tol, f"relative error {err:.2e}"


def rmsnorm(h, w, eps):
    return h * torch.rsqrt(h.double().pow(2).mean(-1, keepdim=True) + eps).to(h.dtype) * w


# ----- add_rmsnorm


@pytest.mark.parametrize("M,N", [(None, 33), (7, 100)])
def test_add_rmsnorm(cpu_kernel, M, N):
    k = cpu_kernel("add_rmsnorm", M=M, N=N, eps=1e-5, dtype="float32")
    assert (k.input_names, k.output_names) == (["X", "R", "W"], ["Y", "Rout"])
    w = torch.randn(N)
    for rows in (1, 3, 37) if M is None else (M,):
        x, r = torch.randn(rows, N) * 3, torch.randn(rows, N)
        y, r_out = k(x, r, w)
        close(r_out, x + r)
        close(y, rmsnorm(x + r, w, 1e-5))


def test_add_rmsnorm_updates_the_residual_stream_in_place(cpu_kernel):
    k = cpu_kernel("add_rmsnorm", M=None, N=48, dtype="float32")
    x, r, w = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)
    want_r = x + r
    want_y = rmsnorm(want_r, w, 1e-6)
    y = torch.empty_like(x)
    assert k(x, r, w, out=(y, r))[1] is r  # the residual update: r += x, y = rmsnorm(r)
    close(r, want_r)
    close(y, want_y)
    x2, r2 = x.clone(), r.clone()
    k(x2, r2, w, out=(x2, r2))  # both in place: y over x as well
    close(r2, want_r + x)
    close(x2, rmsnorm(want_r + x, w, 1e-6))
    with pytest.raises(ValueError, match="only R may be"):
        k(x, r, w, out=(y, x))


# ----- layernorm


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_layernorm(cpu_kernel, bias, residual):
    N = 45
    k = cpu_kernel("layernorm", M=None, N=N, dtype="float32", bias=bias, residual=residual)
    assert k.input_names == ["X"] + ["R"] * residual + ["W"] + ["B"] * bias
    assert k.output_names == ["Y"] + ["Rout"] * residual
    w, b = torch.randn(N), torch.randn(N)
    for rows in (1, 37):
        x, r = torch.randn(rows, N) * 2 + 1, torch.randn(rows, N)
        ins = [x] + [r] * residual + [w] + [b] * bias
        h = x + r if residual else x
        want = F.layer_norm(h.double(), (N,), w.double(), b.double() if bias else None, 1e-5).float()
        out = k(*ins)
        if residual:
            close(out[1], h)
            out = out[0]
        close(out, want)


def test_layernorm_static_rows_and_in_place_residual(cpu_kernel):
    k = cpu_kernel("layernorm", M=6, N=20, eps=1e-3, dtype="float32", bias=True, residual=True)
    x, r, w, b = torch.randn(6, 20), torch.randn(6, 20), torch.randn(20), torch.randn(20)
    h = x + r
    k(x, r, w, b, out=(x, r))
    close(r, h)
    close(x, F.layer_norm(h, (20,), w, b, 1e-3))


def test_layernorm_torch_op_returns_one_or_two_outputs(cpu_kernel):
    """layernorm's op returns a list (its output count depends on `residual`); a Kernel still
    returns a tensor for one output and a tuple for two, traced or not."""
    plain = cpu_kernel("layernorm", M=None, N=16, dtype="float32")
    fused = cpu_kernel("layernorm", M=None, N=16, dtype="float32", residual=True)
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    listed = torch.ops.kernel_service.layernorm(plain.spec_json, [x, w])
    assert isinstance(listed, list) and len(listed) == 1
    torch.testing.assert_close(listed[0], plain(x, w))
    fn = torch.compile(lambda x, r, w: (plain(x, w), fused(x, r, w)), fullgraph=True, dynamic=False)
    y, (y2, h) = fn(x, r, w)
    torch.testing.assert_close(y, F.layer_norm(x, (16,), w))
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y2, F.layer_norm(x + r, (16,), w))


# ----- rope

ROPE = dict(heads=3, kv_heads=2, head_dim=20, dtype="float32")


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [None, 12])
def test_rope(cpu_kernel, style, rotary_dim):
    k = cpu_kernel("rope", tokens=None, style=style, rotary_dim=rotary_dim, **ROPE)
    assert (k.input_names, k.output_names) == (["positions", "Q", "K", "cos_sin_cache"], ["Qout", "Kout"])
    rot = rotary_dim or 20
    cache = cos_sin_cache(50, rot)
    for tokens in (1, 37):
        pos = torch.randint(0, 50, (tokens,), dtype=torch.int64)
        q, kk = torch.randn(tokens, 3, 20), torch.randn(tokens, 2, 20)
        got_q, got_k = k(pos, q, kk, cache)
        want_q, want_k = rope_reference(pos, q, kk, cache, style)
        close(got_q, want_q)
        close(got_k, want_k)
        if rot < 20:  # partial rotary: the tail of each head is untouched
            assert torch.equal(got_q[..., rot:], q[..., rot:])


def test_rope_matches_the_textbook_rotation():
    """The reference itself: neox rotates halves, gptj interleaved pairs, by angle pos * base^(-2i/d)."""
    pos = torch.tensor([0, 1, 5])
    q = torch.randn(3, 1, 8)
    cache = cos_sin_cache(8, 8)
    angles = pos[:, None, None].double() * 10000.0 ** (-torch.arange(0, 8, 2).double() / 8)
    as_complex = torch.polar(torch.ones_like(angles), angles)
    neox = torch.view_as_complex(torch.stack(q.double().chunk(2, -1), -1).contiguous()) * as_complex
    close(rope_reference(pos, q, q, cache, "neox")[0], torch.cat([neox.real, neox.imag], -1).float())
    gptj = torch.view_as_complex(q.double().reshape(3, 1, 4, 2).contiguous()) * as_complex
    close(rope_reference(pos, q, q, cache, "gptj")[0], torch.view_as_real(gptj).flatten(-2).float())


def test_rope_in_place_with_a_static_cache(cpu_kernel):
    k = cpu_kernel("rope", tokens=5, max_position=16, style="gptj", **ROPE)
    cache = cos_sin_cache(16, 20)
    pos = torch.tensor([15, 0, 3, 3, 9])
    q, kk = torch.randn(5, 3, 20), torch.randn(5, 2, 20)
    want_q, want_k = rope_reference(pos, q, kk, cache, "gptj")
    assert k(pos, q, kk, cache, out=(q, kk))[0] is q  # vLLM's rotary_embedding is in place too
    close(q, want_q)
    close(kk, want_k)
    with pytest.raises(ValueError, match="cos_sin_cache must have shape"):
        k(pos, q, kk, cos_sin_cache(17, 20))
    with pytest.raises(TypeError, match="positions must be int64"):
        k(pos.int(), q, kk, cache)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [None, 12])
@pytest.mark.parametrize("tokens", [None, 5])
def test_rope_packed(cpu_kernel, style, rotary_dim, tokens):
    """One QKV row per token (Q, K, then V heads) in; new contiguous Q' and K' out, QKV untouched."""
    k = cpu_kernel("rope", tokens=tokens, style=style, rotary_dim=rotary_dim, packed=True, **ROPE)
    assert (k.input_names, k.output_names) == (["positions", "QKV", "cos_sin_cache"], ["Qout", "Kout"])
    assert k.inplace == {}  # the outputs are not shaped like QKV
    cache = cos_sin_cache(50, rotary_dim or 20)
    for rows in (1, 37) if tokens is None else (tokens,):
        pos = torch.randint(0, 50, (rows,), dtype=torch.int64)
        qkv = torch.randn(rows, 3 + 2 * 2, 20)
        before = qkv.clone()
        got_q, got_k = k(pos, qkv, cache)
        q, kk, _ = split_qkv(qkv, 3, 2)
        want_q, want_k = rope_reference(pos, q, kk, cache, style)
        assert got_q.is_contiguous() and got_k.is_contiguous()
        close(got_q, want_q)
        close(got_k, want_k)
        assert torch.equal(qkv, before)  # V (and Q, K) left as they were


@pytest.mark.parametrize("v_out", [False, True])
@pytest.mark.parametrize("tokens", [None, 5])
def test_rope_writes_k_and_v_into_the_cache(cpu_kernel, tokens, v_out):
    """write_cache: K' and V land at rows slots[t] of the caches, in place; other rows, and rows a
    slot outside the cache (-1, or past the end) would name, are untouched; Q' and K' as before,
    and with v_out V too, the last output."""
    k = cpu_kernel("rope", tokens=tokens, packed=True, write_cache=True, v_out=v_out, **ROPE)
    outputs = ["Qout", "Kout", "Vout"] if v_out else ["Qout", "Kout"]
    assert (k.input_names, k.output_names) == (["positions", "QKV", "cos_sin_cache", "slots", "K_cache", "V_cache"], outputs)
    assert k.writes == ["K_cache", "V_cache"] and "Updates in place: K_cache, V_cache" in k.__doc__
    cache = cos_sin_cache(50, 20)
    for rows in (1, 37) if tokens is None else (tokens,):
        pos = torch.randint(0, 50, (rows,), dtype=torch.int64)
        qkv = torch.randn(rows, 3 + 2 * 2, 20)
        num_slots = 2 * rows + 1
        slots = torch.randperm(num_slots)[:rows]
        if rows > 2:
            slots[0], slots[1] = -1, num_slots  # padding, and one past the end: neither is written
        k_cache, v_cache = torch.randn(num_slots, 2, 20), torch.randn(num_slots, 2, 20)
        q, kk, v = split_qkv(qkv, 3, 2)
        want_q, want_k = rope_reference(pos, q, kk, cache, "neox")
        k_before, v_before = k_cache.clone(), v_cache.clone()
        got_q, got_k, *got_v = k(pos, qkv, cache, slots, k_cache, v_cache)
        close(got_q, want_q)
        close(got_k, want_k)
        assert [g.shape for g in got_v] == ([v.shape] if v_out else []) and all(torch.equal(g, v) for g in got_v)
        want_kc, want_vc = cache_rows_reference(got_k, v, slots, k_before, v_before)  # the rows are K' itself, and V
        assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)


def test_rope_write_cache_inputs_and_reference_follow_the_convention(cpu_kernel):
    """kernels.reference's inputs for a write_cache spec call the kernel as is (a padding slot
    included), and its reference is the kernel's (Q', K')."""
    from kernels.reference import make_inputs, reference

    k = cpu_kernel("rope", tokens=None, packed=True, write_cache=True, **ROPE)
    p = k.spec["params"]
    ins = make_inputs("rope", p)
    assert ins[3].dtype == torch.int64 and (ins[3] == -1).sum() == 1
    k_before, v_before = ins[4].clone(), ins[5].clone()
    got_q, got_k = k(*ins)
    want_q, want_k = reference("rope", p, ins)
    close(got_q, want_q)
    close(got_k, want_k)
    want_kc, want_vc = cache_rows_reference(got_k, split_qkv(ins[1], 3, 2)[2], ins[3], k_before, v_before)
    assert torch.equal(ins[4], want_kc) and torch.equal(ins[5], want_vc)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [None, 12])
@pytest.mark.parametrize("tokens", [None, 5])
def test_rope_v_out(cpu_kernel, style, rotary_dim, tokens):
    """v_out: V's heads copied, unchanged, into a third new contiguous output in the same launch."""
    k = cpu_kernel("rope", tokens=tokens, style=style, rotary_dim=rotary_dim, packed=True, v_out=True, **ROPE)
    assert (k.input_names, k.output_names) == (["positions", "QKV", "cos_sin_cache"], ["Qout", "Kout", "Vout"])
    assert k.inplace == {} and k.writes == []
    cache = cos_sin_cache(50, rotary_dim or 20)
    for rows in (1, 37) if tokens is None else (tokens,):
        pos = torch.randint(0, 50, (rows,), dtype=torch.int64)
        qkv = torch.randn(rows, 3 + 2 * 2, 20)
        before = qkv.clone()
        got_q, got_k, got_v = k(pos, qkv, cache)
        q, kk, v = split_qkv(qkv, 3, 2)
        want_q, want_k = rope_reference(pos, q, kk, cache, style)
        close(got_q, want_q)
        close(got_k, want_k)
        assert got_v.is_contiguous() and got_v.shape == (rows, 2, 20) and torch.equal(got_v, v)
        assert torch.equal(qkv, before)


@pytest.mark.parametrize("write_cache", [False, True])
def test_rope_v_out_reference_follows_the_convention(cpu_kernel, write_cache):
    """kernels.reference's inputs call a v_out spec as is, and its reference is (Q', K', V)."""
    from kernels.reference import make_inputs, reference

    k = cpu_kernel("rope", tokens=None, packed=True, write_cache=write_cache, v_out=True, **ROPE)
    p = k.spec["params"]
    ins = make_inputs("rope", p)
    got, want = k(*ins), reference("rope", p, ins)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        close(g, w)
    assert torch.equal(got[2], split_qkv(ins[1], 3, 2)[2])


def test_rope_refuses_a_cache_that_overlaps_another_input(cpu_kernel):
    k = cpu_kernel("rope", tokens=None, packed=True, write_cache=True, **ROPE)
    pos, qkv, cache, slots = torch.zeros(2, dtype=torch.int64), torch.randn(2, 7, 20), cos_sin_cache(50, 20), torch.tensor([0, 1])
    kv = torch.zeros(3, 2, 20)
    with pytest.raises(ValueError, match="input K_cache, which the kernel updates, overlaps input V_cache"):
        k(pos, qkv, cache, slots, kv, kv)
    with pytest.raises(ValueError, match="input V_cache, which the kernel updates, overlaps input QKV"):
        k(pos, qkv, cache, slots, kv, qkv.view(-1, 2, 20)[:3])


def test_rope_cache_writes_stay_out_of_traced_graphs(cpu_kernel):
    """Its torch op cannot declare the in-place cache update, so a traced call is refused, not run."""
    k = cpu_kernel("rope", tokens=None, packed=True, write_cache=True, **ROPE)
    args = (torch.zeros(2, dtype=torch.int64), torch.randn(2, 7, 20), cos_sin_cache(50, 20), torch.tensor([0, 1]), torch.zeros(3, 2, 20), torch.zeros(3, 2, 20))
    with pytest.raises(RuntimeError, match="updates its inputs K_cache, V_cache in place"):
        torch.compile(lambda *a: k(*a), fullgraph=True, backend="eager")(*args)


# ----- swiglu, packed: X[M, 2N] = [gate | up], vLLM's silu_and_mul layout


@pytest.mark.parametrize("M,N", [(None, 100), (7, 64), (5, 33)])
def test_swiglu_packed(cpu_kernel, M, N):
    k = cpu_kernel("swiglu", M=M, N=N, dtype="float32", packed=True)
    assert (k.input_names, k.output_names) == (["X"], ["Y"])
    assert k.inplace == {}  # Y is half X's size
    for rows in (1, 3, 37) if M is None else (M,):
        x = torch.randn(rows, 2 * N) * 3
        gate, up = x[:, :N], x[:, N:]
        close(k(x), F.silu(gate) * up)


# ----- geglu: gelu(gate) * up, torch's exact (erf) or tanh form (ModernBERT's MLP, issue 29)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("M,N,packed", [(None, 100, True), (7, 64, False), (None, 33, False)])
def test_geglu(cpu_kernel, M, N, packed, approximate):
    k = cpu_kernel("geglu", M=M, N=N, dtype="float32", packed=packed, approximate=approximate)
    for rows in (1, 3, 37) if M is None else (M,):
        x = torch.randn(rows, 2 * N) * 3
        gate, up = x[:, :N], x[:, N:]
        want = F.gelu(gate, approximate=approximate) * up
        close(k(x) if packed else k(gate.contiguous(), up.contiguous()), want)
        # the two forms differ by more than the tolerance: each kernel computes the one it names
        other = F.gelu(gate, approximate="tanh" if approximate == "none" else "none") * up
        assert (other - want).abs().max() > 1e-4


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize(
    "params,tiles",
    [
        ({"N": 14336}, (8, 1024)),  # Llama-3-8B: whole 1024-column tiles
        ({"N": 1152}, (64, 128)),  # ModernBERT-base: 128 divides it, 1024 does not
        ({"N": 11008}, (32, 256)),
        ({"N": 1000}, (8, 1024)),  # no power of two from 128 up divides it
        ({"N": 1152, "block_M": 16}, (16, 128)),  # a tile given is kept
        ({"N": 1152, "block_N": 1024}, (8, 1024)),
    ],
)
def test_cuda_tiles_divide_the_row(kind, params, tiles):
    """On CUDA the default column tile is the largest power of two from 1024 down to 128 that
    divides N, with 8192 elements per block (32 per thread); the CPU keeps its own tiles."""
    spec = kernels.canonicalize(kind, {"M": None, "dtype": "float16", **params}, "sm_90a")
    assert (spec.params["block_M"], spec.params["block_N"]) == tiles
    cpu = kernels.canonicalize(kind, {"M": None, "dtype": "float32", "N": params["N"]}, "c")
    assert (cpu.params["block_M"], cpu.params["block_N"]) == (4, 64)


# ----- validation


@pytest.mark.parametrize(
    "kind,params,target,field,words",
    [
        ("add_rmsnorm", {"M": 8, "N": 32768, "dtype": "float16"}, "sm_90a", "N", "not supported"),
        ("add_rmsnorm", {"M": 8, "N": 100, "dtype": "bfloat16"}, "sm_90a", "N", "multiple of 8"),
        ("add_rmsnorm", {"M": 8, "N": 64, "dtype": "float16"}, "c", "dtype", "float32"),
        ("add_rmsnorm", {"M": 8, "N": 64, "dtype": "float32", "threads": 128}, "c", "threads", "CUDA"),
        ("layernorm", {"M": None, "N": 64, "dtype": "float32", "bias": 1}, "c", "bias", "true or false"),
        ("layernorm", {"M": None, "N": 60, "dtype": "float16", "residual": True}, "sm_90a", "N", "multiple of 8"),
        ("layernorm", {"M": None, "N": 64, "dtype": "float16", "eps": -1}, "sm_90a", "eps", "at least"),
        ("rope", {**ROPE, "tokens": None, "rotary_dim": 21}, "c", "rotary_dim", "even"),
        ("rope", {**ROPE, "tokens": None, "rotary_dim": 24}, "c", "rotary_dim", "at most head_dim"),
        ("rope", {**ROPE, "tokens": None, "style": "llama"}, "c", "style", "not one of"),
        ("rope", {**ROPE, "tokens": None, "threads": 64}, "c", "threads", "CUDA"),
        ("rope", {**ROPE, "tokens": None, "dtype": "float16"}, "sm_90a", "head_dim", "multiple of 8"),
        ("rope", {**ROPE, "tokens": None, "head_dim": 128, "rotary_dim": 100, "dtype": "float16"}, "sm_90a", "rotary_dim", "multiple of 8"),
        ("rope", {**ROPE, "tokens": None, "heads": 512, "head_dim": 256, "dtype": "float16"}, "sm_90a", "heads", "shared memory"),
        ("rope", {**ROPE, "tokens": None, "head_dim": 128, "threads": 48, "dtype": "float16"}, "sm_90a", "threads", "power of two"),
        ("rope", {**ROPE, "tokens": None, "packed": "yes"}, "c", "packed", "true or false"),
        ("rope", {**ROPE, "tokens": None, "packed": True, "dtype": "float16"}, "sm_90a", "head_dim", "multiple of 8"),
        ("swiglu", {"M": None, "N": 64, "dtype": "float32", "packed": 1}, "c", "packed", "true or false"),
        ("swiglu", {"M": None, "N": 60, "dtype": "float16", "packed": True}, "sm_90a", "N", "multiple of 8"),
        ("geglu", {"M": None, "N": 64, "dtype": "float32", "approximate": "erf"}, "c", "approximate", "not one of"),
        ("geglu", {"M": None, "N": 60, "dtype": "float16", "packed": True}, "sm_90a", "N", "multiple of 8"),
        ("rope", {**ROPE, "tokens": None, "write_cache": True}, "c", "write_cache", "packed=True"),
        ("rope", {**ROPE, "tokens": None, "v_out": True}, "c", "v_out", "packed=True"),
        ("rope", {**ROPE, "tokens": None, "packed": True, "v_out": "yes"}, "c", "v_out", "true or false"),
        # V's staging counts: a token that fits packed does not with v_out.
        (
            "rope",
            {"tokens": None, "heads": 217, "kv_heads": 2, "head_dim": 256, "dtype": "float16", "packed": True, "v_out": True},
            "sm_90a",
            "heads",
            "shared memory",
        ),
    ],
)
def test_rejected(kind, params, target, field, words):
    with pytest.raises(InvalidSpec) as info:
        kernels.canonicalize(kind, params, target)
    assert info.value.field == field and words in str(info.value), str(info.value)


def test_rope_rotary_dim_defaults_to_head_dim_in_the_key():
    implicit = kernels.canonicalize("rope", {**ROPE, "tokens": None}, "c")
    assert implicit.params["rotary_dim"] == 20 and implicit.params["style"] == "neox" and implicit.params["max_position"] is None
    assert implicit.to_json() == kernels.canonicalize("rope", {**ROPE, "tokens": None, "rotary_dim": 20}, "c").to_json()


@pytest.mark.parametrize("kind,params", [("rope", {**ROPE, "tokens": None}), ("swiglu", {"M": None, "N": 64, "dtype": "float32"})])
def test_packed_is_off_unless_asked(kind, params):
    """A spec that does not name `packed` is the unpacked kernel it always was, under one key."""
    implicit = kernels.canonicalize(kind, params, "c")
    assert implicit.params["packed"] is False
    assert implicit.to_json() == kernels.canonicalize(kind, {**params, "packed": False}, "c").to_json()
    assert implicit.to_json() != kernels.canonicalize(kind, {**params, "packed": True}, "c").to_json()


# ----- CUDA: lowering on this machine, a full build where nvcc is installed

LLAMA = dict(heads=32, kv_heads=8, head_dim=128)
CUDA_SPECS = [
    ("add_rmsnorm", {"M": None, "N": 4096, "eps": 1e-5, "dtype": "float16"}),
    ("add_rmsnorm", {"M": 64, "N": 1000, "dtype": "bfloat16"}),
    ("layernorm", {"M": None, "N": 4096, "dtype": "float16"}),
    ("layernorm", {"M": None, "N": 1000, "dtype": "bfloat16", "bias": True, "residual": True}),
    ("rope", {"tokens": None, **LLAMA, "dtype": "float16"}),
    ("rope", {"tokens": None, **LLAMA, "rotary_dim": 64, "style": "gptj", "max_position": 4096, "dtype": "bfloat16"}),
    ("rope", {"tokens": 3, "heads": 5, "kv_heads": 1, "head_dim": 72, "rotary_dim": 40, "dtype": "float16"}),
    ("layernorm", {"M": None, "N": 16384, "dtype": "bfloat16", "bias": True, "residual": True}),
    ("rope", {"tokens": None, **LLAMA, "dtype": "bfloat16", "packed": True}),
    ("rope", {"tokens": None, "heads": 5, "kv_heads": 1, "head_dim": 72, "rotary_dim": 40, "style": "gptj", "dtype": "float16", "packed": True}),
    ("rope", {"tokens": None, **LLAMA, "dtype": "bfloat16", "packed": True, "write_cache": True}),
    ("rope", {"tokens": None, "heads": 12, "kv_heads": 12, "head_dim": 64, "dtype": "float16", "packed": True, "v_out": True}),
    ("rope", {"tokens": None, **LLAMA, "dtype": "bfloat16", "packed": True, "write_cache": True, "v_out": True}),
    ("swiglu", {"M": None, "N": 14336, "dtype": "bfloat16", "packed": True}),
    ("swiglu", {"M": None, "N": 1000, "dtype": "float16", "packed": True}),
    ("geglu", {"M": None, "N": 1152, "dtype": "bfloat16", "packed": True}),
    ("geglu", {"M": None, "N": 1000, "dtype": "float16", "approximate": "tanh"}),
]


@pytest.mark.parametrize("kind,params", CUDA_SPECS, ids=lambda v: v if isinstance(v, str) else None)
def test_cuda_forms_lower_for_sm_90a(kind, params):
    src = cuda_source(kind, params)
    assert "__global__" in src
    if params.get("N", 0) % 1024 == 0 and params.get("heads", 0) % 8 == 0:
        # One pass over memory: rows (and a token's heads) move in 16-byte vectors.
        assert "uint4" in src, "expected 16-byte vector loads"


@pytest.mark.parametrize("compiler", [pytest.param("nvcc", marks=needs_nvcc), pytest.param("nvrtc", marks=needs_nvrtc)])
def test_cuda_forms_build(make_daemon, compiler):
    c = make_daemon("--cuda-compiler", compiler).client()
    # Every other spec, and every packed one (an ABI of its own).
    built = CUDA_SPECS[::2] + [(kind, params) for kind, params in CUDA_SPECS[1::2] if params.get("packed")]
    specs = [{"kind": kind, "target": "sm_90a", **params} for kind, params in built]
    assert c.prefetch(specs, load=False) == ["compiled"] * len(specs)
    for s in specs:
        k = c.get_kernel(s["kind"], target="sm_90a", **{n: v for n, v in s.items() if n not in ("kind", "target")})
        assert k.abi["loader"] == "tvm_ffi"
        assert bool(k.abi.get("inplace")) != bool(s.get("packed"))  # packed forms write new tensors


# ----- GPU correctness at ragged sizes


def _assert_close(got, want, dtype):
    from kernels.reference import tolerance

    torch.testing.assert_close(got.float(), want.float(), **tolerance(dtype))


@pytest.fixture(scope="module")
def gpu_client(tmp_path_factory):
    from devtools.launch import DaemonProcess

    base = tmp_path_factory.mktemp("fused-gpu")
    d = DaemonProcess(base / "cache", "--target", "sm_90a", workers=2, log_path=base / "daemon.log").start(timeout=300)
    yield d.client()
    d.stop()


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("N", [4096, 1000])
def test_gpu_add_rmsnorm(gpu_client, dtype, N):
    k = gpu_client.get_kernel("add_rmsnorm", M=None, N=N, eps=1e-5, dtype=dtype, target="sm_90a")
    t = getattr(torch, dtype)
    w = torch.randn(N, device="cuda", dtype=t)
    for rows in (1, 7, 64, 333, 2048):
        x, r = torch.randn(rows, N, device="cuda", dtype=t), torch.randn(rows, N, device="cuda", dtype=t)
        y, r_out = k(x, r, w)
        assert torch.equal(r_out, x + r)  # fp32 sum, rounded once: what torch's 16-bit add gives
        h = (x + r).float()
        _assert_close(y, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float(), dtype)
        want = y.clone()
        k(x, r, w, out=(x, r))  # in place over both
        assert torch.equal(x, want) and torch.equal(r, r_out)


@needs_gpu
@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (False, True), (True, True)])
def test_gpu_layernorm(gpu_client, bias, residual):
    from kernels.reference import make_inputs, reference

    for N, dtype in ((4096, "float16"), (1000, "bfloat16")):
        k = gpu_client.get_kernel("layernorm", M=None, N=N, dtype=dtype, bias=bias, residual=residual, target="sm_90a")
        for rows in (1, 37, 2048):
            ins = make_inputs("layernorm", k.spec["params"], "cuda", runtime={"M": rows})
            got, want = k(*ins), reference("layernorm", k.spec["params"], ins)
            for g, w in zip(got if residual else (got,), want if residual else (want,)):
                _assert_close(g, w, dtype)


@needs_gpu
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("packed,v_out", [(False, False), (True, False), (True, True)])
def test_gpu_rope(gpu_client, style, rotary_dim, dtype, packed, v_out):
    k = gpu_client.get_kernel("rope", tokens=None, **LLAMA, rotary_dim=rotary_dim, style=style, dtype=dtype, packed=packed, v_out=v_out, target="sm_90a")
    t = getattr(torch, dtype)
    cache = cos_sin_cache(8192, rotary_dim, base=500000.0, device="cuda").to(t)
    for tokens in (1, 7, 64, 1000, 4096):
        pos = torch.randint(0, 8192, (tokens,), device="cuda", dtype=torch.int64)
        qkv = torch.randn(tokens, 32 + 2 * 8, 128, device="cuda", dtype=t)
        q, kk, v = split_qkv(qkv, 32, 8)
        want_q, want_k = rope_reference(pos, q, kk, cache, style)
        if packed:
            before = qkv.clone()
            got_q, got_k, *got_v = k(pos, qkv, cache)
            assert torch.equal(qkv, before)  # V (and Q, K) left as they were
            if v_out:
                assert got_v[0].is_contiguous() and torch.equal(got_v[0], v)
        else:
            q, kk = q.contiguous(), kk.contiguous()
            got_q, got_k = k(pos, q, kk, cache)
        _assert_close(got_q, want_q, dtype)
        _assert_close(got_k, want_k, dtype)
        if not packed:
            k(pos, q, kk, cache, out=(q, kk))
            assert torch.equal(q, got_q) and torch.equal(kk, got_k)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("v_out", [False, True])
def test_gpu_rope_packed_ragged_heads(gpu_client, dtype, v_out):
    """Head counts and a head_dim that fill no vector or tile evenly; gptj with partial rotary."""
    heads, kv_heads, d, rot = 5, 1, 72, 40
    k = gpu_client.get_kernel(
        "rope", tokens=None, heads=heads, kv_heads=kv_heads, head_dim=d, rotary_dim=rot, style="gptj", dtype=dtype, packed=True, v_out=v_out, target="sm_90a"
    )
    t = getattr(torch, dtype)
    cache = cos_sin_cache(1000, rot, device="cuda").to(t)
    for tokens in (1, 33, 777):
        pos = torch.randint(0, 1000, (tokens,), device="cuda", dtype=torch.int64)
        qkv = torch.randn(tokens, heads + 2 * kv_heads, d, device="cuda", dtype=t)
        q, kk, v = split_qkv(qkv, heads, kv_heads)
        want_q, want_k = rope_reference(pos, q, kk, cache, "gptj")
        got_q, got_k, *got_v = k(pos, qkv, cache)
        _assert_close(got_q, want_q, dtype)
        _assert_close(got_k, want_k, dtype)
        if v_out:
            assert torch.equal(got_v[0], v)


@needs_gpu
@pytest.mark.parametrize("heads,kv_heads,d,rot", [(32, 8, 128, 128), (5, 1, 72, 40)])
@pytest.mark.parametrize("v_out", [False, True])
def test_gpu_rope_writes_the_cache(gpu_client, heads, kv_heads, d, rot, v_out):
    """write_cache at Llama sizes and ragged ones: cache rows at shuffled slots, padding skipped
    (and with v_out, V into Vout too)."""
    k = gpu_client.get_kernel(
        "rope",
        tokens=None,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=d,
        rotary_dim=rot,
        dtype="bfloat16",
        packed=True,
        write_cache=True,
        v_out=v_out,
        target="sm_90a",
    )
    cache = cos_sin_cache(5000, rot, device="cuda").to(torch.bfloat16)
    for tokens in (1, 8, 777):
        pos = torch.randint(0, 5000, (tokens,), device="cuda", dtype=torch.int64)
        qkv = torch.randn(tokens, heads + 2 * kv_heads, d, device="cuda", dtype=torch.bfloat16)
        num_slots = 3 * tokens + 5
        slots = torch.randperm(num_slots, device="cuda")[:tokens]
        slots[-1] = -1
        k_cache = torch.randn(num_slots, kv_heads, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        q, kk, v = split_qkv(qkv, heads, kv_heads)
        want_q, want_k = rope_reference(pos, q, kk, cache, "neox")
        k_before, v_before = k_cache.clone(), v_cache.clone()
        got_q, got_k, *got_v = k(pos, qkv, cache, slots, k_cache, v_cache)
        _assert_close(got_q, want_q, "bfloat16")
        _assert_close(got_k, want_k, "bfloat16")
        if v_out:
            assert torch.equal(got_v[0], v)
        want_kc, want_vc = cache_rows_reference(got_k, v, slots, k_before, v_before)
        assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)
    # The caches it updates may not alias another input, on the plain CUDA call as everywhere.
    with pytest.raises(ValueError, match="which the kernel updates, overlaps input"):
        k(pos, qkv, cache, slots, k_cache, k_cache)


@needs_gpu
def test_gpu_static_sized_cache_updates_refuse_an_aliased_cache(gpu_client):
    """With static sizes the plain CUDA call knows each tensor's bytes from the ABI; an updated
    cache that aliases another input, whole or in part, is still refused."""
    k = gpu_client.get_kernel(
        "rope", tokens=8, heads=4, kv_heads=2, head_dim=64, rotary_dim=64, dtype="bfloat16", packed=True, write_cache=True, target="sm_90a"
    )
    pos = torch.arange(8, device="cuda")
    qkv = torch.randn(8, 8, 64, device="cuda", dtype=torch.bfloat16)
    cache = cos_sin_cache(64, 64, device="cuda").to(torch.bfloat16)
    slots = torch.arange(8, device="cuda")
    k_cache = torch.zeros(8, 2, 64, device="cuda", dtype=torch.bfloat16)
    k(pos, qkv, cache, slots, k_cache, torch.zeros_like(k_cache))  # apart: runs
    both = torch.zeros(16, 2, 64, device="cuda", dtype=torch.bfloat16)
    for k_c, v_c in ((k_cache, k_cache), (both[:8], both[4:12])):
        with pytest.raises(ValueError, match="which the kernel updates, overlaps input"):
            k(pos, qkv, cache, slots, k_c, v_c)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("N", [14336, 1000])
def test_gpu_swiglu_packed(gpu_client, dtype, N):
    k = gpu_client.get_kernel("swiglu", M=None, N=N, dtype=dtype, packed=True, target="sm_90a")
    t = getattr(torch, dtype)
    for rows in (1, 7, 333, 2048):
        x = torch.randn(rows, 2 * N, device="cuda", dtype=t)
        gate, up = x[:, :N].float(), x[:, N:].float()
        _assert_close(k(x), F.silu(gate) * up, dtype)


@needs_gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_geglu_packed(gpu_client, dtype, approximate):
    N = 1152  # ModernBERT-base's intermediate size
    k = gpu_client.get_kernel("geglu", M=None, N=N, dtype=dtype, packed=True, approximate=approximate, target="sm_90a")
    t = getattr(torch, dtype)
    for rows in (1, 7, 333, 2048):
        x = torch.randn(rows, 2 * N, device="cuda", dtype=t)
        gate, up = x[:, :N].float(), x[:, N:].float()
        _assert_close(k(x), F.gelu(gate, approximate=approximate) * up, dtype)


def test_rope_position_outside_the_cache_reads_zeros_not_memory(cpu_kernel):
    k = cpu_kernel("rope", tokens=None, **ROPE)
    cache = cos_sin_cache(8, 20)
    pos = torch.tensor([2, 8, -1, 1 << 40])
    q, kk = torch.randn(4, 3, 20), torch.randn(4, 2, 20)
    got_q, got_k = k(pos, q, kk, cache)
    close(got_q[0], rope_reference(pos[:1], q[:1], kk[:1], cache, "neox")[0][0])
    assert not got_q[1:].any() and not got_k[1:].any()
