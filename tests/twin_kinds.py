"""Two CPU kinds of one name, `twin`, with one output and with two: what two daemons' plugins
may serve to one agent. Loaded into test daemons with `--kernel-module tests.twin_kinds`
(TWIN_OUTPUTS in the daemon's environment picks the variant)."""

import os

from kernels.registry import register
from kernels.spec import KernelKind, dim

PAIR = os.environ.get("TWIN_OUTPUTS") == "2"


@register
class Twin(KernelKind):
    name = "twin"
    doc = "Y = 2 * X" + (", Z = 3 * X." if PAIR else ".")
    params = (dim("N", "length"),)
    outputs = (-2, -1) if PAIR else (-1,)

    def build_cpu(self, p):
        import tilelang.language as T

        N = p["N"]
        if PAIR:

            @T.prim_func
            def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32"), Z: T.Tensor((N,), "float32")):
                with T.Kernel(1):
                    for i in T.serial(N):
                        Y[i] = X[i] * 2.0
                        Z[i] = X[i] * 3.0

            return main

        @T.prim_func
        def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
            with T.Kernel(1):
                for i in T.serial(N):
                    Y[i] = X[i] * 2.0

        return main
