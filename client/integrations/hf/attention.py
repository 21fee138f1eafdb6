"""Attention through transformers' `AttentionInterface` / `AttentionMaskInterface`: `attention`
for prefill and encoders, `kv_attention` for decode steps. A padded batch (and a sliding window)
is one varlen call with each sequence's key range read off the mask; a masked decode step is one
`kv_attention` call, each sequence's keys gathered to the front of its cache."""

from __future__ import annotations

import torch

from .graphs import capturing
from .per_forward import per_forward
from .served import ATTR, served

ATTN = "kernel_service"  # the attention implementation's name (no "flash" or "sdpa": transformers special-cases those)


def register():
    """`ATTN` in transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN, attention)
    AttentionMaskInterface.register(ATTN, mask)


def mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    local_size=None,
    allow_is_causal_skip=True,
    allow_is_bidirectional_skip=False,
    **kwargs,
):
    """sdpa's mask, except that a plain causal or full pattern with no padding is None even while
    tracing (torch < 2.14 materializes it under torch.compile): the served kernels need no mask;
    and a causal decode step's mask is made in a few operations (_decode_mask)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if q_length == 1 and not allow_is_causal_skip and mask_function is causal_mask_function and local_size is None:
        return _decode_mask(batch_size, kv_length, q_offset, kv_offset, attention_mask, kwargs.get("device"))
    if capturing():  # the mask was checked on the host; reading it here would sync inside a capture
        allow_is_causal_skip = allow_is_bidirectional_skip = False
    plain = (allow_is_causal_skip and (q_length == 1 or q_length == kv_length)) or allow_is_bidirectional_skip
    if attention_mask is None and plain and (local_size is None or kv_length <= local_size) and not isinstance(q_offset, torch.Tensor):
        return None
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        **kwargs,
    )


def _decode_mask(batch_size, kv_length, q_offset, kv_offset, attention_mask, device):
    """sdpa_mask's [batch, 1, 1, keys] mask of one causal query at position q_offset (an int, or a
    static cache's tensor): key j is seen iff j + kv_offset <= q_offset and the 2D mask (padded
    with zeros to the keys) has it. generate makes this mask on the host before every decode
    step, outside any graph: sdpa_mask's general form launches many more kernels for it
    (docs/measured.md#hugging-face-models)."""
    keys = torch.arange(kv_offset, kv_offset + kv_length, device=device if attention_mask is None else attention_mask.device)
    seen = keys <= q_offset
    if attention_mask is not None:
        pad = kv_offset + kv_length - attention_mask.shape[-1]
        padding = attention_mask if pad <= 0 else torch.nn.functional.pad(attention_mask, (0, pad))
        seen = seen & padding[:, kv_offset : kv_offset + kv_length].bool()
    return seen.expand(batch_size, kv_length)[:, None, None, :]


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query [B, Hq, S, D], key/value [B, Hkv, L, D] -> ([B, S, Hq, D], None)."""
    entry = module.__dict__.get(ATTR)
    d = query.shape[-1]
    if entry is not None and (
        dropout
        or (scaling is not None and abs(scaling - d**-0.5) > 1e-6 * d**-0.5)
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions")
        or kwargs.get("s_aux") is not None
    ):
        if entry.report.strict:
            raise RuntimeError(
                f"kernelize(strict=True): {entry.name} keeps sdpa for this call: "
                "dropout, a scaling other than 1/sqrt(head_dim), softcap, output_attentions or s_aux"
            )
        if not torch.compiler.is_compiling():
            entry.report.fallbacks[entry.kind] += 1
        entry = None
    entry = served(entry, module, query, key, value)
    out, kind = (None, None) if entry is None else _serve_call(entry, module, query, key, value, attention_mask, kwargs.get("sliding_window"))
    if out is not None:
        if kind != entry.kind and not torch.compiler.is_compiling():  # counted as attention above
            entry.report.calls[entry.kind] -= 1
            entry.report.calls[kind] += 1
        return out, None
    if entry is not None and entry.report.strict:
        raise RuntimeError(f"kernelize(strict=True): {entry.name} keeps sdpa for this call: {kind}")
    if entry is not None and not torch.compiler.is_compiling():  # counted as served above: it was not
        entry.report.calls[entry.kind] -= 1
        entry.report.fallbacks[entry.kind] += 1
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _serve_call(entry, module, query, key, value, mask, sliding_window):
    """(output, kind served) or, when the kernels do not serve this call, (None, why)."""
    b, h, q, d = query.shape
    kv = key.shape[2]
    causal = bool(getattr(module, "is_causal", False))
    attn, kv_attn, varlen = entry.kernel, entry.kv_attention, entry.varlen
    window = entry.window
    Q, K, V = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D] views
    # transformers' sliding_window is flash's inclusive convention: query i sees keys within sliding_window - 1.
    if mask is None and (sliding_window is None or kv <= sliding_window):  # the window covers every key
        if q == kv:
            return attn(Q.contiguous(), K.contiguous(), V.contiguous()), "attention"
        if causal and kv_attn is not None and q == 1:  # decode: one query at the end of the cache
            return kv_attn(Q.contiguous(), K.contiguous(), V.contiguous(), torch.full((b,), kv, dtype=torch.int32, device=query.device)), "kv_attention"
        return None, f"{q} queries against {kv} keys (served: as many queries as keys, or one decode query)"
    if mask is not None and (torch.compiler.is_compiling() or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1):
        return None, "a mask that is not a boolean [batch, 1, queries, keys] tensor read eagerly (a traced call keeps sdpa)"
    if q == 1 and q != kv and mask is not None:
        return _padded_decode(kv_attn, causal, Q, K, V, mask)
    if q != kv or varlen is None:
        return None, "a padded or windowed call with as many queries as keys needs the varlen attention kernel"
    if (sliding_window or 1) - 1 != window:
        return None, f"a sliding window of {(sliding_window or 1) - 1} keys, not this layer's kernel's {window}"
    ranges = _key_ranges(mask, b, kv, causal, window) if mask is not None else _full_ranges(b, kv, query.device)
    if ranges is None:
        return None, "the mask is not padding (one run of keys per sequence) over this layer's causal and window pattern"
    return varlen(Q.contiguous(), K.contiguous(), V.contiguous(), ranges), "attention"


def _runs(seen, kv):
    """Each row's first and one-past-last True column, [lo, hi) (an empty row: [0, 0))."""
    j = torch.arange(kv, device=seen.device)
    lo = torch.where(seen, j, kv).amin(1)
    hi = torch.where(seen, j + 1, 0).amax(1)
    return torch.minimum(lo, hi), hi


def _key_ranges(mask, b, kv, causal, window):
    """Each sequence's keys [lo, hi) as int32 [batch, 2], when `mask` is exactly padding over the
    layer's pattern: query i sees key j iff lo <= j < hi (and j <= i when causal, |i - j| <= window
    when windowed). None for any other mask. Rows outside [lo, hi) are padding: the kernel gives
    them zeros (transformers' outputs there are meaningless)."""

    def compute():
        m = mask[:, 0].expand(b, kv, kv)
        lo, hi = _runs(m.any(1), kv)  # the keys some query sees
        if capturing():  # the 2D mask was checked to be padding before the forward (no sync in a graph)
            return torch.stack((lo, hi), 1).to(torch.int32)
        j = torch.arange(kv, device=mask.device)
        want = (j >= lo[:, None, None]) & (j < hi[:, None, None])
        i = j[:, None]
        if causal:
            want = want & (j <= i)
        if window:
            want = want & ((i - j).abs() <= window)
        return torch.stack((lo, hi), 1).to(torch.int32) if torch.equal(want.expand_as(m), m) else None

    return per_forward(mask, ("prefill", causal, window), compute)


def _full_ranges(b, kv, device):
    return torch.tensor([[0, kv]], dtype=torch.int32, device=device).expand(b, 2).contiguous()


def _decode_keys(mask, b, kv):
    """A decode mask [batch, 1, 1, keys] as each sequence's keys: (order int64 [batch, keys], the
    positions of its keys first and in order; seq_lens int32 [batch]). Nothing is read on the host."""

    def compute():  # a scan and a scatter, no sort: CUB's segmented sorts cannot always be captured in a CUDA graph
        seen = mask[:, 0, 0].expand(b, kv)
        upto = seen.to(torch.int32).cumsum(1, dtype=torch.int32)  # each position's keys seen, itself included
        seq_lens = upto[:, -1:]
        j = torch.arange(kv, device=mask.device, dtype=torch.int32)
        to = torch.where(seen, upto - 1, seq_lens + j - upto)  # the keys to the front in order, the others after them
        order = torch.empty((b, kv), dtype=torch.long, device=mask.device).scatter_(1, to.long(), j.long().expand(b, kv))
        return order, seq_lens[:, 0].contiguous()

    return per_forward(mask, "decode", compute)


def _padded_decode(kv_attn, causal, Q, K, V, mask):
    """One decode query per sequence against a masked cache, in one kv_attention call. The kernel
    sees keys 0..seq_lens-1; a decode query sees a set of keys, whose order does not matter, so each
    sequence's keys are gathered to the front of its cache (a gather, as costly as the copy that
    makes the cache contiguous anyway): any mask is served, padding on either side or gaps, with
    no read on the host (none inside a CUDA graph, no sync a step outside one)."""
    if not causal or kv_attn is None:
        return None, "one query against a padded cache needs kv_attention (causal models)"
    b, kv = K.shape[0], K.shape[1]
    order, seq_lens = _decode_keys(mask, b, kv)
    rows = torch.arange(b, device=K.device)[:, None]
    return kv_attn(Q.contiguous(), K[rows, order], V[rows, order], seq_lens), "kv_attention"
