"""The zoo's Hopper tensor-core kernels place their own barriers and build with TileLang's
ThreadSync pass off (kernels/barriers.py): their code must be byte for byte what that pass
makes, so a TileLang that places barriers otherwise fails here, not as a race on the GPU.
Lowering only: runs on any machine (TileLang cross-compiles)."""

from __future__ import annotations

import pytest

import kernels
import kernels.barriers
from tests.lowering import cuda_source

MMA = dict(M=None, N=1000, K=1000, trans_b=True, dtype="float16")
ATTENTION = dict(batch=2, heads=8, kv_heads=2, seq_len=1024, head_dim=128, dtype="float16")
SPECS = [
    # gemm: both wgmma tiles of the prefill table, each with and without a residual (read through
    # the output's shared tile), a split-K=1 decode tile with an epilogue, split-K partials, fp32.
    *(
        ("gemm", dict(MMA, schedule="tma", block_M=bm, block_N=bn, block_K=64, num_stages=3, threads=2 * bm, residual=residual))
        for bm, bn in ((128, 256), (64, 128))
        for residual in (False, True)
    ),
    ("gemm", dict(MMA, bias=True, act="silu", schedule="splitk", block_M=16, block_N=64, block_K=256, num_stages=4, threads=128, split_k=1)),
    ("gemm", dict(MMA, dtype="bfloat16", residual=True, schedule="splitk", split_k=4)),
    ("gemm", dict(MMA, dtype="float32", bias=True, residual=True)),
    # attention: plain, causal at both block heights, and masked (a padded, windowed batch).
    ("attention", ATTENTION),
    ("attention", dict(ATTENTION, causal=True, dtype="bfloat16", block_M=64)),
    ("attention", dict(ATTENTION, causal=True, seq_len=None, head_dim=64, num_stages=1)),
    ("attention", dict(ATTENTION, batch=None, seq_len=None, head_dim=64, varlen=True, window=64)),
]


@pytest.mark.parametrize("kind, params", SPECS, ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={v}" for k, v in v.items() if k not in ("M", "K")))
def test_hopper_kernels_place_the_barriers_thread_sync_would(kind, params, monkeypatch):
    own = cuda_source(kind, params)
    # The epilogue's barriers are there, on named barrier 3; split-K partials have no shared epilogue.
    assert ("__sync_thread_partial(3, " in own) == (params.get("split_k", 1) == 1)
    monkeypatch.setattr(kernels.barriers, "owns_barriers", lambda target: False)
    assert own == cuda_source(kind, params)


def test_other_targets_keep_thread_sync():
    sm80 = kernels.parse_target("sm_80")
    spec = kernels.canonicalize("gemm", dict(MMA, M=4096), "sm_80")
    func = kernels.get_kind("gemm").build(dict(spec.params), sm80)
    assert "tl.disable_thread_storage_sync" not in dict((func.attrs or {}).get("tilelang_pass_configs") or {})
