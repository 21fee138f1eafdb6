"""A kernel kind whose compile always fails, loaded into test daemons with
`--kernel-module tests.failing_kind`."""

from kernels.registry import register
from kernels.spec import KernelKind, dim


@register
class Broken(KernelKind):
    name = "broken"
    params = (dim("N"),)

    def build_cpu(self, p):
        import tilelang.language as T

        N = p["N"]

        @T.prim_func
        def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
            with T.Kernel(1):
                for i in T.serial(N):
                    Y[i] = X[i, 0]  # deliberately broken: a 1-d buffer indexed with 2 indices

        return main
