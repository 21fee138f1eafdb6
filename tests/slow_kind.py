"""A kernel kind whose build takes as long as the daemon's $KS_TEST_BUILD_DELAY says (seconds,
default 0), loaded into test daemons with `--kernel-module tests.slow_kind`: a host can be
killed while it is surely still building."""

import os
import time

from kernels.registry import register
from kernels.rmsnorm import RMSNorm


@register
class SlowRMSNorm(RMSNorm):
    name = "slow_rmsnorm"
    warm_up = ()

    def build_cpu(self, p):
        time.sleep(float(os.environ.get("KS_TEST_BUILD_DELAY", "0")))
        return super().build_cpu(p)
