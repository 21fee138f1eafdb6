"""A class-style kind: Z = X + alpha * Y over a runtime-length vector."""

from kernels.spec import KernelKind, Param, dim


class ScaledAdd(KernelKind):
    name = "scaled_add"
    doc = "Z[N] = X + alpha * Y."
    params = (
        dim("N", "length; None makes it a runtime size", dynamic=True),
        Param("alpha", float, default=1.0, doc="scale of Y"),
        Param("dtype", str, default="float32", choices=("float32",), doc="element type"),
    )

    def build_cpu(self, p):
        import tilelang.language as T

        N = p["N"] if p["N"] is not None else T.dynamic("N")
        alpha = p["alpha"]

        @T.prim_func
        def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32"), Z: T.Tensor((N,), "float32")):
            with T.Kernel(1):
                for i in T.serial(N):
                    Z[i] = X[i] + alpha * Y[i]

        return main

    def inputs(self, p, randn, size):
        return [randn(size("N")), randn(size("N"))]

    def reference(self, p, x):
        return x[0] + p["alpha"] * x[1]
