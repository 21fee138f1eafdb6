"""The CUDA source TileLang generates for a spec, lowered as a build lowers it (with the pass
configs the build passes) but not compiled: what the tests that read generated code (any
machine; TileLang cross-compiles) look at."""

from __future__ import annotations

import kernels


def cuda_source(kind: str, params: dict, arch: str = "sm_90a") -> str:
    from compile_service.build.compiler import lowered

    spec = kernels.canonicalize(kind, params, arch)
    return lowered(kernels.get_kind(kind), dict(spec.params), spec.target)[0]
