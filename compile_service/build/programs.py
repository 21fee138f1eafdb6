"""Builds a TileLang program sent as IR (kernels.program) into the files TileLang's own kernel
cache keeps for it, so that its sender loads it with `JITKernel.from_database` and gets what
`tilelang.compile` returns: TileLang's own adapter, out_idx and sources (client.tilelang).

Runs in a compile worker, as compiler.build does, with the same device compiler behind
TileLang's callback and the same device-binary cache. The entry holds:

    executable.so | kernel_lib.so   the library (tvm_ffi's host module with the cubin embedded;
                                    cython's compiled C)
    device_kernel.cu                the device source (get_kernel_source())
    host_kernel.cu                  the host source
    params.json                     TileLang's parameter records (dump_kernel_params: IR as JSON, never unserialized code)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from proto import abi as call_abi

LIBRARIES = {"tvm_ffi": "executable.so", "cython": "kernel_lib.so"}  # TileLang's own names
FILES = {"device_source": "device_kernel.cu", "host_source": "host_kernel.cu", "params": "params.json"}


def compile_program(doc: dict):
    """TileLang's JITKernel for a checked program document, compiled as `tilelang.compile` would
    (its KernelCache.cached calls the same constructor with the same resolved options)."""
    import tilelang
    import tvm

    func = tvm.ir.load_json(json.dumps(doc["ir"]))
    host = tvm.target.Target(doc["target_host"]) if doc["target_host"] else None
    return tilelang.JITKernel(
        func,
        out_idx=doc["out_idx"],
        execution_backend=doc["execution_backend"],
        target=tvm.target.Target(doc["target"]),
        target_host=host,
        pass_configs=doc["pass_configs"] or None,
        compile_flags=doc["compile_flags"],
    )


def write_entry(kernel, doc: dict, staging: Path, export_library) -> tuple[str, dict]:
    """Writes the kernel's files into `staging`; returns (library name, its ABI).
    `export_library(executable, path)`: how a tvm_ffi executable is linked (compiler.export_cuda_library)."""
    from tilelang.engine.param import dump_kernel_params

    backend = doc["execution_backend"]
    library = LIBRARIES[backend]
    if backend == "tvm_ffi":
        export_library(kernel.adapter.get_exportable_executable(), str(staging / library))
        host_source = kernel.adapter.get_host_source()
    else:
        shutil.copyfile(kernel.adapter.libpath, staging / library)
        host_source = kernel.adapter.get_kernel_source()
    (staging / FILES["device_source"]).write_text(kernel.kernel_source or "")
    (staging / FILES["host_source"]).write_text(host_source or "")
    (staging / FILES["params"]).write_text(dump_kernel_params(kernel.params))
    device = "cpu" if doc["target"]["kind"] == "c" else "cuda"
    return library, call_abi.program(backend, device, doc["name"], FILES)
