"""Served kernels in Hugging Face transformers models: `kernelize(model)`.

    import client.integrations.hf as hf
    model = hf.kernelize(LlamaForCausalLM.from_pretrained(...).eval())   # backend="auto"
    model.kernel_service.backend, model.kernel_service.swapped, model.kernel_service.kept

What is swapped, through the conventions the HF ecosystem has (Hugging Face `kernels`
0.17.2 and transformers' attention interfaces), keeping the model's own weights:

- RMSNorm (transformers tags `LlamaRMSNorm` "RMSNorm") -> `rmsnorm`;
- the Llama MLP (`act(gate(x)) * up(x)` with SiLU; tagged here) -> `swiglu` between the
  model's own projections;
- `nn.LayerNorm` with weights (ModernBERT; tagged here, for this model's instances only) -> `layernorm`;
- rotary (transformers tags `apply_rotary_pos_emb` "rotary_pos_emb") -> `rope` with the model's
  own cos/sin as the cache;
- attention, registered as `AttentionInterface` / `AttentionMaskInterface` "kernel_service":
  `attention` for prefill and encoders, `kv_attention` for decode steps against a KV cache; padded
  batches are served one sequence at a time (eager only: reading the mask is data-dependent),
  ModernBERT's sliding-window layers where the window covers the sequence.

A shape, dtype, mask or option a kind does not serve keeps the module's own forward (attention:
transformers' `sdpa`), call by call; `strict=True` raises instead, naming the module and why.
Kernels are inference-only: in training mode, or when grad would be recorded, every module
runs its own forward. transformers shares `apply_rotary_pos_emb` between all models of a family,
so its swap is process-wide, for the head shapes and dtypes kernelized (the same math).

The project's own `kernels` package (the kinds) and Hugging Face's `kernels` share a top-level
name; importing this module loads Hugging Face's under that name just long enough for
transformers to bind it (see `_import_transformers`). Import this module before transformers'
model classes.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import importlib.util
import logging
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

BACKENDS = ("eager", "compile", "kernel-service", "auto")
ATTN = "kernel_service"  # the attention implementation's name (no "flash" or "sdpa": transformers special-cases those)
_ATTR = "_kernel_service"  # a served module's entry (not a parameter or buffer: the state dict is unchanged)
_ROPE: dict[tuple, "_Entry"] = {}  # (heads, kv_heads, head_dim, dtype, device type) -> the served rope


# ----- Hugging Face `kernels` next to the project's `kernels`


def _import_transformers():
    """Imports transformers' kernel hooks with Hugging Face's `kernels` bound, leaving `kernels` ours.

    Both distributions are imported as `kernels`; their submodules' names do not overlap
    (checked), so HF's live on in sys.modules as kernels.layer, kernels._rust, ... while
    `kernels` itself stays the project's package. Returns (hf kernels module, transformers hub_kernels).
    """
    hub = sys.modules.get("transformers.integrations.hub_kernels")
    if hub is not None and getattr(hub, "_hf_kernels", None) is not None:
        return hub._hf_kernels, hub
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("client.integrations.hf needs Hugging Face `kernels`: pip install 'kernel-service[hf]'") from None
    init = Path(dist.locate_file("kernels/__init__.py"))
    ours = sys.modules.get("kernels")
    if ours is None:
        import kernels as ours  # noqa: F811 (the project's kinds, imported by the client anyway)
    theirs = {f"kernels.{Path(str(f)).with_suffix('').parts[1]}" for f in dist.files or () if str(f).startswith("kernels/") and len(Path(str(f)).parts) > 2}
    clash = theirs & {name for name in sys.modules if name.startswith("kernels.")}
    if clash:
        raise ImportError(f"Hugging Face `kernels` and this project's `kernels` both have {sorted(clash)}: they cannot share a process")
    spec = importlib.util.spec_from_file_location("kernels", init, submodule_search_locations=[str(init.parent)])
    hf_kernels = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = hf_kernels
    try:
        spec.loader.exec_module(hf_kernels)
        import kernels.layer.layer  # noqa: F401  (everything kernelize() uses, imported while the name is HF's)
        import transformers.integrations.hub_kernels as hub
        import transformers.masking_utils  # noqa: F401
        import transformers.modeling_utils  # noqa: F401
    finally:
        sys.modules["kernels"] = ours
    hub._hf_kernels = hf_kernels
    return hf_kernels, hub


HF_KERNELS, _HUB = _import_transformers()


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


@dataclasses.dataclass(eq=False)
class _Entry:
    kind: str
    kernel: object  # client.Kernel
    report: Report
    dtype: torch.dtype
    device_type: str
    more: dict = dataclasses.field(default_factory=dict)  # attention: the kv_attention kernel


def _served(entry, module, *tensors):
    """The entry when this call can be served (inference, the kernel's dtype and device), else None."""
    if entry is None:
        return None
    x = tensors[0]
    ok = (
        not (module is not None and module.training)
        and x.dtype == entry.dtype
        and x.device.type == entry.device_type
        and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))
    )
    if not torch.compiler.is_compiling():
        (entry.report.calls if ok else entry.report.fallbacks)[entry.kind] += 1
    return entry if ok else None


# ----- the layers (HF `kernels` layer classes: no __init__, no state, a forward and two flags)


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


class RotaryLayer(nn.Module):
    can_torch_compile = True
    has_backward = False

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        entry = None
        if unsqueeze_dim == 1 and q.dim() == 4 and cos.dim() == 3 and cos.shape[-1] == q.shape[-1] and cos.shape[0] in (1, q.shape[0]):
            entry = _served(_ROPE.get((q.shape[1], k.shape[1], q.shape[-1], q.dtype, q.device.type)), None, q, k)
        if entry is None:
            return type(self).forward(self, q, k, cos, sin, unsqueeze_dim)
        b, h, s, d = q.shape
        kvh = k.shape[1]
        # The kernel's cache is [rows, cos | sin] (vLLM's layout); each token's own row is its cos/sin.
        cache = torch.cat((cos[..., : d // 2], sin[..., : d // 2]), dim=-1).reshape(-1, d).to(q.dtype)
        positions = torch.arange(cache.shape[0], device=q.device)
        if cos.shape[0] != b:
            positions = positions.repeat(b)
        qo, ko = entry.kernel(positions, q.transpose(1, 2).reshape(b * s, h, d).contiguous(), k.transpose(1, 2).reshape(b * s, kvh, d).contiguous(), cache.contiguous())
        return qo.view(b, s, h, d).transpose(1, 2), ko.view(b, s, kvh, d).transpose(1, 2)


# ----- attention


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, local_size=None,
          allow_is_causal_skip=True, allow_is_bidirectional_skip=False, **kwargs):
    """sdpa's mask, except that a plain causal or full pattern with no padding is None even while
    tracing (torch < 2.14 materializes it under torch.compile): the served kernels need no mask."""
    from transformers.masking_utils import sdpa_mask

    plain = (allow_is_causal_skip and (q_length == 1 or q_length == kv_length)) or allow_is_bidirectional_skip
    if attention_mask is None and plain and (local_size is None or kv_length <= local_size) and not isinstance(q_offset, torch.Tensor):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size=local_size,
                     allow_is_causal_skip=allow_is_causal_skip, allow_is_bidirectional_skip=allow_is_bidirectional_skip, **kwargs)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query [B, Hq, S, D], key/value [B, Hkv, L, D] -> ([B, S, Hq, D], None)."""
    entry = module.__dict__.get(_ATTR)
    d = query.shape[-1]
    if entry is not None and (
        dropout or (scaling is not None and abs(scaling - d**-0.5) > 1e-6 * d**-0.5)
        or kwargs.get("softcap") is not None or kwargs.get("output_attentions") or kwargs.get("s_aux") is not None
    ):
        entry = None
    entry = _served(entry, module, query, key, value)
    out, kind = (None, None) if entry is None else _serve_attention(entry, module, query, key, value, attention_mask, kwargs.get("sliding_window"))
    if out is not None:
        if kind != entry.kind and not torch.compiler.is_compiling():  # counted as attention above
            entry.report.calls[entry.kind] -= 1
            entry.report.calls[kind] += 1
        return out, None
    if entry is not None and not torch.compiler.is_compiling():  # counted as served above: it was not
        entry.report.calls[entry.kind] -= 1
        entry.report.fallbacks[entry.kind] += 1
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _serve_attention(entry, module, query, key, value, mask, sliding_window):
    b, h, q, d = query.shape
    kv = key.shape[2]
    causal = bool(getattr(module, "is_causal", False))
    attn, kv_attn = entry.kernel, entry.more.get("kv_attention")
    Q, K, V = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D] views
    if mask is None:
        if sliding_window is not None and kv > sliding_window:
            return None, None
        if q == kv:
            return attn(Q.contiguous(), K.contiguous(), V.contiguous()), "attention"
        if causal and kv_attn is not None and q == 1:  # decode: one query at the end of the cache
            return kv_attn(Q.contiguous(), K.contiguous(), V.contiguous(), torch.full((b,), kv, dtype=torch.int32, device=query.device)), "kv_attention"
        return None, None
    if torch.compiler.is_compiling() or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None, None  # reading the mask would be data-dependent: a traced call keeps sdpa
    # Padding, one sequence at a time: each row's keys must be one run [lo, hi) and its mask exactly
    # that run (causal: up to the query's own position). Padded queries get zeros (HF's are meaningless).
    out, kind = query.new_zeros(b, q, h, d), "attention"
    off = kv - q
    i = torch.arange(q, device=mask.device)[:, None]
    j = torch.arange(kv, device=mask.device)[None, :]
    for row in range(b):
        m = mask[row, 0].expand(q, kv)
        keys = m.any(0).nonzero()
        if keys.numel() == 0:
            continue
        lo, hi = int(keys[0]), int(keys[-1]) + 1
        if causal:
            r0, r1 = max(0, lo - off), hi - off
            if r1 <= r0 or not torch.equal(m[r0:r1], ((j >= lo) & (j <= i + off))[r0:r1]):
                return None, None
        else:
            r0, r1 = lo, hi
            if q != kv or not torch.equal(m[lo:hi], ((j >= lo) & (j < hi)).expand(q, kv)[lo:hi]):
                return None, None
        qs, ks, vs = (t[row : row + 1, a:z].contiguous() for t, a, z in ((Q, r0, r1), (K, lo, hi), (V, lo, hi)))
        if r1 - r0 == hi - lo:
            out[row, r0:r1] = attn(qs, ks, vs)[0]
            kind = "attention"
        elif causal and kv_attn is not None and r1 - r0 == 1 == q:
            out[row, r0:r1] = kv_attn(qs, ks, vs, torch.full((1,), hi - lo, dtype=torch.int32, device=query.device))[0]
            kind = "kv_attention"
        else:
            return None, None
    return out, kind


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
        "rope": {_code(_func_of(llama.apply_rotary_pos_emb)), _code(_func_of(modernbert.apply_rotary_pos_emb))},
    }


def _func_of(func_module):
    for cell in func_module.__class__.forward.__closure__ or ():
        if callable(cell.cell_contents):
            return cell.cell_contents
    raise RuntimeError(f"cannot find the function inside {func_module!r}")


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
            if m.is_causal:
                plans.append((name, m, "kv_attention", {"batch": None, "q_len": 1, **shape}))  # decode (split-KV); longer query chunks keep sdpa
            funcs = vars(m).get("_kernel_funcs", {})
            for fname, fn in list(funcs.items()):
                # A deep copy of the model copies these into each module, while its forward calls the
                # modeling module's own: point them back at that one, or the swap would be a no-op.
                # (kernels makes a class per decorated function: the shared one is the global of that class.)
                shared = [v for v in vars(sys.modules.get(cls.__module__, object)).values() if type(v) is type(fn)]
                if len(shared) == 1 and shared[0] is not fn:
                    funcs[fname] = fn = shared[0]
                if getattr(fn, "kernel_layer_name", None) == "rotary_pos_emb":
                    if _code(_func_of(fn)) in known["rope"]:
                        rotary.setdefault(tuple(shape.values()), (f"{name}.rotary_pos_emb", fn, shape))
                    else:
                        kept[f"{name}.rotary_pos_emb"] = "not a rotary form this integration knows"
    for key, (name, fn, shape) in rotary.items():
        plans.append((name, fn, "rope", {"tokens": None, "max_position": None, "style": "neox", **shape}))
    for i, (name, m, kind, params) in enumerate(plans):
        plans[i] = (name, m, kind, {**params, "dtype": dtype, "target": target})
    return plans, kept


def _first_param(model):
    try:
        return next(model.parameters())
    except StopIteration:
        raise ValueError("kernelize: the model has no parameters") from None


def _hooks_live(hub) -> str:
    if not getattr(hub, "_kernels_enabled", False) or not hasattr(hub, "_kernels_kernelize"):
        return "transformers' kernel hooks are off (USE_HUB_KERNELS, or a `kernels` release this transformers does not take): its layers are not tagged"
    return ""


def _key(kind, params):
    return kind, tuple(sorted((k, str(v)) for k, v in params.items()))


@dataclasses.dataclass(frozen=True)
class _Repo:
    """A `kernels` repository (any hashable with load() -> layer class): the layer, with no Hub access."""

    layer_name: str
    layer: type

    def load(self):
        return self.layer


_LAYERS = {"rmsnorm": RMSNormLayer, "swiglu": SwiGLUMLPLayer, "layernorm": LayerNormLayer, "rope": RotaryLayer}
_OUR_TAGS = {"swiglu": "KernelServiceSwiGLUMLP", "layernorm": "KernelServiceLayerNorm"}  # for classes transformers leaves untagged


def _is_ours(m) -> bool:
    return _ATTR in vars(m)


def _serve(model, report: Report, client, strict: bool, device: torch.device, dtype: torch.dtype) -> str:
    """Swaps what can be served; returns why nothing could be ('' when something was)."""
    if model.training:
        return "the model is in training mode (served kernels are inference-only; call model.eval() first)"
    why = _hooks_live(_HUB)
    if why:
        return why
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
        if kind == "kv_attention":
            if not isinstance(got, Exception) and name in entries:
                entries[name][1].more["kv_attention"] = got
        elif isinstance(got, Exception):
            report.kept[name] = f"{kind} is not served: {got}"
        else:
            entries[name] = (m, _Entry(kind, got, report, dtype, device.type, {"params": params}))
    if strict and report.kept:
        name, why = next(iter(report.kept.items()))
        raise RuntimeError(f"kernelize(strict=True): {name} would keep its own forward: {why}")
    if not entries:
        return "no module of this model is served: " + "; ".join(f"{n}: {w}" for n, w in report.kept.items()) if report.kept else "no module this integration knows"

    # Tag the classes transformers leaves untagged (only this model's planned instances pass the condition).
    layer_names = {}
    for name, (m, entry) in entries.items():
        if entry.kind == "attention":
            continue
        cls = type(m)
        if not hasattr(cls, "kernel_layer_name"):
            HF_KERNELS.replace_kernel_forward_from_hub(cls, _OUR_TAGS[entry.kind], condition=_is_ours)
        layer_names[cls.kernel_layer_name] = entry.kind
        if entry.kind == "rope":
            p = entry.more["params"]
            _ROPE[(p["heads"], p["kv_heads"], p["head_dim"], dtype, device.type)] = entry
        else:
            vars(m)[_ATTR] = entry
    mapping = {layer: {device.type: _Repo(layer, _LAYERS[kind])} for layer, kind in layer_names.items()}
    quiet = logging.getLogger("kernels.layer.layer")  # it warns for every tagged layer our mapping leaves out (SiLU, ...)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with HF_KERNELS.use_kernel_mapping(mapping, inherit_mapping=False):
            HF_KERNELS.kernelize(model, mode=HF_KERNELS.Mode.INFERENCE | HF_KERNELS.Mode.TORCH_COMPILE, device=device.type)
    finally:
        quiet.setLevel(level)
    for name, (m, entry) in entries.items():
        if entry.kind == "attention":
            continue
        layer = _LAYERS[entry.kind]
        if getattr(vars(m).get("forward"), "__func__", None) is layer.forward:
            report.swapped[name] = entry.kind
        else:
            vars(m).pop(_ATTR, None)
            report.kept[name] = "the kernels hook did not replace its forward"
    # Tagged modules kernels replaced but nothing serves (another model's layer names): their own forward again.
    for _, m in model.named_modules():
        fwd = vars(m).get("forward")
        if fwd is not None and getattr(fwd, "__func__", None) in {l.forward for l in _LAYERS.values()} and not _is_ours(m) and type(m).__name__ != "Func":
            del vars(m)["forward"]

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


def kernelize(model, *, client=None, backend: str = "auto", strict: bool = False, warmup: bool = True):
    """Swaps a transformers model's norms, MLP activation, rotary and attention for served kernels, in place.

    backend: "kernel-service" (served kernels), "compile" (`model.compile()`), "eager" (nothing
    changes), or "auto": kernel-service on CUDA when the daemon serves the model's shapes, else
    compile on CUDA, else eager. A requested backend that is unavailable warns (RuntimeWarning,
    naming the backend used instead) and falls back; strict=True raises instead, and also when a
    module would keep its own forward. client: a client.Client (default: the default connection).
    warmup: run one tiny forward before returning. Returns the model; `model.kernel_service`
    (a Report) says which backend was chosen, which modules were swapped and which kept, and
    counts the calls served and fallen back (eager calls).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    param = _first_param(model)
    device, dtype = param.device, param.dtype
    cuda = device.type == "cuda"
    report = Report(requested=backend)
    chosen = backend
    if backend == "auto" and not cuda:
        chosen, report.reason = "eager", "auto: the model is not on a CUDA device"
    elif backend in ("auto", "kernel-service"):
        why = _serve(model, report, client, strict, device, dtype)
        if not why:
            chosen = "kernel-service"
        else:
            chosen, report.reason = ("compile" if cuda else "eager"), f"kernel-service is unavailable: {why}"
            if backend == "kernel-service":
                if strict:
                    raise RuntimeError(f"kernelize(strict=True): backend 'kernel-service' is unavailable: {why}")
                warnings.warn(f"kernelize: backend 'kernel-service' is unavailable ({why}); using {chosen!r}", RuntimeWarning, stacklevel=2)
    if chosen == "compile":
        model.compile()
    report.backend = chosen
    model.kernel_service = report
    if warmup and chosen == "kernel-service":
        _warm(model, device)
    return model


__all__ = ["BACKENDS", "Report", "kernelize"]
