"""Rotary: the modeling module's `apply_rotary_pos_emb`, replaced process-wide by a wrapper that
serves `rope` with the model's own cos/sin as the cache rows."""

from __future__ import annotations

import functools

import torch

from .per_forward import per_forward
from .served import ServedLayer, served

ROPE: dict[tuple, dict[tuple, object]] = {}  # (heads, kv_heads, head_dim) -> (dtype, device type) -> the served rope


class RotaryLayer(ServedLayer):
    """Bound to the modeling module's own `apply_rotary_pos_emb` (`self`), which is its fallback."""

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        # A kernelized model's heads: its entry, or one of another dtype or device, whose fallback
        # `served` counts. Heads no kernelized model has are another model's call: not counted.
        by_dtype = ROPE.get((q.shape[1], k.shape[1], q.shape[-1]), {}) if q.dim() == 4 else {}
        entry = by_dtype.get((q.dtype, q.device.type)) or next(iter(by_dtype.values()), None)
        if entry is not None and not (unsqueeze_dim == 1 and rope_fits(cos, q.shape[0], q.shape[-1])):
            if not torch.compiler.is_compiling():
                entry.report.fallbacks[entry.kind] += 1
            entry = None
        entry = served(entry, None, q, k)
        if entry is None:
            return self(q, k, cos, sin, unsqueeze_dim)
        b, h, s, d = q.shape
        kvh = k.shape[1]
        positions, cache = rope_rows(cos, sin, b, q.dtype)
        qo, ko = entry.kernel(positions, q.transpose(1, 2).reshape(b * s, h, d).contiguous(), k.transpose(1, 2).reshape(b * s, kvh, d).contiguous(), cache)
        return qo.view(b, s, h, d).transpose(1, 2), ko.view(b, s, kvh, d).transpose(1, 2)


def rope_fits(cos, batch, head_dim) -> bool:
    """Whether transformers' cos/sin ([batch or 1, seq, head_dim]) become `rope`'s cache rows (rope_rows)."""
    return cos.dim() == 3 and cos.shape[-1] == head_dim and cos.shape[0] in (1, batch)


def rope_rows(cos, sin, batch, dtype):
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
    return per_forward(cos, ("rope rows", id(sin), batch, dtype), lambda: (sin, *compute()))[1:]


def unwrapped(fn):
    """A modeling module's own `apply_rotary_pos_emb`, also after kernelize replaced it."""
    return getattr(fn, "__wrapped__", fn)


def _rotary(original):
    """The replacement for a modeling module's `apply_rotary_pos_emb`: RotaryLayer.forward bound to it."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        return RotaryLayer.forward(original, q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.kernel_service = True
    return apply_rotary_pos_emb


def install(entry, heads: tuple, modelings):
    """Serves `entry` for (heads, kv_heads, head_dim) `heads` through every modeling module's
    global, process-wide: transformers' attention calls the module's `apply_rotary_pos_emb`."""
    ROPE.setdefault(heads, {})[(entry.dtype, entry.device_type)] = entry
    for modeling in modelings:
        if not getattr(modeling.apply_rotary_pos_emb, "kernel_service", False):
            modeling.apply_rotary_pos_emb = _rotary(modeling.apply_rotary_pos_emb)
