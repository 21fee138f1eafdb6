"""Served kernels in Hugging Face transformers models: `kernelize(model)`.

    import client.integrations.hf as hf
    model = hf.kernelize(LlamaForCausalLM.from_pretrained(...).eval())   # backend="auto"
    model.kernel_service.backend, model.kernel_service.swapped, model.kernel_service.kept

What is swapped, following the Hugging Face `kernels` layer contract (stateless layer classes
with `forward`, `has_backward`, `can_torch_compile`, bound to each module instance) but applied
here, and through transformers' attention interfaces, keeping the model's own weights:

- RMSNorm (`LlamaRMSNorm` and its modular copies) -> `rmsnorm`;
- the Llama MLP (`act(gate(x)) * up(x)` with SiLU) -> `swiglu` between the model's own projections;
- ModernBERT's GLU MLP (`Wo(act(input) * gate)`, `input | gate` one `Wi` output, GELU) -> `geglu`
  (packed) between its own `Wi` and `Wo`;
- `nn.LayerNorm` with weights (ModernBERT; this model's instances only) -> `layernorm`;
- ModernBERT's encoder layer, its two residual adds fused away: the attention output's into
  `mlp_norm` (`layernorm` with `residual`: one kernel writes the sum and its norm), the MLP's into
  its `Wo` GEMM (accumulated onto that sum, a tensor the layer owns);
- rotary (the modeling module's `apply_rotary_pos_emb`, replaced by a wrapper) -> `rope` with the
  model's own cos/sin as the cache;
- an attention module with one fused QKV projection (ModernBERT's `Wqkv`) is swapped whole:
  `rope` packed reads Q and K in `Wqkv`'s output and copies V out beside them (`v_out`), one
  launch, then the attention below and the module's own `Wo`;
- attention, registered as `AttentionInterface` / `AttentionMaskInterface` "kernel_service":
  `attention` for prefill and encoders, `kv_attention` for decode steps against a KV cache. A
  padded batch (and ModernBERT's sliding-window layers, at any length) is one `attention` call
  with `varlen=True` (each sequence's key range, read off the mask) and the layer's `window`;
  eager only: reading the mask is data-dependent. A padded decode step is one `kv_attention` call,
  each sequence's cache rotated to start at its first key (`kv_attention` has no key start).

A shape, dtype, mask or option a kind does not serve keeps the module's own forward (attention:
transformers' `sdpa`), call by call; `strict=True` raises instead, naming the module and why.
Kernels are inference-only: in training mode, or when grad would be recorded, every module
runs its own forward. transformers shares `apply_rotary_pos_emb` between all models of a family,
so its swap is process-wide, for the head shapes and dtypes kernelized (the same math).

Hugging Face's `kernels` distribution is not used: it and this project's `kernels` package (the
kinds) share a top-level name and cannot be installed together.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import types
import warnings
import weakref

import torch
from torch import nn

from . import graphs as _graphs

BACKENDS = ("eager", "compile", "kernel-service", "auto")
ATTN = "kernel_service"  # the attention implementation's name (no "flash" or "sdpa": transformers special-cases those)
_ATTR = "_kernel_service"  # a served module's entry (not a parameter or buffer: the state dict is unchanged)
_ROPE: dict[tuple, dict[tuple, "_Entry"]] = {}  # (heads, kv_heads, head_dim) -> (dtype, device type) -> the served rope


# ----- transformers must not take the project's `kernels` for Hugging Face's


def _check_transformers():
    """transformers decides whether Hugging Face `kernels` is there by package metadata: the import
    name `kernels` resolves to this project's package, whose distribution (kernel-service, 0.1.x)
    is outside the range transformers takes, so its hub hooks stay stubs. Were it ever in range (or
    HF's distribution installed), transformers would import this project's `kernels` as HF's."""
    from transformers.utils import import_utils

    if import_utils.is_kernels_available():
        raise ImportError(
            "transformers takes the `kernels` package for Hugging Face's kernels (a `kernels` distribution in its version range "
            "is installed); this project's `kernels` package has the same top-level name: uninstall Hugging Face's `kernels`"
        )


_check_transformers()


# ----- what kernelize leaves on the model


@dataclasses.dataclass
class Report:
    """`model.kernel_service` after kernelize: what was asked, chosen, swapped and kept."""

    requested: str
    backend: str = "eager"
    reason: str = ""  # why the backend is not the one requested (or auto's choice)
    swapped: dict = dataclasses.field(default_factory=dict)  # module name -> kind
    kept: dict = dataclasses.field(default_factory=dict)  # module name -> why it keeps its own forward
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # kind -> eager calls served
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # kind -> calls that ran the module's own forward
    original_attn: str | None = None
    strict: bool = False  # a call the kernels do not serve raises instead of running the module's own forward
    warned_grad: bool = dataclasses.field(default=False, repr=False)  # the grad-mode warning, given once per model
    graphs: _graphs.GraphStats | None = None  # with kernelize(graphs=...): the buckets captured, replays, calls uncaptured


@dataclasses.dataclass(eq=False)
class _Entry:
    kind: str
    kernel: object  # client.Kernel
    report: Report
    dtype: torch.dtype
    device_type: str
    more: dict = dataclasses.field(default_factory=dict)  # attention: the kv_attention, varlen and qkv_rope kernels, the window


GRAD_WARNING = (
    "kernelize: this model was called with grad enabled, so it runs its own eager forwards (served kernels are "
    "inference-only); call it under torch.inference_mode() (or torch.no_grad())"
)


def _served(entry, module, *tensors, count: bool = True):
    """The entry when this call can be served (inference, the kernel's dtype and device), else None;
    `count`: count the call, served or fallen back, under the entry's kind."""
    if entry is None:
        return None
    x = tensors[0]
    training = module is not None and module.training
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    ok = not training and not grad and x.dtype == entry.dtype and x.device.type == entry.device_type
    if not torch.compiler.is_compiling():
        if count:
            (entry.report.calls if ok else entry.report.fallbacks)[entry.kind] += 1
        if grad and not training and not entry.report.warned_grad:  # an eval model called without inference_mode: say so, once
            entry.report.warned_grad = True
            warnings.warn(GRAD_WARNING, RuntimeWarning, stacklevel=2)
    return entry if ok else None


# ----- the layers (the HF `kernels` layer contract: no __init__, no state, a forward and two flags;
# kernelize binds forward to the module instance, so `self` is the model's own module)


class RMSNormLayer(nn.Module):
    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states):
        entry = _served(self.__dict__.get(_ATTR), self, hidden_states, self.weight)
        if entry is None:
            return type(self).forward(self, hidden_states)
        n = hidden_states.shape[-1]
        return entry.kernel(hidden_states.reshape(-1, n).contiguous(), self.weight).view(hidden_states.shape)


class LayerNormLayer(nn.Module):
    can_torch_compile = True
    has_backward = False

    def forward(self, input):
        entry = _served(self.__dict__.get(_ATTR), self, input, self.weight, self.bias)
        if entry is None:
            return type(self).forward(self, input)
        n = input.shape[-1]
        args = (input.reshape(-1, n).contiguous(), self.weight) + ((self.bias,) if self.bias is not None else ())
        return entry.kernel(*args).view(input.shape)


class EncoderLayer(nn.Module):
    """ModernBERT's encoder layer (`h += attn(attn_norm(h)); h += mlp(mlp_norm(h))`) without its two
    residual adds: `layernorm` with `residual` takes the attention output and the layer's input and
    writes their sum and its norm, and the MLP adds onto that sum in place (add_mlp)."""

    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        entry = _served(self.__dict__.get(_ATTR), self, hidden_states, self.mlp_norm.weight)
        if entry is None:
            return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings, **kwargs)
        attn_output, _ = self.attn(self.attn_norm(hidden_states), position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        n, norm = hidden_states.shape[-1], self.mlp_norm
        bias = (norm.bias,) if norm.bias is not None else ()
        normed, summed = entry.kernel(attn_output.reshape(-1, n), hidden_states.reshape(-1, n), norm.weight, *bias)
        return add_mlp(self.mlp, normed, summed).view(hidden_states.shape)


def add_mlp(mlp, x, out):
    """out += mlp(x), in place (`out`: a tensor the caller owns). A served GLU MLP's `Wo` GEMM
    accumulates onto `out` itself (addmm_: the GEMM's epilogue adds), instead of a separate add."""
    entry = mlp.__dict__.get(_ATTR)
    entry = _served(entry, mlp, x, mlp.Wi.weight) if entry is not None and entry.kind == "geglu" and type(mlp.Wo) is nn.Linear else None
    if entry is None:
        return out.add_(mlp(x).view(out.shape))
    h = mlp.Wi(x)
    out.addmm_(entry.kernel(h.reshape(-1, h.shape[-1])), mlp.Wo.weight.t())  # dropout: identity in eval
    return out if mlp.Wo.bias is None else out.add_(mlp.Wo.bias)


class SwiGLUMLPLayer(nn.Module):
    can_torch_compile = True
    has_backward = False

    def forward(self, x):
        entry = _served(self.__dict__.get(_ATTR), self, x, self.gate_proj.weight)
        if entry is None:
            return type(self).forward(self, x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        n = gate.shape[-1]
        return self.down_proj(entry.kernel(gate.reshape(-1, n), up.reshape(-1, n)).view(gate.shape))


class GeGLUMLPLayer(nn.Module):
    """ModernBERT's MLP: Wi's output is [input | gate] along the last dim, the packed layout."""

    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states):
        entry = _served(self.__dict__.get(_ATTR), self, hidden_states, self.Wi.weight)
        if entry is None:
            return type(self).forward(self, hidden_states)
        x = self.Wi(hidden_states)
        n = x.shape[-1]
        return self.Wo(entry.kernel(x.reshape(-1, n)).view(*x.shape[:-1], n // 2))  # dropout: identity in eval


class RotaryLayer(nn.Module):
    """Bound to the modeling module's own `apply_rotary_pos_emb` (`self`), which is its fallback."""

    can_torch_compile = True
    has_backward = False

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        # A kernelized model's heads: its entry, or one of another dtype or device, whose fallback
        # _served counts. Heads no kernelized model has are another model's call: not counted.
        served = _ROPE.get((q.shape[1], k.shape[1], q.shape[-1]), {}) if q.dim() == 4 else {}
        entry = served.get((q.dtype, q.device.type)) or next(iter(served.values()), None)
        if entry is not None and not (unsqueeze_dim == 1 and _rope_fits(cos, q.shape[0], q.shape[-1])):
            if not torch.compiler.is_compiling():
                entry.report.fallbacks[entry.kind] += 1
            entry = None
        entry = _served(entry, None, q, k)
        if entry is None:
            return self(q, k, cos, sin, unsqueeze_dim)
        b, h, s, d = q.shape
        kvh = k.shape[1]
        positions, cache = _rope_rows(cos, sin, b, q.dtype)
        qo, ko = entry.kernel(positions, q.transpose(1, 2).reshape(b * s, h, d).contiguous(), k.transpose(1, 2).reshape(b * s, kvh, d).contiguous(), cache)
        return qo.view(b, s, h, d).transpose(1, 2), ko.view(b, s, kvh, d).transpose(1, 2)


def _rope_fits(cos, batch, head_dim) -> bool:
    """Whether transformers' cos/sin ([batch or 1, seq, head_dim]) become `rope`'s cache rows (_rope_rows)."""
    return cos.dim() == 3 and cos.shape[-1] == head_dim and cos.shape[0] in (1, batch)


def _rope_rows(cos, sin, batch, dtype):
    """(positions, cos_sin_cache) for `rope`: the kernel's cache is [rows, cos | sin] (vLLM's layout),
    and each token's own row is its cos/sin. Made once per forward and cos/sin pair (every layer
    of a type gets the same), outside a trace."""

    def compute():
        d = cos.shape[-1]
        cache = torch.cat((cos[..., : d // 2], sin[..., : d // 2]), dim=-1).reshape(-1, d).to(dtype)
        positions = torch.arange(cache.shape[0], device=cos.device)
        if cos.shape[0] != batch:
            positions = positions.repeat(batch)
        return positions, cache.contiguous()

    if torch.compiler.is_compiling():
        return compute()
    # The entry holds sin, so no other tensor takes its id while cos keeps the entry.
    return _per_forward(cos, ("rope rows", id(sin), batch, dtype), lambda: (sin, *compute()))[1:]


class QKVAttentionLayer(nn.Module):
    """ModernBERT's attention module (one fused `Wqkv` projection): `rope` packed reads Q and K where
    `Wqkv` wrote them and copies V out beside them (`v_out`), in one launch, so the attention kernel
    gets three contiguous tensors with no copy in between; then the module's own `Wo`."""

    can_torch_compile = True
    has_backward = False

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        entry = self.__dict__.get(_ATTR)
        cos, sin = position_embeddings
        b, s = hidden_states.shape[:2]
        h, d = self.config.num_attention_heads, self.head_dim
        # Counted as rope here: the attention below, or the module's own forward, counts itself.
        if not _rope_fits(cos, b, d) or _served(entry, self, hidden_states, self.Wqkv.weight, count=False) is None:
            return type(self).forward(self, hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        if not torch.compiler.is_compiling():
            entry.report.calls["rope"] += 1
        qkv = self.Wqkv(hidden_states)
        positions, cache = _rope_rows(cos, sin, b, qkv.dtype)
        q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in entry.more["qkv_rope"](positions, qkv.view(b * s, 3 * h, d), cache))
        out, _ = _attention(self, q, k, v, attention_mask, dropout=0.0, scaling=d**-0.5, sliding_window=self.sliding_window, **kwargs)
        return self.out_drop(self.Wo(out.reshape(b, s, -1))), None


# ----- attention


def _mask(
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
    tracing (torch < 2.14 materializes it under torch.compile): the served kernels need no mask."""
    from transformers.masking_utils import sdpa_mask

    if _graphs.capturing():  # the mask was checked on the host; reading it here would sync inside a capture
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


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query [B, Hq, S, D], key/value [B, Hkv, L, D] -> ([B, S, Hq, D], None)."""
    entry = module.__dict__.get(_ATTR)
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
                f"kernelize(strict=True): {entry.more.get('name', 'attention')} keeps sdpa for this call: "
                "dropout, a scaling other than 1/sqrt(head_dim), softcap, output_attentions or s_aux"
            )
        if not torch.compiler.is_compiling():
            entry.report.fallbacks[entry.kind] += 1
        entry = None
    entry = _served(entry, module, query, key, value)
    out, kind = (None, None) if entry is None else _serve_attention(entry, module, query, key, value, attention_mask, kwargs.get("sliding_window"))
    if out is not None:
        if kind != entry.kind and not torch.compiler.is_compiling():  # counted as attention above
            entry.report.calls[entry.kind] -= 1
            entry.report.calls[kind] += 1
        return out, None
    if entry is not None and entry.report.strict:
        raise RuntimeError(f"kernelize(strict=True): {entry.more.get('name', 'attention')} keeps sdpa for this call: {kind}")
    if entry is not None and not torch.compiler.is_compiling():  # counted as served above: it was not
        entry.report.calls[entry.kind] -= 1
        entry.report.fallbacks[entry.kind] += 1
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _serve_attention(entry, module, query, key, value, mask, sliding_window):
    """(output, kind served) or, when the kernels do not serve this call, (None, why)."""
    b, h, q, d = query.shape
    kv = key.shape[2]
    causal = bool(getattr(module, "is_causal", False))
    attn, kv_attn, varlen = entry.kernel, entry.more.get("kv_attention"), entry.more.get("varlen")
    window = entry.more.get("window", 0)
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


_PER_FORWARD: dict = {}  # (id(tensor), what) -> (weakref to the tensor, result): once per forward, not per layer


def _per_forward(tensor, what, compute):
    """compute() for this tensor object, once: every layer of a forward gets the same mask, and
    the same cos/sin (one per layer type)."""
    slot = (id(tensor), what)
    hit = _PER_FORWARD.get(slot)
    if hit is not None and hit[0]() is tensor:
        return hit[1]
    result = compute()
    for k in [k for k, (ref, _) in _PER_FORWARD.items() if ref() is None]:
        del _PER_FORWARD[k]
    _PER_FORWARD[slot] = (weakref.ref(tensor), result)
    return result


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
        if _graphs.capturing():  # the 2D mask was checked to be padding before the forward (no sync in a graph)
            return torch.stack((lo, hi), 1).to(torch.int32)
        j = torch.arange(kv, device=mask.device)
        want = (j >= lo[:, None, None]) & (j < hi[:, None, None])
        i = j[:, None]
        if causal:
            want = want & (j <= i)
        if window:
            want = want & ((i - j).abs() <= window)
        return torch.stack((lo, hi), 1).to(torch.int32) if torch.equal(want.expand_as(m), m) else None

    return _per_forward(mask, ("prefill", causal, window), compute)


def _full_ranges(b, kv, device):
    return torch.tensor([[0, kv]], dtype=torch.int32, device=device).expand(b, 2).contiguous()


def _decode_runs(mask, b, kv):
    """A decode mask [batch, 1, 1, keys] as each sequence's one run of keys: (lo int64 [batch],
    seq_lens int32 [batch], whether every lo is 0), or None when a sequence's keys have a gap."""

    def compute():
        seen = mask[:, 0, 0].expand(b, kv)
        lo, hi = _runs(seen, kv)
        if _graphs.capturing():  # the step's mask was checked before the replay; every run is rotated
            return lo, (hi - lo).to(torch.int32), False
        one_run, at_zero = torch.stack(((seen.sum(1) == hi - lo).all(), (lo == 0).all())).tolist()  # one sync
        return (lo, (hi - lo).to(torch.int32), at_zero) if one_run else None

    return _per_forward(mask, "decode", compute)


def _padded_decode(kv_attn, causal, Q, K, V, mask):
    """One decode query per sequence against a padded cache, in one kv_attention call. The kernel
    sees keys 0..seq_lens-1; a decode query sees every key of its run, so their order does not
    matter: each sequence's cache is rotated to start at its first key (a gather, as costly as the
    copy that makes the cache contiguous anyway; none when every run starts at 0, as in a static
    cache without padding). Each sequence's keys must be one run."""
    if not causal or kv_attn is None:
        return None, "one query against a padded cache needs kv_attention (causal models)"
    b, kv = K.shape[0], K.shape[1]
    runs = _decode_runs(mask, b, kv)
    if runs is None:
        return None, "a decode mask with a gap in a sequence's keys"
    lo, seq_lens, at_zero = runs
    if at_zero:
        K, V = K.contiguous(), V.contiguous()
    else:
        keys = (lo[:, None] + torch.arange(kv, device=K.device)) % kv  # [batch, keys]: the run first
        rows = torch.arange(b, device=K.device)[:, None]
        K, V = K[rows, keys], V[rows, keys]
    return kv_attn(Q.contiguous(), K, V, seq_lens), "kv_attention"


# ----- planning: which module gets which kernel


def _code(fn):
    c = fn.__code__
    return c.co_code, c.co_consts, c.co_names


def _known():
    """The forwards whose computation the layers above reproduce (by bytecode: modular copies match)."""
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.modernbert import modeling_modernbert as modernbert

    return {
        "rmsnorm": {_code(llama.LlamaRMSNorm.forward)},
        "swiglu": {_code(llama.LlamaMLP.forward)},
        "geglu": {_code(modernbert.ModernBertMLP.forward)},
        "encoder_layer": {_code(modernbert.ModernBertEncoderLayer.forward)},
        "qkv_attention": {_code(modernbert.ModernBertAttention.forward)},
        "rope": {_code(_unwrapped(llama.apply_rotary_pos_emb)), _code(_unwrapped(modernbert.apply_rotary_pos_emb))},
    }


def _unwrapped(fn):
    """A modeling module's own `apply_rotary_pos_emb`, also after kernelize replaced it."""
    return getattr(fn, "__wrapped__", fn)


def _rotary(original):
    """The replacement for a modeling module's `apply_rotary_pos_emb`: RotaryLayer.forward bound to it."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        return RotaryLayer.forward(original, q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.kernel_service = True
    return apply_rotary_pos_emb


def _gelu_form(act):
    """F.gelu's `approximate` when `act` (a transformers activation module) is exactly torch's GELU, else None."""
    fn = getattr(act, "act", None)
    if fn is torch.nn.functional.gelu:
        return "none"
    if isinstance(fn, functools.partial) and fn.func is torch.nn.functional.gelu and not fn.args and fn.keywords == {"approximate": "tanh"}:
        return "tanh"
    return None


def _plan(model, device, dtype, target):
    """(module name, module, kind, params) for every module kernelize could swap, plus why others are kept."""
    known = _known()
    plans, kept, rotary = [], {}, {}
    for name, m in model.named_modules():
        cls = type(m)
        fwd = getattr(cls, "forward", None)
        code = _code(fwd) if hasattr(fwd, "__code__") else None
        if code in known["rmsnorm"]:
            plans.append((name, m, "rmsnorm", {"M": None, "N": m.weight.shape[-1], "eps": float(m.variance_epsilon)}))
        elif code in known["swiglu"]:
            act = getattr(m.config, "hidden_act", None)
            if act in ("silu", "swish"):
                plans.append((name, m, "swiglu", {"M": None, "N": m.gate_proj.out_features}))
            else:
                kept[name] = f"activation {act!r} is not SiLU (swiglu serves silu(gate) * up)"
        elif code in known["geglu"]:
            approximate = _gelu_form(m.act)
            if approximate is None:
                kept[name] = f"activation {type(m.act).__name__} is not torch's GELU (geglu serves F.gelu, exact or tanh)"
            else:
                plans.append((name, m, "geglu", {"M": None, "N": m.Wo.in_features, "packed": True, "approximate": approximate}))
        elif code in known["encoder_layer"]:
            norm = m.mlp_norm
            if type(norm) is not nn.LayerNorm or norm.weight is None or len(norm.normalized_shape) != 1:
                kept[name] = "mlp_norm is not a layernorm with weights over one dim (the residual add is fused into it)"
            else:
                plans.append(
                    (name, m, "layernorm", {"M": None, "N": norm.normalized_shape[0], "eps": float(norm.eps), "bias": norm.bias is not None, "residual": True})
                )
        elif cls is nn.LayerNorm:
            if m.weight is None or len(m.normalized_shape) != 1:
                kept[name] = "layernorm serves one normalized dim with weights"
            else:
                plans.append((name, m, "layernorm", {"M": None, "N": m.normalized_shape[0], "eps": float(m.eps), "bias": m.bias is not None}))
        elif hasattr(m, "head_dim") and hasattr(m, "is_causal") and hasattr(m, "config"):
            cfg = m.config
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": m.head_dim}
            plans.append((name, m, "attention", {"batch": None, "seq_len": None, "causal": bool(m.is_causal), **shape}))
            # Padded batches and sliding windows: one call with each sequence's key range. ModernBERT's
            # sliding layers keep `sliding_window` = window + 1 (flash's inclusive convention).
            window = (getattr(m, "sliding_window", None) or 1) - 1
            plans.append((name, m, "attention", {"batch": None, "seq_len": None, "causal": bool(m.is_causal), "varlen": True, "window": window, **shape}))
            if m.is_causal:
                plans.append((name, m, "kv_attention", {"batch": None, "q_len": 1, **shape}))  # decode (split-KV); longer query chunks keep sdpa
            # The attention forward calls its modeling module's global `apply_rotary_pos_emb`.
            modeling = sys.modules.get(cls.__module__)
            fn = getattr(modeling, "apply_rotary_pos_emb", None)
            if fn is not None and "apply_rotary_pos_emb" in getattr(getattr(fwd, "__code__", None), "co_names", ()):
                if _code(_unwrapped(fn)) in known["rope"]:
                    slot = rotary.setdefault(tuple(shape.values()), [f"{name}.rotary_pos_emb", set(), shape])
                    slot[1].add(modeling)
                    if code in known["qkv_attention"]:  # the whole module: QKVAttentionLayer
                        plans.append((name, m, "rope", {"tokens": None, "max_position": None, "style": "neox", "packed": True, "v_out": True, **shape}))
                else:
                    kept[f"{name}.rotary_pos_emb"] = "not a rotary form this integration knows"
    for key, (name, modelings, shape) in rotary.items():
        plans.append((name, modelings, "rope", {"tokens": None, "max_position": None, "style": "neox", **shape}))
    for i, (name, m, kind, params) in enumerate(plans):
        plans[i] = (name, m, kind, {**params, "dtype": dtype, "target": target})
    return plans, kept


def _first_param(model):
    try:
        return next(model.parameters())
    except StopIteration:
        raise ValueError("kernelize: the model has no parameters") from None


def _key(kind, params):
    return kind, tuple(sorted((k, str(v)) for k, v in params.items()))


_LAYERS = {"rmsnorm": RMSNormLayer, "swiglu": SwiGLUMLPLayer, "geglu": GeGLUMLPLayer, "layernorm": LayerNormLayer, "rope": RotaryLayer}


def _layer(entry):
    """The layer class whose forward an entry's module takes."""
    return EncoderLayer if entry.kind == "layernorm" and entry.more["params"].get("residual") else _LAYERS[entry.kind]


def _rider(kind, params):
    """The key a plan's kernel takes in its module's entry (`_Entry.more`) when it rides on another
    plan's: attention's decode and varlen forms, and the rope of a fused-QKV attention module;
    None for a plan of its own."""
    if kind == "kv_attention":
        return kind
    if kind == "attention" and params.get("varlen"):
        return "varlen"
    if kind == "rope" and params.get("v_out"):
        return "qkv_rope"
    return None


def _serve(model, report: Report, client, strict: bool, device: torch.device, dtype: torch.dtype) -> str:
    """Swaps what can be served; returns why nothing could be ('' when something was)."""
    if model.training:
        return "the model is in training mode (served kernels are inference-only; call model.eval() first)"
    import client as client_pkg

    from ..errors import InvalidSpec, KernelServiceError

    c = client or client_pkg.default_client()
    target = "c" if device.type == "cpu" else "auto"
    plans, kept = _plan(model, device, dtype, target)
    report.kept.update(kept)
    valid, index = [], {}
    for name, m, kind, params in plans:
        key = _key(kind, params)
        if key in index:
            continue
        try:
            c._request(kind, {k: v for k, v in params.items() if k != "target"}, target)
        except InvalidSpec as exc:
            index[key] = exc
            continue
        index[key] = len(valid)
        valid.append({"kind": kind, **params})
    try:
        results = c.prefetch(valid) if valid else []  # one RPC: cold kernels compile in parallel
    except KernelServiceError as exc:
        return f"{type(exc).__name__}: {exc}"
    entries = {}  # module name -> (module, entry); kv_attention rides on its module's attention entry
    for name, m, kind, params in plans:
        got = index[_key(kind, params)]
        got = got if isinstance(got, Exception) else results[got]
        rides = _rider(kind, params)
        if rides:
            if not isinstance(got, Exception) and name in entries:
                entries[name][1].more[rides] = got
                if params.get("varlen"):
                    entries[name][1].more["window"] = params["window"]
        elif isinstance(got, Exception):
            report.kept[name] = f"{kind} is not served: {got}"
        else:
            entries[name] = (m, _Entry(kind, got, report, dtype, device.type, {"params": params, "name": name}))
    if strict and report.kept:
        name, why = next(iter(report.kept.items()))
        raise RuntimeError(f"kernelize(strict=True): {name} would keep its own forward: {why}")
    if not entries:  # one short line: each module's reason is in report.kept
        return (
            f"no module of this model is served ({len(report.kept)} kept: model.kernel_service.kept says why)"
            if report.kept
            else "no module this integration knows"
        )

    # The layer contract, applied here: each module's forward is the layer's, bound to that module.
    for name, (m, entry) in entries.items():
        if entry.kind == "attention":
            continue
        layer = _layer(entry)
        if entry.kind == "rope":
            p = entry.more["params"]
            _ROPE.setdefault((p["heads"], p["kv_heads"], p["head_dim"]), {})[(dtype, device.type)] = entry
            for modeling in m:  # process-wide: transformers' attention calls the module's global
                if not getattr(modeling.apply_rotary_pos_emb, "kernel_service", False):
                    modeling.apply_rotary_pos_emb = _rotary(modeling.apply_rotary_pos_emb)
        else:
            vars(m)[_ATTR] = entry
            vars(m)["forward"] = types.MethodType(layer.forward, m)
        report.swapped[name] = entry.kind

    # Attention through transformers' interfaces.
    attn = {name: (m, e) for name, (m, e) in entries.items() if e.kind == "attention"}
    if attn:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTN, _attention)
        AttentionMaskInterface.register(ATTN, _mask)
        report.original_attn = model.config._attn_implementation
        for name, (m, entry) in attn.items():
            vars(m)[_ATTR] = entry
            report.swapped[name] = "attention" + (" + kv_attention" if "kv_attention" in entry.more else "")
            if "qkv_rope" in entry.more:
                vars(m)["forward"] = types.MethodType(QKVAttentionLayer.forward, m)
                report.swapped[name] += " + rope"
        model.set_attn_implementation(ATTN)
    if strict and report.kept:
        name, why = next(iter(report.kept.items()))
        raise RuntimeError(f"kernelize(strict=True): {name} keeps its own forward: {why}")
    return ""


def _warm(model, device):
    """One tiny forward, so that first-call costs are paid inside kernelize."""
    if getattr(model, "main_input_name", None) != "input_ids":
        return
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device))


def _capture(model, report: Report, buckets, strict: bool) -> None:
    """kernelize's graphs: the served forward captured per bucket, or why not (strict raises)."""
    import inspect

    report.graphs = _graphs.GraphStats()
    why = ""
    if report.backend != "kernel-service":
        why = f"the backend is {report.backend!r}, not 'kernel-service'"
    elif _first_param(model).device.type != "cuda":
        why = "CUDA graphs need the model on a CUDA device"
    if not why:
        fixed = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
        try:
            _graphs.Graphs(model, buckets, fixed=fixed, stats=report.graphs).capture()
            gen = getattr(model, "generation_config", None)
            if gen is not None:
                gen.disable_compile = True  # generate would torch.compile the graphed forward
                if any(t == 1 for _, t in buckets) and gen.cache_implementation is None:
                    gen.cache_implementation = "static"  # decode steps are captured with a static cache
            return
        except Exception as exc:  # a forward that cannot be captured (a host read inside it, say)
            why = f"capture failed: {type(exc).__name__}: {exc}"
    report.graphs.reason = why
    if strict:
        raise RuntimeError(f"kernelize(strict=True): graphs were asked for and not captured: {why}")
    warnings.warn(f"kernelize: graphs not captured ({why}); the model runs without them", RuntimeWarning, stacklevel=3)


def kernelize(model, *, client=None, backend: str = "auto", strict: bool = False, warmup: bool = True, graphs=None):
    """Swaps a transformers model's norms, MLP activation, rotary and attention for served kernels, in place.

    backend: "kernel-service" (served kernels), "compile" (`model.compile()`), "eager" (nothing
    changes), or "auto": kernel-service on CUDA when the daemon serves the model's shapes, else
    compile on CUDA, else eager. A requested backend that is unavailable warns (RuntimeWarning,
    naming the backend used instead) and falls back. strict=True means that backend or an error:
    it raises instead, also for "auto" when it would not be kernel-service, and when a module
    would keep its own forward. client: a client.Client (default: the default connection).
    warmup: run one tiny forward before returning. graphs: (batch, tokens) buckets whose forward is
    captured in a CUDA graph at warm-up and replayed (client.integrations.graphs: calls are padded
    up to the smallest bucket that holds them; (batch, 1) is generate's decode step with a static
    cache, captured at its second call; others run uncaptured and are counted in
    `model.kernel_service.graphs`). Returns the model; `model.kernel_service`
    (a Report) says which backend was chosen, which modules were swapped and which kept, and
    counts the calls served and fallen back (eager calls).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    buckets = None if graphs is None else _graphs.buckets(graphs)
    param = _first_param(model)
    device, dtype = param.device, param.dtype
    cuda = device.type == "cuda"
    report = Report(requested=backend, strict=strict)
    chosen = backend
    if backend == "auto" and not cuda:
        chosen, report.reason = "eager", "auto: the model is not on a CUDA device"
        if strict:  # strict: the backend asked for, or an error; auto's is kernel-service
            raise RuntimeError(
                "kernelize(strict=True): backend 'auto' would be 'eager' (the model is not on a CUDA device); "
                "ask for backend='kernel-service' (float32 on the CPU) or 'eager', or strict=False"
            )
    elif backend in ("auto", "kernel-service"):
        why = _serve(model, report, client, strict, device, dtype)
        if not why:
            chosen = "kernel-service"
        else:
            chosen, report.reason = ("compile" if cuda else "eager"), f"kernel-service is unavailable: {why}"
            if strict:
                raise RuntimeError(f"kernelize(strict=True): backend {backend!r} would be {chosen!r}: kernel-service is unavailable: {why}")
            if backend == "kernel-service":
                warnings.warn(f"kernelize: backend 'kernel-service' is unavailable ({why}); using {chosen!r}", RuntimeWarning, stacklevel=2)
    if chosen == "compile":
        model.compile()
    report.backend = chosen
    model.kernel_service = report
    if warmup and chosen == "kernel-service":
        _warm(model, device)
    if buckets is not None:
        _capture(model, report, buckets, strict)
    return model


__all__ = ["BACKENDS", "Report", "kernelize"]
