"""Serving a plan: its kernels fetched in one prefetch, each module's entry made, and the swap."""

from __future__ import annotations

import dataclasses
import types

import torch

from . import attention, rope
from .layers import QKVAttentionLayer
from .plan import Plan, plan
from .report import Report
from .served import ATTR, ServedAttention, ServedModule


def serve(model, report: Report, client, strict: bool, device: torch.device, dtype: torch.dtype, whole: bool = False) -> str:
    """Swaps what can be served; returns why nothing could be ('' when something was). `whole`:
    every router's builds loaded first (CUDA graphs: nothing may load inside a capture)."""
    if model.training:
        return "the model is in training mode (served kernels are inference-only; call model.eval() first)"
    import client as client_pkg

    from ...errors import KernelServiceError

    plans, kept = plan(model, dtype, "c" if device.type == "cpu" else "auto")
    report.kept.update(kept)
    try:
        kernels = _fetch(client or client_pkg.default_client(), plans)
        report.kernels = list({id(k): k for k in kernels if not isinstance(k, Exception)}.values())
        if whole:
            report.ready()
    except KernelServiceError as exc:
        return f"{type(exc).__name__}: {exc}"
    entries = _entries(plans, kernels, report, dtype, device.type)
    if strict and report.kept:
        name, why = next(iter(report.kept.items()))
        raise RuntimeError(f"kernelize(strict=True): {name} would keep its own forward: {why}")
    if not entries:  # one short line: each module's reason is in report.kept
        return (
            f"no module of this model is served ({len(report.kept)} kept: model.kernel_service.kept says why)"
            if report.kept
            else "no module this integration knows"
        )
    _swap(model, entries, report)
    return ""


def _spec_key(p: Plan):
    return p.kind, tuple(sorted((k, str(v)) for k, v in p.params.items()))


def _fetch(client, plans: list[Plan]) -> list:
    """Each plan's kernel, or the InvalidSpec its spec met: each spec asked for once, all in one
    prefetch (cold kernels compile in parallel)."""
    from ...errors import InvalidSpec

    slots, specs = {}, []  # spec key -> its index in specs, or the InvalidSpec it met
    for p in plans:
        key = _spec_key(p)
        if key in slots:
            continue
        try:
            client.validate(p.kind, **p.params)
        except InvalidSpec as exc:
            slots[key] = exc
            continue
        slots[key] = len(specs)
        specs.append({"kind": p.kind, **p.params})
    results = client.prefetch(specs) if specs else []
    return [got if isinstance(got := slots[_spec_key(p)], Exception) else results[got] for p in plans]


def _entries(plans: list[Plan], kernels: list, report: Report, dtype, device_type) -> dict:
    """Module name -> (its plan, its entry) for each plan served; a rider's kernel goes into its
    module's attention entry. A plan not served is kept, with why."""
    out = {}
    for p, got in zip(plans, kernels):
        if p.rider:
            if not isinstance(got, Exception) and p.name in out:
                own, entry = out[p.name]
                window = {"window": p.params["window"]} if p.rider == "varlen" else {}
                out[p.name] = (own, dataclasses.replace(entry, **{p.rider: got}, **window))
        elif isinstance(got, Exception):
            report.kept[p.name] = f"{p.kind} is not served: {got}"
        else:
            entry_type = ServedAttention if p.kind == "attention" else ServedModule
            out[p.name] = (p, entry_type(p.name, p.kind, got, report, dtype, device_type))
    return out


def _bind(module, entry, layer):
    """The layer contract, applied: the module's forward is the layer's, bound to that module."""
    vars(module)[ATTR] = entry
    vars(module)["forward"] = types.MethodType(layer.forward, module)


def _swap(model, entries: dict, report: Report):
    for name, (p, entry) in entries.items():
        if entry.kind == "attention":
            continue
        if entry.kind == "rope":
            rope.install(entry, (p.params["heads"], p.params["kv_heads"], p.params["head_dim"]), p.target)
        else:
            _bind(p.target, entry, p.layer)
        report.swapped[name] = entry.kind

    served_attention = {name: (p.target, entry) for name, (p, entry) in entries.items() if entry.kind == "attention"}
    if not served_attention:
        return
    attention.register()
    report.original_attn = model.config._attn_implementation
    for name, (m, entry) in served_attention.items():
        report.swapped[name] = "attention" + (" + kv_attention" if entry.kv_attention is not None else "")
        if entry.qkv_rope is not None:
            _bind(m, entry, QKVAttentionLayer)
            report.swapped[name] += " + rope"
        else:
            vars(m)[ATTR] = entry
    model.set_attn_implementation(attention.ATTN)
