"""A CPU kind that routes by M (KernelKind.dispatch) and uses a per-call workspace
(KernelKind.scratch), so that target "c" exercises both: Y = X * 2 from the build for
M <= 4, Y = X * 3 from the other (through a workspace W written by a first kernel and
read by a second), so a call's output shows which build ran. Loaded into test daemons
with `--kernel-module tests.routed_kind`. With ROUTED_SMALL_GATE set, the small build waits
until that file exists (a cold range's build held back while the test looks)."""

import os
import time
from pathlib import Path

from kernels.registry import register
from kernels.spec import KernelKind, Param, dim

RANGES = ((4, {"schedule": "small"}), (None, {"schedule": "large"}))


@register
class RowScale(KernelKind):
    name = "routed_scale"
    doc = "Y[M,N] = X * 2 for M <= 4 rows, X * 3 otherwise."
    params = (dim("M", "rows", dynamic=True), dim("N", "row length"), Param("schedule", str, default="auto", choices=("auto", "small", "large")))

    def check(self, p, target):
        if p["M"] is not None and p["schedule"] == "auto":  # a static M takes its range's build
            p.update(next(o for upper, o in RANGES if upper is None or p["M"] <= upper))
        return p

    def dispatch(self, p, target):
        return None if p["M"] is None and p["schedule"] != "auto" else ("M", list(RANGES))

    def scratch(self, p):
        return ("W",) if p["schedule"] == "large" else ()

    def build_cpu(self, p):
        import tilelang.language as T

        gate = os.environ.get("ROUTED_SMALL_GATE")
        deadline = time.monotonic() + 120
        while p["schedule"] == "small" and gate and not Path(gate).exists() and time.monotonic() < deadline:
            time.sleep(0.05)

        M = p["M"] if p["M"] is not None else T.dynamic("M")
        N = p["N"]
        if p["schedule"] == "large":

            @T.prim_func
            def large(X: T.Tensor((M, N), "float32"), W: T.Tensor((M, N), "float32"), Y: T.Tensor((M, N), "float32")):
                with T.Kernel(M) as bx:
                    for j in T.serial(N):
                        W[bx, j] = X[bx, j] * 2.0
                with T.Kernel(M) as bx:
                    for j in T.serial(N):
                        Y[bx, j] = W[bx, j] + X[bx, j]

            return large

        @T.prim_func
        def main(X: T.Tensor((M, N), "float32"), Y: T.Tensor((M, N), "float32")):
            with T.Kernel(M) as bx:
                for j in T.serial(N):
                    Y[bx, j] = X[bx, j] * 2.0

        return main
