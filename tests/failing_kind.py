"""Kernel kinds whose compile always fails, loaded into test daemons with
`--kernel-module tests.failing_kind`."""

from kernels.registry import register
from kernels.spec import KernelKind, Param, dim


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


@register
class Crashing(KernelKind):
    """A worker that dies while building: `times` builds of each N crash the worker process
    (counted in files under $KS_TEST_CRASH_DIR, which the test gives the daemon), later ones
    build a plain copy kernel. Without that variable it never crashes."""

    name = "crashing"
    params = (dim("N"), Param("times", int, default=1, min=0, max=3))

    def build_cpu(self, p):
        import os
        from pathlib import Path

        import tilelang.language as T

        where = os.environ.get("KS_TEST_CRASH_DIR")
        if where:
            count = Path(where) / f"crashes-{p['N']}-{p['times']}"
            done = len(count.read_text()) if count.exists() else 0
            if done < p["times"]:
                count.write_text("x" * (done + 1))
                os._exit(70)  # the worker process dies mid-build, as a segfault or an OOM kill would

        N = p["N"]

        @T.prim_func
        def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
            with T.Kernel(1):
                for i in T.serial(N):
                    Y[i] = X[i]

        return main


@register
class Verbose(KernelKind):
    """Fails to build with a message of `size` characters over many lines, as a compiler's long
    output would be (`accents` puts non-ASCII in it): what a client gets must be a CompileError."""

    name = "verbose_failure"
    params = (dim("N"), Param("size", int, default=10_000, min=1, max=100_000), Param("accents", bool, default=False))

    def build_cpu(self, p):
        line = "error: failed at line {:06d}" + (" (échec)" if p["accents"] else "") + "\n"
        lines = [line.format(i) for i in range(p["size"] // len(line.format(0)) + 1)]
        raise RuntimeError("".join(lines)[: p["size"]])
