"""The CUDA source TileLang generates for a spec, lowered as a build lowers it (with the pass
configs the build passes) but not compiled: what the tests that read generated code (any
machine; TileLang cross-compiles) look at."""

from __future__ import annotations

import kernels


def cuda_source(kind: str, params: dict, arch: str = "sm_90a") -> str:
    import tilelang
    import tvm

    from compile_service.build.compiler import _build_options

    target = kernels.parse_target(arch)
    spec = kernels.canonicalize(kind, params, arch)
    k = kernels.get_kind(kind)
    func, _, options = _build_options(k.build(dict(spec.params), target), k, dict(spec.params))
    tvm_target = tvm.target.Target(target.tilelang_target())
    with tvm.transform.PassContext(opt_level=3, config=options.get("pass_configs") or {}), tvm_target:
        return tilelang.lower(func, target=tvm_target).kernel_source
