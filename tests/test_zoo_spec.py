"""Validation of kernel signatures: every bad request is an InvalidSpec naming its
field, raised by canonicalize before any TileLang work (nothing here compiles)."""

import pytest

import kernels
from kernels import InvalidSpec

GEMM = dict(M=64, N=64, K=64, dtype="float16")
ATTN = dict(batch=1, heads=8, kv_heads=2, seq_len=128, head_dim=128, dtype="float16")


def rejects(kind, params, target, field, words=""):
    with pytest.raises(InvalidSpec) as info:
        kernels.canonicalize(kind, params, target)
    assert info.value.field == field, str(info.value)
    assert words in str(info.value), str(info.value)
    return info.value


def test_all_kinds_registered():
    assert set(kernels.kinds()) >= {"gemm", "attention", "rmsnorm", "swiglu", "softmax", "add_rmsnorm", "layernorm", "rope"}


@pytest.mark.parametrize(
    "kind,params,target,field,words",
    [
        ("conv", {}, "c", "kind", "known kinds"),
        ("gemm", {**GEMM, "dtype": "float32", "alpha": 2}, "c", "alpha", "unknown parameter"),
        ("gemm", {"N": 4, "K": 4, "dtype": "float32"}, "c", "M", "missing"),
        ("gemm", {**GEMM, "M": 64.0}, "sm_90a", "M", "integer"),
        ("gemm", {**GEMM, "M": True}, "sm_90a", "M", "integer"),
        ("gemm", {**GEMM, "N": 0}, "sm_90a", "N", "at least"),
        ("gemm", {**GEMM, "K": None}, "sm_90a", "K", "None"),  # only M and N may be runtime sizes
        ("gemm", {**GEMM, "K": 1 << 21}, "sm_90a", "K", "at most"),
        ("gemm", {**GEMM, "dtype": "float8"}, "sm_90a", "dtype", "not one of"),
        ("gemm", {**GEMM, "trans_b": "yes"}, "sm_90a", "trans_b", "true or false"),
        ("gemm", {**GEMM, "act": "tanh"}, "sm_90a", "act", "not one of"),
        ("gemm", GEMM, "c", "dtype", "float32"),  # 16-bit on the CPU target
        ("gemm", {**GEMM, "dtype": "bfloat16"}, "c", "dtype", "float32"),
        ("gemm", GEMM, "sm_60", "target", "unknown target"),
        ("gemm", GEMM, "cuda -arch=sm_90", "target", "unknown target"),
        ("gemm", {**GEMM, "block_M": 96}, "sm_90a", "block_M", "power of two"),
        ("gemm", {**GEMM, "block_K": 8}, "sm_90a", "block_K", "power of two"),
        ("gemm", {**GEMM, "block_M": 2048}, "sm_90a", "block_M", "at most"),
        ("gemm", {**GEMM, "block_M": 256, "block_N": 256}, "sm_90a", "block_N", "registers"),
        ("gemm", {**GEMM, "block_K": 128, "num_stages": 6}, "sm_90a", "num_stages", "shared memory"),
        ("gemm", {**GEMM, "threads": 512}, "sm_90a", "threads", "128 or 256"),
        ("gemm", {**GEMM, "num_stages": 0}, "sm_90a", "num_stages", "at least"),
        ("gemm", {**GEMM, "dtype": "float32", "num_stages": 2}, "c", "num_stages", "CUDA"),
        ("gemm", {**GEMM, "K": 60}, "sm_90a", "K", "multiple of 8"),  # 16-byte rows for TMA/cp.async
        ("gemm", {**GEMM, "N": 100}, "sm_90a", "N", "multiple of 8"),
        ("attention", {**ATTN, "kv_heads": 3}, "sm_90a", "kv_heads", "multiple"),
        ("attention", {**ATTN, "kv_heads": 3, "dtype": "float32"}, "c", "kv_heads", "multiple"),
        ("attention", {**ATTN, "head_dim": 100}, "sm_90a", "head_dim", "multiple of 16"),
        ("attention", {**ATTN, "head_dim": 512}, "sm_90a", "head_dim", "256"),
        ("attention", {**ATTN, "dtype": "float32"}, "sm_90a", "dtype", "float16"),
        ("attention", {**ATTN, "causal": 1}, "sm_90a", "causal", "true or false"),
        ("attention", {**ATTN, "block_M": 32}, "sm_90a", "block_M", "threads/2"),
        ("attention", {**ATTN, "block_M": 64, "threads": 256}, "sm_90a", "block_M", "threads/2"),
        ("attention", {**ATTN, "block_N": 48}, "sm_90a", "block_N", "power of two"),
        ("attention", {**ATTN, "head_dim": 256, "block_N": 256}, "sm_90a", "block_M", "registers"),
        ("attention", {**ATTN, "head_dim": 256, "block_N": 128, "num_stages": 4}, "sm_90a", "num_stages", "shared memory"),
        ("attention", {**ATTN, "dtype": "float32", "threads": 128}, "c", "threads", "CUDA"),
        ("attention", {**ATTN, "causal": True, "num_stages": 2}, "sm_80", "num_stages", "must be 1"),
        ("attention", {**ATTN, "head_dim": 256}, "sm_75", "num_stages", "shared memory"),
        ("attention", {**ATTN, "dtype": "float32", "head_dim": 8192}, "c", "head_dim", "scratch"),
        ("attention", {**ATTN, "window": -1}, "sm_90a", "window", "at least 0"),
        ("attention", {**ATTN, "varlen": 1}, "sm_90a", "varlen", "true or false"),
        ("attention", {**ATTN, "varlen": True, "num_stages": 2}, "sm_80", "num_stages", "must be 1"),
        ("rmsnorm", {"M": 8, "N": 64, "dtype": "float32", "eps": -1.0}, "c", "eps", "at least"),
        ("rmsnorm", {"M": 8, "N": 64, "dtype": "float32", "eps": float("nan")}, "c", "eps", "finite"),
        ("rmsnorm", {"M": 8, "N": 64, "dtype": "float32", "eps": "1e-6"}, "c", "eps", "number"),
        ("rmsnorm", {"M": 8, "N": 32768, "dtype": "float16"}, "sm_90a", "N", "not supported"),
        ("rmsnorm", {"M": 8, "N": 100, "dtype": "float16"}, "sm_90a", "N", "multiple of 8"),
        ("rmsnorm", {"M": 8, "N": 16384, "dtype": "float16", "threads": 128}, "sm_90a", "threads", "elements each"),
        ("rmsnorm", {"M": 8, "N": 64, "dtype": "float16", "threads": 96}, "sm_90a", "threads", "power of two"),
        ("rmsnorm", {"M": 8, "N": 64, "dtype": "float32", "threads": 128}, "c", "threads", "CUDA"),
        ("softmax", {"M": 8, "N": 65536, "dtype": "bfloat16"}, "sm_90a", "N", "not supported"),
        ("softmax", {"M": None, "N": 64, "dtype": "float16"}, "c", "dtype", "float32"),
        ("swiglu", {"M": 8, "N": 64, "dtype": "float16", "block_N": 100}, "sm_90a", "block_N", "power of two"),
        ("swiglu", {"M": 8, "N": 64, "dtype": "float16", "block_M": 1, "block_N": 64}, "sm_90a", "block_N", "elements per thread"),
        ("swiglu", {"M": 8, "N": 60, "dtype": "float16"}, "sm_90a", "N", "multiple of 8"),
        ("swiglu", {"M": 8, "N": 30, "dtype": "float32"}, "sm_90a", "N", "multiple of 4"),
    ],
)
def test_rejected(kind, params, target, field, words):
    rejects(kind, params, target, field, words)


def test_params_must_be_a_mapping():
    with pytest.raises(InvalidSpec) as info:
        kernels.canonicalize("gemm", [("M", 1)], "c")
    assert info.value.field == "params"


def test_defaults_filled_per_target():
    cpu = kernels.canonicalize("gemm", {"M": None, "N": 64, "K": 64, "dtype": "float32"}, "c").params
    gpu = kernels.canonicalize("gemm", {"M": 4096, "N": 64, "K": 64, "dtype": "float16"}, "sm_90a").params
    assert cpu["block_M"] and cpu["num_stages"] is None
    assert gpu["block_N"] >= cpu["block_N"] and gpu["num_stages"] >= 1 and gpu["threads"] in (128, 256)
    # A runtime M on CUDA leaves the tiles open: that spec routes each call by M (Gemm.dispatch).
    router = kernels.canonicalize("gemm", {"M": None, "N": 64, "K": 64, "dtype": "float16"}, "sm_90a").params
    assert router["schedule"] == "auto" and router["block_N"] is None
    attn = kernels.canonicalize("attention", ATTN, "sm_90a").params
    assert attn["causal"] is False and attn["block_M"] and attn["block_N"]
    assert attn["window"] == 0 and attn["varlen"] is False  # the unmasked form, today's kernel


def test_explicit_default_tiling_is_the_same_key():
    implicit = kernels.canonicalize("gemm", GEMM, "sm_90a")
    pinned = ("schedule", "block_M", "block_N", "block_K", "num_stages", "threads", "split_k")  # the schedule M picked, and its tiles
    explicit = kernels.canonicalize("gemm", {**GEMM, **{k: implicit.params[k] for k in pinned}}, "sm_90a")
    assert implicit.to_json() == explicit.to_json()


@pytest.mark.parametrize(
    "kind,params",
    [
        ("gemm", dict(M=None, N=1, K=1, dtype="float32", trans_b=True, bias=True, act="gelu")),
        ("attention", dict(batch=None, heads=3, kv_heads=1, seq_len=None, head_dim=5, causal=True, dtype="float32")),
        ("rmsnorm", dict(M=None, N=1, dtype="float32", eps=0)),
        ("swiglu", dict(M=1, N=1, dtype="float32")),
        ("softmax", dict(M=None, N=1, dtype="float32")),
        ("add_rmsnorm", dict(M=None, N=1, dtype="float32")),
        ("layernorm", dict(M=1, N=1, dtype="float32", bias=True, residual=True)),
        ("rope", dict(tokens=None, heads=1, kv_heads=1, head_dim=2, max_position=1, dtype="float32")),
    ],
)
def test_cpu_accepts_any_positive_sizes(kind, params):
    kernels.canonicalize(kind, params, "c")
