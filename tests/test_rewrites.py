"""The workers' cache of TileLang's DSL rewrite (compile_service/build/rewrites.py): a kernel body
is rewritten once per function, every build still gets its own closure values, and a rewrite is
redone when an expression the rewriter evaluated names something else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tilelang.language as T

from compile_service.build import rewrites
from tests.lowering import cuda_source

ROOT = Path(__file__).resolve().parent.parent

rewrites.install()  # what every compile worker does (compiler.worker_init)


def _offset_kernel(n: int, offset: float):
    @T.prim_func
    def main(A: T.Tensor((n,), "float32"), B: T.Tensor((n,), "float32")):
        with T.Kernel(1, threads=1):
            for i in T.serial(n):
                B[i] = A[i] + offset

    return main


def test_each_build_gets_its_own_closure_values_from_one_rewrite():
    small, large = _offset_kernel(4, 1.5), _offset_kernel(8, 2.5)
    main = next(c for c in _offset_kernel.__code__.co_consts if getattr(c, "co_name", None) == "main")
    assert sum(1 for key in rewrites._cache if key[0] is main) == 1  # rewritten once
    assert [int(d) for d in small.buffer_map[small.params[0]].shape] == [4]
    assert [int(d) for d in large.buffer_map[large.params[0]].shape] == [8]
    assert "1.5" in small.script() and "2.5" not in small.script()
    assert "2.5" in large.script() and "1.5" not in large.script()


def _launch_macro(kernel):
    def body(A):
        with kernel(1, threads=32):
            A[0] = 1.0

    return T.macro(body)


def _plain_launch(*args, **kwargs):  # T.Kernel by another name, not marked as a launch factory
    return T.Kernel(*args, **kwargs)


def test_a_rewrite_is_redone_when_an_evaluated_expression_names_another_object():
    """The rewriter evaluates `kernel` to tell a T.Kernel launch (it adds a guard to it): the same
    source with `kernel` bound to another object must not reuse the first rewrite."""
    assert "skip_kernel_ctx" in _launch_macro(T.Kernel).source
    assert "skip_kernel_ctx" not in _launch_macro(_plain_launch).source
    assert "skip_kernel_ctx" in _launch_macro(T.Kernel).source


def test_zoo_kernels_lower_to_the_same_source_from_a_cached_rewrite():
    """A GEMM and an attention lowered here, after a first build of each kind filled the cache,
    against the same lowered in a fresh interpreter that never installed it."""
    specs = [
        ("gemm", {"M": 64, "N": 512, "K": 256, "dtype": "float16"}),
        ("attention", {"batch": 1, "seq_len": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "causal": True, "dtype": "float16"}),
    ]
    cuda_source("gemm", {"M": 64, "N": 256, "K": 128, "dtype": "float16"})
    cuda_source("attention", {"batch": 1, "seq_len": 128, "heads": 2, "kv_heads": 2, "head_dim": 64, "causal": True, "dtype": "float16"})
    cached = [cuda_source(kind, params) for kind, params in specs]
    script = f"import json, sys; from tests.lowering import cuda_source; json.dump([cuda_source(k, p) for k, p in {specs!r}], sys.stdout)"
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cached == json.loads(fresh.stdout)
