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
  its `Wo` GEMM (accumulated onto that sum, a tensor the layer owns); Llama's decoder layer (and
  its modular copies) the same way, `add_rmsnorm` for `post_attention_layernorm`, `down_proj`'s GEMM;
- rotary (the modeling module's `apply_rotary_pos_emb`, replaced by a wrapper) -> `rope` with the
  model's own cos/sin as the cache;
- an attention module with one fused QKV projection (ModernBERT's `Wqkv`) is swapped whole:
  `rope` packed reads Q and K in `Wqkv`'s output and copies V out beside them (`v_out`), one
  launch, then the attention below and the module's own `Wo`;
- attention, registered as `AttentionInterface` / `AttentionMaskInterface` "kernel_service":
  `attention` for prefill and encoders, `kv_attention` for decode steps against a KV cache. A
  padded batch (and ModernBERT's sliding-window layers, at any length) is one `attention` call
  with `varlen=True` (each sequence's key range, read off the mask) and the layer's `window`;
  eager only: reading the mask is data-dependent. A masked decode step is one `kv_attention` call,
  each sequence's keys gathered to the front of its cache (`kv_attention` reads keys from 0).

A shape, dtype, mask or option a kind does not serve keeps the module's own forward (attention:
transformers' `sdpa`), call by call; `strict=True` raises instead, naming the module and why.
Kernels are inference-only: in training mode, or when grad would be recorded, every module
runs its own forward. transformers shares `apply_rotary_pos_emb` between all models of a family,
so its swap is process-wide, for the head shapes and dtypes kernelized (the same math).

The package: `plan` (a table of rules: module -> kind, params, layer), `serve` (one prefetch, the
entries, the swap), `served` (the typed entries, `ServedModule` / `ServedAttention`, and the
per-call check), `layers`, `attention` (mask parsing, varlen ranges, decode), `rope`, `backends`
(`kernelize`: the backend policy around plan -> serve -> warm), `report` (`Report`), `graphs` (CUDA graphs per bucket, `kernelize(graphs=...)`).

Hugging Face's `kernels` distribution is not used: it and this project's `kernels` package (the
kinds) share a top-level name and cannot be installed together.
"""

from __future__ import annotations

from .compat import check_transformers

check_transformers()

from . import attention, graphs, rope, served  # noqa: E402, F401  (after the check; tests reach ATTR, ROPE and the interfaces here)
from .attention import ATTN  # noqa: E402
from .backends import BACKENDS, kernelize  # noqa: E402
from .layers import DecoderLayer, EncoderLayer, GeGLUMLPLayer, LayerNormLayer, QKVAttentionLayer, RMSNormLayer, SwiGLUMLPLayer  # noqa: E402
from .graphs import GraphStats  # noqa: E402
from .report import Report  # noqa: E402
from .rope import RotaryLayer  # noqa: E402
from .served import GRAD_WARNING, ServedAttention, ServedModule  # noqa: E402

__all__ = [
    "ATTN",
    "BACKENDS",
    "GRAD_WARNING",
    "DecoderLayer",
    "EncoderLayer",
    "GeGLUMLPLayer",
    "GraphStats",
    "LayerNormLayer",
    "QKVAttentionLayer",
    "RMSNormLayer",
    "Report",
    "RotaryLayer",
    "ServedAttention",
    "ServedModule",
    "SwiGLUMLPLayer",
    "kernelize",
]
