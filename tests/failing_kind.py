"""Kernel kinds whose compile always fails, loaded into test daemons with
`--kernel-module tests.failing_kind`."""

from kernels.registry import register
from kernels.spec import KernelKind, dim


@register
class Broken(KernelKind):
    name = "broken"
    params = (dim("N"),)

    def build_cpu(self, p):
        import tilelang.language as T

        N = p["N"] if p["N"] is not None else T.dynamic("N")

        @T.prim_func
        def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
            with T.Kernel(1):
                for i in T.serial(N):
                    Y[i] = X[i, 0]  # deliberately broken: a 1-d buffer indexed with 2 indices

        return main


@register
class BrokenShared(Broken):
    """Declares N host-side, so every static N is served by the (failing) runtime-N build."""

    name = "broken_shared"
    params = (dim("N", dynamic=True),)

    def host_side_dims(self, p, target):
        return ("N",)
