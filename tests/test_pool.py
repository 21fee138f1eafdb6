"""The compile pool's bounds, on real daemons: a per-compile timeout that kills only the build
past it, and a memory limit that holds builds back until their measured peaks fit."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

import client
import tests.slow_kind  # noqa: F401  (clients validate locally: they share the daemons' registry)

SLOW = ("--kernel-module", "tests.slow_kind")


def slow(c, n: int):
    return c.get_kernel("slow_rmsnorm", M=None, N=n, dtype="float32", target="c")


def test_a_build_past_the_compile_timeout_fails_alone_and_the_pool_keeps_serving(make_daemon):
    """A lowering that sleeps past --compile-timeout fails within the limit plus 2 s with
    CompileTimeout naming the kind and the limit, while a build on the other worker goes on;
    its worker is replaced, the next kernel builds, and the failure is remembered and counted."""
    d = make_daemon(*SLOW, "--compile-timeout", "3", env={"KS_TEST_BUILD_DELAY": "60"})
    d.wait_workers_ready(timeout=300)
    with d.client(timeout=120) as c, cf.ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        timing_out = pool.submit(slow, c, 64)
        time.sleep(0.5)  # the slow build has its worker; the next one takes the other
        beside = pool.submit(c.get_kernel, "rmsnorm", M=None, N=72, dtype="float32", target="c")
        with pytest.raises(client.CompileTimeout) as err:
            timing_out.result()
        assert time.monotonic() - start < 3 + 2
        assert "slow_rmsnorm" in str(err.value) and "3 s" in str(err.value) and "--compile-timeout" in str(err.value)
        assert isinstance(err.value, client.CompileError)
        beside.result()  # built on the other worker, undisturbed
        c.get_kernel("rmsnorm", M=None, N=80, dtype="float32", target="c")  # the pool serves on
        with pytest.raises(client.CompileTimeout, match="remembered failure"):
            slow(c, 64)  # remembered: answered at once, no new build
        stats = c.stats()
    assert stats["compile_timeouts"] == 1 and stats["failures_cached"] == 1 and stats["compiles"] == 2
    d.wait_workers_ready(timeout=300)  # the killed worker's replacement started and warmed up


def _cold_at_once(c, sizes) -> None:
    with cf.ThreadPoolExecutor(len(sizes)) as pool:
        for done in [pool.submit(slow, c, n) for n in sizes]:
            done.result()


def test_a_memory_limit_of_one_builds_peak_keeps_builds_to_one_at_a_time(make_daemon):
    """Without a tight limit, two workers build two cold kernels at once; with --memory-limit set
    to one build's measured peak, cold builds requested together run one at a time."""
    delay = {"KS_TEST_BUILD_DELAY": "1"}
    free = make_daemon(*SLOW, env=delay)
    free.wait_workers_ready(timeout=300)
    with free.client(timeout=120) as c:
        slow(c, 32)  # measures the kind's peak
        peak = c.stats()["build_peak_bytes"]
        _cold_at_once(c, (40, 48))
        stats = c.stats()
    free.stop()
    assert peak > 0 and stats["most_builds_running"] == 2 and stats["memory_limit"] > peak

    tight = make_daemon(*SLOW, "--memory-limit", str(peak), env=delay)
    tight.wait_workers_ready(timeout=300)
    with tight.client(timeout=120) as c:
        slow(c, 32)
        _cold_at_once(c, (40, 48, 56))
        stats = c.stats()
    assert stats["memory_limit"] == peak and stats["memory_builds"] == 1 and stats["workers"] == 2
    assert stats["most_builds_running"] == 1 and stats["compiles"] == 4
    assert "memory limit" in tight.log()
