"""The CUDA source TileLang generates for a spec, lowered as a build lowers it but not compiled:
what the tests that read generated code (any machine; TileLang cross-compiles) look at."""

from __future__ import annotations

import kernels


def cuda_source(kind: str, params: dict, arch: str = "sm_90a") -> str:
    import tilelang
    import tvm

    target = kernels.parse_target(arch)
    spec = kernels.canonicalize(kind, params, arch)
    tvm_target = tvm.target.Target(target.tilelang_target())
    with tvm.transform.PassContext(opt_level=3), tvm_target:
        return tilelang.lower(kernels.get_kind(kind).build(dict(spec.params), target), target=tvm_target).kernel_source
