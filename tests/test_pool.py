"""The daemon's pool and bounds, on real daemons: workers forked from one zygote, a
per-compile timeout that kills only the build past it, a memory limit that holds builds back
until their measured peaks fit, and caps on the specs recorded per application."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

import client
from compile_service import apps
from devtools import redis_server
import tests.slow_kind  # noqa: F401  (clients validate locally: they share the daemons' registry)
from tests.processes import carrying, children, cmdline

SLOW = ("--kernel-module", "tests.slow_kind")
LIMIT = 10  # the test's --compile-timeout: past any real build of these kernels on a loaded 2-core machine


def _maps_tilelang(pid: int) -> bool:
    return "libtilelang" in Path(f"/proc/{pid}/maps").read_text()


def test_workers_fork_from_one_zygote_that_imported_tilelang_once(make_daemon):
    """The workers are children of one zygote that has TileLang loaded (imported before the
    forks), while the daemon never loads it; they compile. With --worker-start spawn (here its
    variable) each worker is a fresh interpreter, a child of the daemon, and no zygote runs."""
    d = make_daemon()
    d.wait_workers_ready(timeout=300)
    zygotes = [p for p in children(d.proc.pid) if "compile_service.build.zygote" in cmdline(p)]
    assert len(zygotes) == 1
    assert len(children(zygotes[0])) == 2 and _maps_tilelang(zygotes[0]) and not _maps_tilelang(d.proc.pid)
    assert d.client().get_kernel("rmsnorm", M=None, N=40, dtype="float32", target="c").outcome == "compiled"

    spawned = make_daemon(env={"KERNEL_SERVICE_WORKER_START": "spawn"})
    spawned.wait_workers_ready(timeout=300)
    commands = [cmdline(p) for p in children(spawned.proc.pid)]
    assert sum("spawn_main" in c for c in commands) == 2 and not any("zygote" in c for c in commands)
    assert spawned.client().get_kernel("rmsnorm", M=None, N=48, dtype="float32", target="c").outcome == "compiled"


def slow(c, n: int):
    return c.get_kernel("slow_rmsnorm", M=None, N=n, dtype="float32", target="c")


def test_a_build_past_the_compile_timeout_fails_alone_and_the_pool_keeps_serving(make_daemon):
    """A lowering that sleeps past --compile-timeout fails within the limit plus 2 s with
    CompileTimeout naming the kind and the limit, while a build on the other worker goes on;
    its worker is replaced, the next kernel builds, and the failure is remembered and counted."""
    port = redis_server.free_port()
    d = make_daemon(*SLOW, "--compile-timeout", str(LIMIT), "--metrics-address", f"127.0.0.1:{port}", env={"KS_TEST_BUILD_DELAY": "60"})
    d.wait_workers_ready(timeout=300)
    with d.client(timeout=120) as c, cf.ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        timing_out = pool.submit(slow, c, 64)
        time.sleep(0.5)  # the slow build has its worker; the next one takes the other
        beside = pool.submit(c.get_kernel, "rmsnorm", M=None, N=72, dtype="float32", target="c")
        with pytest.raises(client.CompileTimeout) as err:
            timing_out.result()
        assert time.monotonic() - start < LIMIT + 2
        assert "slow_rmsnorm" in str(err.value) and f"{LIMIT} s" in str(err.value) and "--compile-timeout" in str(err.value)
        assert isinstance(err.value, client.CompileError)
        beside.result()  # built on the other worker, undisturbed
        c.get_kernel("rmsnorm", M=None, N=80, dtype="float32", target="c")  # the pool serves on
        with pytest.raises(client.CompileTimeout, match="remembered failure"):
            slow(c, 64)  # remembered: answered at once, no new build
        stats = c.stats()
    assert stats["compile_timeouts"] == 1 and stats["failures_cached"] == 1 and stats["compiles"] == 2
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "kernel_service_compile_timeouts_total 1.0" in scraped.splitlines()
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


# ----- recorded applications: bounded, and counted in the cache budget


def _spec(n: int) -> str:
    return json.dumps({"kind": "rmsnorm", "params": {"M": None, "N": n, "dtype": "float32"}, "target": "c"}, sort_keys=True, separators=(",", ":"))


def _recorded(root: Path) -> dict[str, list[int]]:
    return {app: [s["params"]["N"] for s in apps.read(root, app)] for app in apps.recorded(root)}


def test_recording_past_the_caps_keeps_the_newest_specs_on_disk_and_in_memory(tmp_path):
    """An application keeps its newest max_app_specs specs, all together the newest max_specs;
    the oldest are dropped from disk and memory, and a restarted recorder keeps the caps."""
    recorder = apps.AppRecorder(tmp_path, max_app_specs=5, max_specs=8)
    for n in range(1, 1001):
        recorder.record("flood", _spec(n))
    assert _recorded(tmp_path) == {"flood": [996, 997, 998, 999, 1000]}
    assert (tmp_path / "apps" / "flood.jsonl").stat().st_size < 5 * 120
    for n in range(1, 5):
        recorder.record("other", _spec(n))
    assert _recorded(tmp_path) == {"flood": [997, 998, 999, 1000], "other": [1, 2, 3, 4]}  # 8 in all: flood's oldest went
    assert sum(len(known) for known in recorder._known.values()) == 8
    recorder.record("flood", _spec(1000))  # already kept: nothing changes
    again = apps.AppRecorder(tmp_path, max_app_specs=3, max_specs=8)  # tighter caps on a restart
    assert _recorded(tmp_path) == {"flood": [998, 999, 1000], "other": [2, 3, 4]}
    again.record("other", _spec(5))
    assert _recorded(tmp_path)["other"] == [3, 4, 5]


def test_recorded_applications_count_in_the_cache_bytes(make_daemon):
    """The records are in `stats` bytes (the --max-size budget's usage), on a serve-only daemon
    that records strict misses."""
    d = make_daemon("--no-compile", workers=1)
    with d.client() as c:
        before = c.stats()["bytes"]
    with d.client(app="svc", strict=True) as c:
        for n in (16, 24, 32):
            with pytest.raises(client.KernelNotReady):
                c.get_kernel("rmsnorm", M=None, N=n, dtype="float32", target="c")
        recorded = (d.cache_dir / "apps" / "svc.jsonl").stat().st_size
        assert recorded > 0 and c.stats()["bytes"] == before + recorded


# ----- a build's compiler subprocesses die with the build and with the daemon (issue 47, item 6)


def _slow_compiler(tmp_path: Path, mark: str) -> dict:
    """The daemon's environment for builds whose C++ compile is real but starts a minute late
    (TileLang runs $CXX), marked so that every process of the daemon can be found, orphans too."""
    cxx = tmp_path / "slow-g++"
    cxx.write_text('#!/bin/sh\nsleep 61\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    return {"CXX": str(cxx), "KS_TEST_DAEMON": mark}


def _compilers(mark: str) -> dict[int, str]:
    return {pid: cmd for pid, cmd in carrying(f"KS_TEST_DAEMON={mark}".encode()).items() if "sleep 61" in cmd or "slow-g++" in cmd}


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_timed_out_build_leaves_no_compiler_running(make_daemon, tmp_path):
    mark = os.urandom(8).hex()
    d = make_daemon("--compile-timeout", "4", env=_slow_compiler(tmp_path, mark), workers=1)
    with d.client(timeout=120) as c, pytest.raises(client.CompileTimeout):
        c.get_kernel("rmsnorm", M=None, N=88, dtype="float32", target="c")
    _wait(lambda: not _compilers(mark), 5, f"the timed-out build's compilers to die: {_compilers(mark)}")


def _unix_listeners(pid: int) -> list[str]:
    """The paths of the Unix sockets process `pid` holds open."""
    inodes = {os.readlink(fd).removeprefix("socket:[").rstrip("]") for fd in Path(f"/proc/{pid}/fd").iterdir() if os.readlink(fd).startswith("socket:[")}
    rows = [line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:]]
    return [row[7] for row in rows if len(row) > 7 and row[6] in inodes]


def test_a_daemon_killed_mid_build_leaves_no_compiler_and_no_temporary_directory(make_daemon, tmp_path):
    mark = os.urandom(8).hex()
    d = make_daemon(env=_slow_compiler(tmp_path, mark), workers=1)
    asking = subprocess.Popen([sys.executable, "-c", f"import client; client.connect({str(d.socket)!r}).get_kernel('rmsnorm', M=None, N=96, dtype='float32', target='c')"],
                              cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    _wait(lambda: _compilers(mark), 120, "the build's compiler to start")
    zygote = next(p for p in children(d.proc.pid) if "compile_service.build.zygote" in cmdline(p))
    pymp = {Path(path).parent for path in _unix_listeners(zygote) if "/pymp-" in path}
    assert len(pymp) == 1, _unix_listeners(zygote)
    d.signal(signal.SIGKILL)
    d.proc.wait()
    asking.kill()  # its client would fall back to compiling in its own process
    asking.wait()
    _wait(lambda: not carrying(f"KS_TEST_DAEMON={mark}".encode()), 15, f"the daemon's processes to die: {carrying(f'KS_TEST_DAEMON={mark}'.encode())}")
    (left,) = pymp
    assert left.parent != Path(tempfile.gettempdir())  # not in /tmp, but in the daemon's own directory, next to its socket
    make_daemon(cache_dir=d.cache_dir, socket=d.socket, workers=1)  # the next daemon on the socket removes it
    assert not left.exists()


def test_builds_leave_nothing_in_the_temporary_directory(make_daemon, tmp_path):
    """TileLang leaves each CPU build's generated source and library in the temporary directory
    for good (2,800 of them had piled up in this machine's /tmp); each build in a compile worker
    takes a directory of its own, removed with it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    d = make_daemon(env={"TMPDIR": str(tmp)}, workers=1)
    with d.client() as c:
        for n, dtype, target in ((64, "float32", "c"), (80, "float32", "c"), (64, "float16", "sm_90a")):
            assert c.get_kernel("rmsnorm", M=None, N=n, dtype=dtype, target=target).outcome == "compiled"
    # What stays is the parent of the workers' PCH directories, each removed as its worker exits.
    assert (left := sorted(p.name for p in tmp.iterdir())) in ([], [f"kernel-service-nvrtc-pch-{os.getuid()}"]), left
