"""The layers whose forwards served modules take (the HF `kernels` layer contract, `ServedLayer`):
each falls back to the module's own forward when a call is not served."""

from __future__ import annotations

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
        n, norm = hidden_states.shape[-1], self.mlp_norm
        bias = (norm.bias,) if norm.bias is not None else ()
        normed, summed = entry.kernel(attn_output.reshape(-1, n), hidden_states.reshape(-1, n), norm.weight, *bias)
        return add_mlp(self.mlp, normed, summed).view(hidden_states.shape)


def add_mlp(mlp, x, out):
    """out += mlp(x), in place (`out`: a tensor the caller owns). A served GLU MLP's `Wo` GEMM
    accumulates onto `out` itself (addmm_: the GEMM's epilogue adds), instead of a separate add."""
    entry = mlp.__dict__.get(ATTR)
    entry = served(entry, mlp, x, mlp.Wi.weight) if entry is not None and entry.kind == "geglu" and type(mlp.Wo) is nn.Linear else None
    if entry is None:
        return out.add_(mlp(x).view(out.shape))
    h = mlp.Wi(x)
    out.addmm_(entry.kernel(h.reshape(-1, h.shape[-1])), mlp.Wo.weight.t())  # dropout: identity in eval
    return out if mlp.Wo.bias is None else out.add_(mlp.Wo.bias)


class SwiGLUMLPLayer(ServedLayer):
    def forward(self, x):
        entry = module_entry(self, x, self.gate_proj.weight)
        if entry is None:
            return type(self).forward(self, x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        n = gate.shape[-1]
        return self.down_proj(entry.kernel(gate.reshape(-1, n), up.reshape(-1, n)).view(gate.shape))


class GeGLUMLPLayer(ServedLayer):
    """ModernBERT's MLP: Wi's output is [input | gate] along the last dim, the packed layout."""

    def forward(self, hidden_states):
        entry = module_entry(self, hidden_states, self.Wi.weight)
        if entry is None:
            return type(self).forward(self, hidden_states)
        x = self.Wi(hidden_states)
        n = x.shape[-1]
        return self.Wo(entry.kernel(x.reshape(-1, n)).view(*x.shape[:-1], n // 2))  # dropout: identity in eval


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
