"""attention's masked forms: a padded batch in one call (`varlen`: per-sequence key ranges) and a
sliding window. The kind's own reference (what the GPU test and the benchmarks compare with)
against an independent masked softmax, the CPU kernel against it through the daemon (ragged
ranges, windows, causal), and the CUDA form on a GPU where one is visible. The CUDA form's
key-block skipping, read off its source: tests/test_shared_builds.py."""

import math

import pytest
import torch

import kernels
from kernels import reference
from tests.marks import needs_gpu

KIND = "attention"
BERT = dict(batch=None, heads=12, kv_heads=12, seq_len=None, head_dim=64, varlen=True)  # ModernBERT-base's heads


def masked_softmax(q, k, v, lo, hi, causal, window):
    """Query i of sequence b sees key j when both lie in [lo[b], hi[b]), j <= i (causal) and
    |i - j| <= window (window > 0); a row that sees no key is zeros. float64, [b, s, h, d]."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2).double() for t in (q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)))
    n = q.shape[2]
    i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
    lo, hi = lo.long()[:, None, None, None], hi.long()[:, None, None, None]
    see = (lo <= i) & (i < hi) & (lo <= j) & (j < hi)
    see = see & (j <= i) if causal else see
    see = see & ((i - j).abs() <= window) if window else see
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~see, float("-inf"))
    return (torch.softmax(s, -1).nan_to_num(0.0) @ v).transpose(1, 2)


@pytest.mark.parametrize("causal,window", [(False, 0), (False, 6), (True, 0), (True, 6)])
def test_the_kinds_reference_is_a_masked_softmax(causal, window):
    p = kernels.canonicalize(KIND, dict(BERT, heads=4, kv_heads=2, head_dim=8, causal=causal, window=window, dtype="float32"), "c").params
    q, k, v, ranges = reference.make_inputs(KIND, p, runtime=dict(batch=5, seq_len=40))
    assert ranges.dtype == torch.int32 and ranges.shape == (5, 2) and ranges[0].tolist() == [0, 40]
    assert (ranges[1:, 0] > 0).any() and (ranges[1:, 1] < 40).any()  # padded on the left and on the right
    want = masked_softmax(q, k, v, ranges[:, 0], ranges[:, 1], causal, window)
    torch.testing.assert_close(reference.reference(KIND, p, [q, k, v, ranges]).double(), want, rtol=1e-5, atol=1e-5)


def test_the_cpu_kernel_matches_the_reference(cpu_kernel):
    k = cpu_kernel(KIND, **dict(BERT, heads=2, kv_heads=2, head_dim=16, window=5, dtype="float32", block_M=8, block_N=8))
    ins = reference.make_inputs(KIND, k.spec["params"], runtime=dict(batch=3, seq_len=33))
    torch.testing.assert_close(k(*ins), reference.reference(KIND, k.spec["params"], ins), **reference.tolerance("float32"))


def close(out, want):
    torch.testing.assert_close(out.double(), want, **reference.tolerance("float32"))


@pytest.mark.parametrize("causal,window", [(False, 0), (False, 5), (True, 0), (True, 4)])
def test_attention_varlen_and_window(cpu_kernel, causal, window):
    """One call for a padded batch: ragged key ranges (right, left and both-sided padding, an empty
    sequence), with and without a sliding window; rows outside a range are zeros."""
    k = cpu_kernel(
        "attention", batch=None, heads=4, kv_heads=2, seq_len=None, head_dim=8, causal=causal, window=window, varlen=True, dtype="float32", block_M=8, block_N=4
    )
    assert k.input_names == ["Q", "K", "V", "key_range"]
    q, kk, v = torch.randn(5, 29, 4, 8), torch.randn(5, 29, 2, 8), torch.randn(5, 29, 2, 8)
    lo, hi = torch.tensor([0, 0, 7, 3, 9]), torch.tensor([29, 13, 29, 20, 9])
    out = k(q, kk, v, torch.stack((lo, hi), 1).to(torch.int32))
    close(out, masked_softmax(q, kk, v, lo, hi, causal, window))
    assert not out[1, 13:].any() and not out[2, :7].any() and not out[4].any()  # padding rows: zeros


def test_attention_window_without_varlen(cpu_kernel):
    k = cpu_kernel("attention", batch=2, heads=2, kv_heads=2, seq_len=23, head_dim=8, window=3, dtype="float32", block_M=8, block_N=4)
    q, kk, v = torch.randn(2, 23, 2, 8), torch.randn(2, 23, 2, 8), torch.randn(2, 23, 2, 8)
    close(k(q, kk, v), masked_softmax(q, kk, v, torch.zeros(2, dtype=torch.long), torch.full((2,), 23), False, 3))


def test_cuda_tile_defaults_of_the_masked_forms():
    """Masked forms at head_dim 64 or less take 64x64 tiles (several blocks per SM); a window under
    128 keys takes 64-key blocks; head_dim 128 and the unmasked form keep 128-row blocks."""

    def tiles(**params):
        p = kernels.canonicalize(KIND, dict(BERT, dtype="bfloat16") | params, "sm_90a").params
        return p["block_M"], p["block_N"], p["threads"]

    assert tiles() == tiles(window=64) == (64, 64, 128)
    assert tiles(head_dim=128, heads=32, kv_heads=8, causal=True)[0] == 128
    assert tiles(head_dim=128, heads=32, kv_heads=8, window=64)[:2] == (128, 64)
    assert tiles(varlen=False, seq_len=512)[0] == 128


# ModernBERT-base's attention (12 heads of 64) at its benchmark's sequence length: full and sliding
# (local_attention 128: a window of 64) layers, and a causal padded prefill.
GPU_CASES = [
    (dict(BERT, dtype="bfloat16"), dict(batch=6, seq_len=512)),
    (dict(BERT, window=64, dtype="bfloat16"), dict(batch=6, seq_len=512)),
    (dict(BERT, window=64, dtype="float16", block_N=64), dict(batch=3, seq_len=300)),
    (dict(BERT, causal=True, dtype="bfloat16"), dict(batch=4, seq_len=700)),
    (dict(BERT, heads=32, kv_heads=8, head_dim=128, causal=True, window=100, dtype="float16"), dict(batch=2, seq_len=1000)),
]


@needs_gpu
def test_gpu_matches_the_reference(make_daemon):
    import os

    c = make_daemon(workers=min(8, os.cpu_count() or 2)).client()
    built = c.prefetch([{"kind": KIND, "target": "auto", **params} for params, _ in GPU_CASES])
    for (params, runtime), k in zip(GPU_CASES, built):
        assert not isinstance(k, Exception), k
        p = k.spec["params"]
        ins = reference.make_inputs(KIND, p, "cuda", runtime=runtime)
        ins[3][1] = torch.tensor([5, 5], dtype=torch.int32)  # an empty sequence: zeros
        out = k(*ins)
        assert torch.isfinite(out).all() and not out[1].any()
        torch.testing.assert_close(out.float(), reference.reference(KIND, p, ins).float(), **reference.tolerance(p["dtype"]), msg=lambda m, p=p: f"{p}: {m}")


@needs_gpu
def test_gpu_window_without_varlen_sees_no_key_past_the_end(make_daemon):
    """A windowed form without key ranges, at a length that is no multiple of the key block: the
    last rows' windows reach past seq_len, where TMA zero-fills the keys; those must stay masked."""
    k = make_daemon().client().get_kernel(KIND, target="auto", batch=None, heads=4, kv_heads=2, seq_len=None, head_dim=64, window=64, dtype="bfloat16")
    p = k.spec["params"]
    assert 300 % p["block_N"]
    ins = reference.make_inputs(KIND, p, "cuda", runtime=dict(batch=2, seq_len=300))
    torch.testing.assert_close(k(*ins).float(), reference.reference(KIND, p, ins).float(), **reference.tolerance(p["dtype"]))
