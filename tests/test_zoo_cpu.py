"""Numerics of every kernel kind on the CPU target ("c"), against torch references.

Only the `cpu_kernel` fixture builds kernels, so these tests keep working when it
is re-pointed at the daemon and client. Shapes are small (the file runs on a
2-core CI box) and deliberately ragged: not multiples of the default tiles.
"""

import math

import pytest
import torch
import torch.nn.functional as F

ACTS = {"none": lambda x: x, "gelu": F.gelu, "silu": F.silu, "relu": F.relu}


def close(out, ref, tol=1e-4):
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    assert err < tol, f"relative error {err:.2e}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- gemm -------------------------------------------------------------------


@pytest.mark.parametrize("M,N,K", [(32, 32, 32), (33, 47, 70), (1, 5, 3)])
def test_gemm_static_shapes(cpu_kernel, M, N, K):
    k = cpu_kernel("gemm", M=M, N=N, K=K, dtype="float32")
    a, b = torch.randn(M, K), torch.randn(K, N)
    close(k(a, b), a @ b)


def test_gemm_dynamic_m_two_sizes_one_kernel(cpu_kernel):
    k = cpu_kernel("gemm", M=None, N=40, K=24, dtype="float32", trans_b=True)
    b = torch.randn(40, 24)
    for M in (3, 77):  # below one tile and across three tiles
        a = torch.randn(M, 24)
        close(k(a, b), a @ b.T)


def test_gemm_dynamic_m_and_n_with_bias(cpu_kernel):
    k = cpu_kernel("gemm", M=None, N=None, K=24, dtype="float32", bias=True, act="relu")
    for M, N in ((3, 40), (77, 9)):  # N below one tile and past it
        a, b, bias = torch.randn(M, 24), torch.randn(24, N), torch.randn(N)
        close(k(a, b, bias), torch.relu(a @ b + bias))


@pytest.mark.parametrize("act", ["none", "gelu", "silu", "relu"])
def test_gemm_bias_act(cpu_kernel, act):
    k = cpu_kernel("gemm", M=None, N=36, K=20, dtype="float32", bias=True, act=act, trans_b=True)
    a, b, bias = torch.randn(50, 20), torch.randn(36, 20), torch.randn(36)
    close(k(a, b, bias), ACTS[act](a @ b.T + bias))


def test_gemm_act_without_bias_and_custom_tiles(cpu_kernel):
    k = cpu_kernel("gemm", M=19, N=23, K=17, dtype="float32", act="silu", block_M=8, block_N=16, block_K=4)
    a, b = torch.randn(19, 17), torch.randn(17, 23)
    close(k(a, b), F.silu(a @ b))


@pytest.mark.parametrize("bias", [False, True])
def test_gemm_residual_after_the_activation_and_in_place(cpu_kernel, bias):
    k = cpu_kernel("gemm", M=None, N=None, K=24, dtype="float32", bias=bias, act="gelu", residual=True)
    assert k.input_names == ["A", "B", "Bias", "R"] if bias else ["A", "B", "R"]
    for M, N in ((3, 40), (77, 9)):
        a, b, r = torch.randn(M, 24), torch.randn(24, N), torch.randn(M, N)
        extra = [torch.randn(N)] if bias else []
        want = F.gelu(a @ b + (extra[0] if bias else 0)) + r
        close(k(a, b, *extra, r), want)
        k(a, b, *extra, r, out=r)  # the residual update: r += gelu(a @ b + bias)
        close(r, want)


# --- attention --------------------------------------------------------------


def attention_ref(q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    q, k, v = (t.transpose(1, 2).double() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads,causal", [(2, 2, False), (4, 2, True), (4, 1, False)])
def test_attention(cpu_kernel, heads, kv_heads, causal):
    k = cpu_kernel("attention", batch=2, heads=heads, kv_heads=kv_heads, seq_len=37, head_dim=16, causal=causal, dtype="float32")
    q = torch.randn(2, 37, heads, 16)
    kk, v = torch.randn(2, 37, kv_heads, 16), torch.randn(2, 37, kv_heads, 16)
    close(k(q, kk, v), attention_ref(q, kk, v, causal))


def test_attention_dynamic_batch_and_seq(cpu_kernel):
    k = cpu_kernel("attention", batch=None, heads=4, kv_heads=2, seq_len=None, head_dim=8, causal=True, dtype="float32", block_M=8, block_N=4)
    for batch, seq in ((1, 5), (3, 21)):
        q = torch.randn(batch, seq, 4, 8)
        kk, v = torch.randn(batch, seq, 2, 8), torch.randn(batch, seq, 2, 8)
        close(k(q, kk, v), attention_ref(q, kk, v, True))


# --- row kernels ------------------------------------------------------------


@pytest.mark.parametrize("M,N", [(None, 64), (7, 100)])
def test_rmsnorm(cpu_kernel, M, N):
    k = cpu_kernel("rmsnorm", M=M, N=N, eps=1e-5, dtype="float32")
    w = torch.randn(N)
    for rows in (3, 40) if M is None else (M,):
        x = torch.randn(rows, N) * 3
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        close(k(x, w), ref)


@pytest.mark.parametrize("M,N", [(None, 96), (5, 33)])
def test_swiglu(cpu_kernel, M, N):
    k = cpu_kernel("swiglu", M=M, N=N, dtype="float32")
    for rows in (2, 31) if M is None else (M,):
        g, u = torch.randn(rows, N), torch.randn(rows, N)
        close(k(g, u), F.silu(g) * u)


@pytest.mark.parametrize("M,N", [(None, 128), (6, 45)])
def test_softmax(cpu_kernel, M, N):
    k = cpu_kernel("softmax", M=M, N=N, dtype="float32")
    for rows in (1, 50) if M is None else (M,):
        x = torch.randn(rows, N) * 10 + 80  # large logits: only a max-subtracted softmax stays finite
        close(k(x), torch.softmax(x.double(), -1))
