"""Which module gets which kernel: a table of rules, each a match on the module's computation ->
kind, params and the layer whose forward the module takes."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable

import torch
from torch import nn

from .layers import DecoderLayer, EncoderLayer, GeGLUMLPLayer, LayerNormLayer, RMSNormLayer, SwiGLUMLPLayer
from .rope import unwrapped


@dataclasses.dataclass(frozen=True)
class Plan:
    """One kernel kernelize asks for, and where it goes."""

    name: str  # the module's name in the model (the process-wide rope: "<first attention>.rotary_pos_emb")
    target: object  # the module, or (process-wide rope) the modeling modules whose apply_rotary_pos_emb it replaces
    kind: str
    params: dict
    layer: type | None = None  # whose forward the module takes (None: attention, or a rider)
    rider: str = ""  # a ServedAttention field this kernel fills, riding on its module's attention ("": a kernel of its own)


@dataclasses.dataclass(frozen=True)
class Rule:
    """Modules `matches` accepts take `layer`'s forward over `kind` with `params(module)`, or keep
    their own forward when `params` says why (a str)."""

    matches: Callable[[nn.Module], bool]
    kind: str
    params: Callable[[nn.Module], dict | str]
    layer: type | None


def _code(fn):
    c = fn.__code__
    return c.co_code, c.co_consts, c.co_names


@functools.cache
def _known():
    """The forwards whose computation the layers reproduce (by bytecode: modular copies match)."""
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.modernbert import modeling_modernbert as modernbert

    return {
        "rmsnorm": {_code(llama.LlamaRMSNorm.forward)},
        "swiglu": {_code(llama.LlamaMLP.forward)},
        "decoder_layer": {_code(llama.LlamaDecoderLayer.forward)},
        "geglu": {_code(modernbert.ModernBertMLP.forward)},
        "encoder_layer": {_code(modernbert.ModernBertEncoderLayer.forward)},
        "qkv_attention": {_code(modernbert.ModernBertAttention.forward)},
        "rope": {_code(unwrapped(llama.apply_rotary_pos_emb)), _code(unwrapped(modernbert.apply_rotary_pos_emb))},
    }


def _forward(m):
    fwd = getattr(type(m), "forward", None)
    return fwd if hasattr(fwd, "__code__") else None


def computes(form):
    """A match: the module's class forward is transformers' `form` (`_known`)."""
    return lambda m: (fwd := _forward(m)) is not None and _code(fwd) in _known()[form]


def _gelu_form(act):
    """F.gelu's `approximate` when `act` (a transformers activation module) is exactly torch's GELU, else None."""
    fn = getattr(act, "act", None)
    if fn is torch.nn.functional.gelu:
        return "none"
    if isinstance(fn, functools.partial) and fn.func is torch.nn.functional.gelu and not fn.args and fn.keywords == {"approximate": "tanh"}:
        return "tanh"
    return None


def _rmsnorm(m):
    return {"M": None, "N": m.weight.shape[-1], "eps": float(m.variance_epsilon)}


def _swiglu(m):
    act = getattr(m.config, "hidden_act", None)
    if act not in ("silu", "swish"):
        return f"activation {act!r} is not SiLU (swiglu serves silu(gate) * up)"
    return {"M": None, "N": m.gate_proj.out_features}


def _geglu(m):
    approximate = _gelu_form(m.act)
    if approximate is None:
        return f"activation {type(m.act).__name__} is not torch's GELU (geglu serves F.gelu, exact or tanh)"
    return {"M": None, "N": m.Wo.in_features, "packed": True, "approximate": approximate}


def _residual_layernorm(m):
    norm = m.mlp_norm
    if type(norm) is not nn.LayerNorm or norm.weight is None or len(norm.normalized_shape) != 1:
        return "mlp_norm is not a layernorm with weights over one dim (the residual add is fused into it)"
    return {"M": None, "N": norm.normalized_shape[0], "eps": float(norm.eps), "bias": norm.bias is not None, "residual": True}


def _residual_rmsnorm(m):
    norm = m.post_attention_layernorm
    if not computes("rmsnorm")(norm):
        return "post_attention_layernorm is not Llama's RMSNorm (the residual add is fused into it)"
    return _rmsnorm(norm)


def _layernorm(m):
    if m.weight is None or len(m.normalized_shape) != 1:
        return "layernorm serves one normalized dim with weights"
    return {"M": None, "N": m.normalized_shape[0], "eps": float(m.eps), "bias": m.bias is not None}


def _is_attention(m):
    return hasattr(m, "head_dim") and hasattr(m, "is_causal") and hasattr(m, "config")


def _heads(m):
    heads = m.config.num_attention_heads
    return {"heads": heads, "kv_heads": getattr(m.config, "num_key_value_heads", None) or heads, "head_dim": m.head_dim}


def _attention(m):
    return {"batch": None, "seq_len": None, "causal": bool(m.is_causal), **_heads(m)}


RULES = (  # the first rule that matches a module decides
    Rule(computes("rmsnorm"), "rmsnorm", _rmsnorm, RMSNormLayer),
    Rule(computes("swiglu"), "swiglu", _swiglu, SwiGLUMLPLayer),
    Rule(computes("geglu"), "geglu", _geglu, GeGLUMLPLayer),
    Rule(computes("encoder_layer"), "layernorm", _residual_layernorm, EncoderLayer),
    Rule(computes("decoder_layer"), "add_rmsnorm", _residual_rmsnorm, DecoderLayer),
    Rule(lambda m: type(m) is nn.LayerNorm, "layernorm", _layernorm, LayerNormLayer),
    Rule(_is_attention, "attention", _attention, None),  # through transformers' interfaces, with _attention_riders
)


def _attention_riders(name, m, rotary: dict, kept: dict) -> list[Plan]:
    """The kernels riding on an attention module's: varlen, decode, and a fused-QKV module's rope.
    The rope its modeling module's `apply_rotary_pos_emb` takes goes into `rotary` (per head
    shape), or why not into `kept`."""
    shape = _heads(m)
    # Padded batches and sliding windows: one call with each sequence's key range. ModernBERT's
    # sliding layers keep `sliding_window` = window + 1 (flash's inclusive convention).
    window = (getattr(m, "sliding_window", None) or 1) - 1
    riders = [
        Plan(name, m, "attention", {"batch": None, "seq_len": None, "causal": bool(m.is_causal), "varlen": True, "window": window, **shape}, rider="varlen")
    ]
    if m.is_causal:  # decode (split-KV); longer query chunks keep sdpa
        riders.append(Plan(name, m, "kv_attention", {"batch": None, "q_len": 1, **shape}, rider="kv_attention"))
    # The attention forward calls its modeling module's global `apply_rotary_pos_emb`.
    modeling = sys.modules.get(type(m).__module__)
    fn = getattr(modeling, "apply_rotary_pos_emb", None)
    if fn is None or "apply_rotary_pos_emb" not in getattr(getattr(_forward(m), "__code__", None), "co_names", ()):
        return riders
    if _code(unwrapped(fn)) not in _known()["rope"]:
        kept[f"{name}.rotary_pos_emb"] = "not a rotary form this integration knows"
        return riders
    slot = rotary.setdefault(tuple(shape.values()), [f"{name}.rotary_pos_emb", set(), shape])
    slot[1].add(modeling)
    if computes("qkv_attention")(m):  # the whole module: QKVAttentionLayer
        riders.append(Plan(name, m, "rope", {"tokens": None, "max_position": None, "style": "neox", "packed": True, "v_out": True, **shape}, rider="qkv_rope"))
    return riders


def plan(model, dtype, target) -> tuple[list[Plan], dict]:
    """A Plan for every kernel kernelize could serve, and why the modules a rule matched but
    cannot serve keep their own forward (module name -> why)."""
    plans, kept, rotary = [], {}, {}
    for name, m in model.named_modules():
        rule = next((r for r in RULES if r.matches(m)), None)
        if rule is None:
            continue
        params = rule.params(m)
        if isinstance(params, str):
            kept[name] = params
            continue
        plans.append(Plan(name, m, rule.kind, params, rule.layer))
        if rule.kind == "attention":
            plans += _attention_riders(name, m, rotary, kept)
    for name, modelings, shape in rotary.values():
        plans.append(Plan(name, modelings, "rope", {"tokens": None, "max_position": None, "style": "neox", **shape}))
    return [dataclasses.replace(p, params={**p.params, "dtype": dtype, "target": target}) for p in plans], kept
