"""kernelize: the backend asked for, and for kernel-service the spine plan -> serve -> warm."""

from __future__ import annotations

import warnings

import torch

from . import graphs as graphs_
from .report import Report
from .serve import serve

BACKENDS = ("eager", "compile", "kernel-service", "auto")


def kernelize(model, *, client=None, backend: str = "auto", strict: bool = False, warmup: bool = True, graphs=None):
    """Swaps a transformers model's norms, MLP activation, rotary and attention for served kernels, in place.

    backend: "kernel-service" (served kernels), "compile" (`model.compile()`), "eager" (nothing
    changes), or "auto": kernel-service on CUDA when the daemon serves the model's shapes, else
    compile on CUDA, else eager. A requested backend that is unavailable warns (RuntimeWarning,
    naming the backend used instead) and falls back. strict=True means that backend or an error:
    it raises instead, also for "auto" when it would not be kernel-service, and when a module
    would keep its own forward. client: a client.Client (default: the default connection).
    warmup: run one tiny forward before returning. graphs: (batch, tokens) buckets whose forward is
    captured in a CUDA graph at warm-up and replayed (graphs.py: calls are padded up to the
    smallest bucket that holds them; (batch, 1) is generate's decode step with a static cache,
    captured at its second call; others run uncaptured and are counted in
    `model.kernel_service.graphs`). Returns the model; `model.kernel_service`
    (a Report) says which backend was chosen, which modules were swapped and which kept, and
    counts the calls served and fallen back (eager calls).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    buckets = None if graphs is None else graphs_.buckets(graphs)
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
        why = serve(model, report, client, strict, device, dtype, whole=buckets is not None)  # plan, fetch, swap
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
        report.graphs = graphs_.install(model, buckets, report.backend, strict)
    return model


def _first_param(model):
    try:
        return next(model.parameters())
    except StopIteration:
        raise ValueError("kernelize: the model has no parameters") from None


def _warm(model, device):
    """One tiny forward, so that first-call costs are paid inside kernelize."""
    if getattr(model, "main_input_name", None) != "input_ids":
        return
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device))
