"""The layers whose forwards served modules take (the HF `kernels` layer contract, `ServedLayer`):
each falls back to the module's own forward when a call is not served."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .attention import attention
from .rope import rope_fits, rope_rows
from .served import ATTR, ServedLayer, module_entry, served


class RMSNormLayer(ServedLayer):
    def forward(self, hidden_states):
        entry = module_entry(self, hidden_states, self.weight)
        if entry is None:
            return type(self).forward(self, hidden_states)
        n = hidden_states.shape[-1]
        return entry.kernel(hidden_states.reshape(-1, n).contiguous(), self.weight).view(hidden_states.shape)


class LayerNormLayer(ServedLayer):
    def forward(self, input):
        entry = module_entry(self, input, self.weight, self.bias)
        if entry is None:
            return type(self).forward(self, input)
        n = input.shape[-1]
        args = (input.reshape(-1, n).contiguous(), self.weight) + ((self.bias,) if self.bias is not None else ())
        return entry.kernel(*args).view(input.shape)


class EncoderLayer(ServedLayer):
    """ModernBERT's encoder layer (`h += attn(attn_norm(h)); h += mlp(mlp_norm(h))`) without its two
    residual adds: `layernorm` with `residual` takes the attention output and the layer's input and
    writes their sum and its norm, and the MLP adds onto that sum in place (add_mlp)."""

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        entry = module_entry(self, hidden_states, self.mlp_norm.weight)
        if entry is None:
            return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings, **kwargs)
        attn_output, _ = self.attn(self.attn_norm(hidden_states), position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        return norm_and_mlp(entry, self.mlp_norm, self.mlp, attn_output, hidden_states)


class DecoderLayer(ServedLayer):
    """Llama's decoder layer (`h += attn(input_norm(h)); h += mlp(post_attention_norm(h))`) without
    its two residual adds: `add_rmsnorm` takes the attention output and the layer's input and writes
    their sum and its norm (vLLM's fused_add_rms_norm), and the MLP adds onto that sum in place."""

    def forward(self, hidden_states, **kwargs):  # LlamaModel passes the rest by keyword
        entry = module_entry(self, hidden_states, self.post_attention_layernorm.weight)
        if entry is None:
            return type(self).forward(self, hidden_states, **kwargs)
        attn_output, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        return norm_and_mlp(entry, self.post_attention_layernorm, self.mlp, attn_output, hidden_states)


def norm_and_mlp(entry, norm, mlp, attn_output, hidden_states):
    """`h = hidden_states + attn_output; h + mlp(norm(h))` with no add of its own: `entry`'s kernel
    (a norm with `residual`) writes h and norm(h) in one pass, and add_mlp accumulates onto h."""
    n = hidden_states.shape[-1]
    bias = (norm.bias,) if getattr(norm, "bias", None) is not None else ()
    normed, summed = entry.kernel(attn_output.reshape(-1, n), hidden_states.reshape(-1, n), norm.weight, *bias)
    return add_mlp(mlp, normed, summed).view(hidden_states.shape)


def add_mlp(mlp, x, out):
    """out += mlp(x), in place (`out`: a tensor the caller owns). A served GLU MLP's output GEMM
    accumulates onto `out` itself (addmm_: the GEMM's epilogue adds), instead of a separate add."""
    entry = mlp.__dict__.get(ATTR)
    glu = _GLU.get(getattr(entry, "kind", None))
    if glu is None or type(getattr(mlp, glu.out)) is not nn.Linear:
        return out.add_(mlp(x).view(out.shape))  # its own forward, served or not, counts itself
    if served(entry, mlp, x, getattr(mlp, glu.into).weight) is None:
        return out.add_(type(mlp).forward(mlp, x).view(out.shape))  # counted as a fallback just now
    act, proj = glu.layer.act(mlp, entry, x), getattr(mlp, glu.out)
    out.addmm_(act.reshape(-1, act.shape[-1]), proj.weight.t())
    return out if proj.bias is None else out.add_(proj.bias)


class SwiGLUMLPLayer(ServedLayer):
    def forward(self, x):
        entry = module_entry(self, x, self.gate_proj.weight)
        if entry is None:
            return type(self).forward(self, x)
        return self.down_proj(SwiGLUMLPLayer.act(self, entry, x))

    @staticmethod
    def act(mlp, entry, x):
        """silu(gate_proj(x)) * up_proj(x): what down_proj reads."""
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        n = gate.shape[-1]
        return entry.kernel(gate.reshape(-1, n), up.reshape(-1, n)).view(gate.shape)


class GeGLUMLPLayer(ServedLayer):
    """ModernBERT's MLP: Wi's output is [input | gate] along the last dim, the packed layout."""

    def forward(self, hidden_states):
        entry = module_entry(self, hidden_states, self.Wi.weight)
        if entry is None:
            return type(self).forward(self, hidden_states)
        return self.Wo(GeGLUMLPLayer.act(self, entry, hidden_states))  # dropout: identity in eval

    @staticmethod
    def act(mlp, entry, x):
        """gelu(input) * gate of Wi(x) = [input | gate]: what Wo reads."""
        h = mlp.Wi(x)
        n = h.shape[-1]
        return entry.kernel(h.reshape(-1, n)).view(*h.shape[:-1], n // 2)


@dataclasses.dataclass(frozen=True)
class _Glu:
    layer: type  # its `act`: the activation the output projection reads
    into: str  # the projection whose weight the call is checked against
    out: str  # the output projection (add_mlp's GEMM)


_GLU = {"swiglu": _Glu(SwiGLUMLPLayer, "gate_proj", "down_proj"), "geglu": _Glu(GeGLUMLPLayer, "Wi", "Wo")}


class QKVAttentionLayer(ServedLayer):
    """ModernBERT's attention module (one fused `Wqkv` projection): `rope` packed reads Q and K where
    `Wqkv` wrote them and copies V out beside them (`v_out`), in one launch, so the attention kernel
    gets three contiguous tensors with no copy in between; then the module's own `Wo`."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        entry = self.__dict__.get(ATTR)
        cos, sin = position_embeddings
        b, s = hidden_states.shape[:2]
        h, d = self.config.num_attention_heads, self.head_dim
        # Counted as rope here: the attention below, or the module's own forward, counts itself.
        if not rope_fits(cos, b, d) or served(entry, self, hidden_states, self.Wqkv.weight, count=False) is None:
            return type(self).forward(self, hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        if not torch.compiler.is_compiling():
            entry.report.calls["rope"] += 1
        qkv = self.Wqkv(hidden_states)
        positions, cache = rope_rows(cos, sin, b, qkv.dtype)
        q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in entry.qkv_rope(positions, qkv.view(b * s, 3 * h, d), cache))
        out, _ = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=d**-0.5, sliding_window=self.sliding_window, **kwargs)
        return self.out_drop(self.Wo(out.reshape(b, s, -1))), None
