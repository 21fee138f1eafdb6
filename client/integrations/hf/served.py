"""What a swapped module serves, the check each call passes to be served, and the layer contract."""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from .report import Report

ATTR = "_kernel_service"  # a served module's entry (not a parameter or buffer: the state dict is unchanged)

GRAD_WARNING = (
    "kernelize: this model was called with grad enabled, so it runs its own eager forwards (served kernels are "
    "inference-only); call it under torch.inference_mode() (or torch.no_grad())"
)


@dataclasses.dataclass(frozen=True, eq=False)
class ServedModule:
    """A module's (or the process-wide rope's) kernel, served for calls in `dtype` on `device_type`."""

    name: str  # the module's name in the model
    kind: str
    kernel: object  # client.Kernel
    report: Report  # where its calls and fallbacks are counted
    dtype: torch.dtype
    device_type: str


@dataclasses.dataclass(frozen=True, eq=False)
class ServedAttention(ServedModule):
    """An attention module's kernels: `kernel` for unpadded calls, and those that ride on it."""

    varlen: object = None  # attention with each sequence's key range: padded batches and sliding windows
    window: int = 0  # the varlen kernel's window (0: none)
    kv_attention: object = None  # decode steps (causal models)
    qkv_rope: object = None  # a fused-QKV module: rope packed with v_out, then the attention


def served(entry, module, *tensors, count: bool = True):
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


def module_entry(module, *tensors):
    """The module's own entry, when this call of it can be served (`served`)."""
    return served(module.__dict__.get(ATTR), module, *tensors)


class ServedLayer(nn.Module):
    """The HF `kernels` layer contract: no __init__, no state, a forward and two flags. kernelize
    binds a subclass's forward to the module instance, so its `self` is the model's own module."""

    can_torch_compile = True
    has_backward = False
