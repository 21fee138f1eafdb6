"""A CPU kind that declares its row count host-side, so that target "c" exercises shared
builds: every static M is served as a copy of the runtime-M build. Loaded into test
daemons with `--kernel-module tests.shared_kind`."""

from kernels.registry import register
from kernels.spec import KernelKind, dim


@register
class RowDouble(KernelKind):
    name = "row_double"
    doc = "Y[M,N] = 2 * X."
    params = (dim("M", "rows", dynamic=True), dim("N", "row length"))

    def host_side_dims(self, p, target):
        return ("M",)

    def build_cpu(self, p):
        import tilelang.language as T

        M = p["M"] if p["M"] is not None else T.dynamic("M")
        N = p["N"]

        @T.prim_func
        def main(X: T.Tensor((M, N), "float32"), Y: T.Tensor((M, N), "float32")):
            with T.Kernel(M) as bx:
                for j in T.serial(N):
                    Y[bx, j] = X[bx, j] * 2.0

        return main
