"""Operating the service as its users do: faults a new user hit, the lifecycle and cache
commands, counters that survive restarts, the Prometheus endpoint, hits without a round
trip. Real daemons on real sockets, the real CLI in subprocesses."""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import client
import kernels
from tests.marks import needs_nvcc
from tests.processes import alive

ROOT = Path(__file__).resolve().parent.parent
RMSNORM = {"M": None, "N": 64, "dtype": "float32", "target": "c"}


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compile_service.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The failure is one line on stderr, no traceback, and a non-zero exit."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("kernel-service:")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    return lines[0]


# ----- fault 1: a dead daemon never hangs an agent


def test_a_killed_daemon_fails_clients_within_the_window(make_daemon):
    d = make_daemon()
    seen = d.client(reconnect_window=3)
    seen.get_kernel("rmsnorm", **RMSNORM)
    d.proc.kill()
    d.proc.wait()
    assert d.socket.exists()  # kill -9 leaves the socket file behind

    t = time.monotonic()
    with pytest.raises(client.ServiceUnavailable, match="start one with `kernel-service serve`"):
        client.connect(d.socket).get_kernel("rmsnorm", **{**RMSNORM, "N": 72})  # never answered: 2 s
    assert time.monotonic() - t < 4
    t = time.monotonic()
    with pytest.raises(client.ServiceUnavailable):
        seen.get_kernel("rmsnorm", **{**RMSNORM, "N": 80})  # answered before: its reconnect window, 3 s
    assert 1.5 < time.monotonic() - t < 6
    assert seen.get_kernel("rmsnorm", **RMSNORM) is not None  # what it had stays memoized

    t = time.monotonic()
    line = one_line_error(cli("stats", "--socket", str(d.socket)))
    assert time.monotonic() - t < 10 and "left by a daemon that was killed" in line


def test_the_reconnect_window_holds_for_a_daemon_started_late(make_daemon):
    """#32 item 6: once a daemon has answered, calls wait for a restarted one for the whole
    reconnect window, whatever their own timeout (service_info's 10 s cut the 30 s window to
    about 9 s) and a Prefetch too (it was not retried at all)."""
    import threading

    d = make_daemon("--no-compile")  # no workers: quick to stop and start
    c = d.client()
    c.stats()
    for call in (lambda: c.service_info(timeout=3), lambda: c.prefetch([{"kind": "rmsnorm", **RMSNORM}], load=False)):
        d.stop()
        late = threading.Timer(4, d.start, kwargs={"wait": False})
        late.start()
        t = time.monotonic()
        try:
            answer = call()
        finally:
            late.join()
        assert answer and time.monotonic() - t > 4, answer


LOAD_ONE = """
import json, sys, client
from client import loader
try:
    k = client.connect(sys.argv[1]).get_kernel("rmsnorm", M=None, N=64, dtype="float32", target="c")
    print(json.dumps({"outcome": k.outcome, "copies_in": str(loader._private_dir())}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def test_a_noexec_tmpdir_is_detected_at_the_first_load_and_another_directory_used(shared_daemon, tmp_path):
    """#32 item 5: with TMPDIR on a noexec mount (common in containers) kernels load from the
    next directory that allows executing ($XDG_RUNTIME_DIR, then ~/.cache); with none, the
    error is a LoadError that names the fix, not a raw OSError from the dynamic loader."""
    noexec, runtime = tmp_path / "noexec", tmp_path / "run"
    noexec.mkdir()
    runtime.mkdir(mode=0o700)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,size=8m", "ks-noexec", str(noexec)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a noexec tmpfs here: {mounted.stderr.decode().strip()}")
    try:

        def load(**env) -> dict:
            done = subprocess.run([sys.executable, "-c", LOAD_ONE, str(shared_daemon.socket)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "TMPDIR": str(noexec), **env})  # fmt: skip
            assert done.returncode == 0, done.stderr[-2000:]
            return json.loads(done.stdout.strip().splitlines()[-1])

        loaded = load(XDG_RUNTIME_DIR=str(runtime))
        assert "outcome" in loaded and Path(loaded["copies_in"]).parent == runtime, loaded
        refused = load(XDG_RUNTIME_DIR=str(noexec), XDG_CACHE_HOME=str(noexec / "cache"))
        assert refused["error"] == "LoadError" and "mounted noexec" in refused["message"] and "set TMPDIR to a directory" in refused["message"], refused
    finally:
        subprocess.run(["umount", str(noexec)], check=True)


# ----- fault 3: bad input to the CLI is one line and a non-zero exit


def test_bad_flags_are_one_line_naming_the_fix(tmp_path):
    socket = tmp_path / "s.sock"
    line = one_line_error(cli("serve", "--target", "banana", "--socket", str(socket), "--cache-dir", str(tmp_path / "c")))
    assert "--target" in line and "'banana'" in line and "sm_90a" in line
    long = Path("/tmp") / ("x" * 110) / "ks.sock"
    line = one_line_error(cli("serve", "--socket", str(long), "--cache-dir", str(tmp_path / "c")))
    assert "at most 107" in line and "shorter path" in line
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = one_line_error(cli("serve", "--target", "c", "--socket", str(socket), "--cache-dir", str(blocker / "cache")))
    assert f"cannot create the cache directory {blocker / 'cache'}" in line and "--cache-dir" in line
    proc = cli("--log-level", "foo", "stats")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "unknown level 'foo'; use one of DEBUG" in proc.stderr
    assert not socket.exists()


def test_stats_into_a_closed_pipe_is_quiet(shared_daemon):
    proc = subprocess.run(
        f"{sys.executable} -m compile_service.cli stats --socket {shared_daemon.socket} | head -1",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.startswith("counters since") and proc.stderr == ""


# ----- fault 4: target=None is the daemon's default target


def test_target_none_means_the_daemons_default(make_daemon):
    d = make_daemon("--target", "sm_90a", "--cuda-compiler", "nvcc")
    c = d.client()
    assert c.service_info()["default_target"] == "sm_90a"
    # Rows of 20000 are fine on the CPU, not on CUDA: validated for the daemon's target, not this host's.
    with pytest.raises(client.InvalidSpec) as err:
        c.get_kernel("rmsnorm", M=None, N=20000, dtype="float32")
    assert err.value.field == "N" and "not supported on CUDA" in str(err.value)
    assert c.get_kernel("rmsnorm", M=None, N=24, dtype="float32", target="c").spec["target"] == "c"


def test_auto_choosing_the_cpu_says_so(make_daemon):
    if kernels.parse_target("auto").kind != "c":
        pytest.skip("a GPU is visible: 'auto' does not choose the CPU here")
    with pytest.raises(kernels.InvalidSpec, match="what target 'auto' chose: no GPU is visible"):
        kernels.canonicalize("rmsnorm", {"M": None, "N": 64, "dtype": "float16"}, "auto")
    d = make_daemon("--target", "auto")
    with pytest.raises(client.InvalidSpec, match="no GPU is visible on this host"):
        d.client().get_kernel("rmsnorm", M=None, N=64, dtype="float16")
    with pytest.raises(client.InvalidSpec) as err:  # named explicitly: no note
        d.client().get_kernel("rmsnorm", M=None, N=64, dtype="float16", target="c")
    assert "auto" not in str(err.value)


# ----- fault 5: a copy of a shared build says so


@needs_nvcc
def test_a_copy_of_a_shared_build_says_what_it_copies(make_daemon):
    from devtools.demo import how_served

    c = make_daemon().client()
    # schedule "tma": with "auto", M=None would be a router over M ranges (tests/test_routing.py)
    gemm = {"kind": "gemm", "K": 256, "dtype": "float16", "trans_b": True, "target": "sm_90a", "schedule": "tma"}
    events = []
    c.prefetch([{**gemm, "M": None, "N": None}, {**gemm, "M": 512, "N": 512}], load=False, progress=lambda done, total, e: events.append(e))
    copy = next(e["kernel"] for e in events if e["index"] == 1)
    build = next(e["kernel"] for e in events if e["index"] == 0)
    assert copy["shared_build"]["key"] == build["artifact"]["key"]
    text = how_served(copy)
    assert "copy of the shared build with M, N at run time" in text and f"{build['compile_seconds']:.2f}s" in text
    assert how_served(build).startswith("compiled (built in")
    k = c.get_kernel("gemm", M=512, N=512, **{k: v for k, v in gemm.items() if k != "kind"})
    assert k.shared_build["compile_seconds"] == pytest.approx(build["compile_seconds"])


# ----- lifecycle commands


def test_connect_shows_the_clients_options():
    """help(client.connect) and IDEs show every option, with Client's defaults."""
    assert list(inspect.signature(client.connect).parameters.values()) == list(inspect.signature(client.Client).parameters.values())
    assert "reconnect_window" in inspect.signature(client.connect).parameters


def test_version_and_help():
    from compile_service import __version__

    assert cli("--version").stdout.strip() == f"kernel-service {__version__}"
    for command in ("stop", "info", "ls", "clear", "prune", "zero-stats"):
        proc = cli(command, "--help")
        assert proc.returncode == 0 and "usage: kernel-service " + command in proc.stdout


def test_stop_waits_for_running_compiles(make_daemon):
    d = make_daemon(workers=1)
    batch = [{"kind": "softmax", "M": None, "N": 16 + 8 * i, "dtype": "float32", "target": "c"} for i in range(3)]
    runner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import client, sys, json; client.connect(sys.argv[1]).prefetch(json.loads(sys.argv[2]), load=False)",
            str(d.socket),
            json.dumps(batch),
        ],
        cwd=ROOT,
        stderr=subprocess.DEVNULL,
    )
    staging = d.cache_dir / "staging"
    deadline = time.monotonic() + 120
    while not any(staging.iterdir()):  # a compile is under way
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc = cli("stop", "--socket", str(d.socket))
    assert proc.returncode == 0 and f"pid {d.proc.pid}" in proc.stdout, proc.stderr
    assert d.proc.wait(10) == 0 and not d.socket.exists()
    runner.wait(60)
    assert list((d.cache_dir / "entries").glob("*/*")) and not list(staging.iterdir())  # the running compile was published
    assert cli("stop", "--socket", str(d.socket)).stdout.startswith("no kernel-service daemon is running")


def test_a_launcher_killed_before_stop_leaves_no_daemon(tmp_path):
    """DaemonProcess passes --exit-with-parent: SIGKILL its launcher and the daemon drains and exits."""
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from devtools.launch import DaemonProcess; "
            "d = DaemonProcess(sys.argv[1], '--target', 'c', workers=1).start(); print(d.proc.pid, flush=True); time.sleep(600)",
            str(tmp_path / "cache"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    daemon = int(launcher.stdout.readline())
    try:
        assert alive(daemon)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while alive(daemon) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(daemon), "the daemon outlived the process that started it"
        log = next(tmp_path.glob("daemon-*.log")).read_text()
        assert f"(pid {launcher.pid}) is gone: stopping" in log
    finally:
        if alive(daemon):
            os.kill(daemon, 9)


def test_info_says_where_each_setting_came_from(make_daemon, tmp_path):
    d = make_daemon("--max-entries", "9", workers=1)
    info = json.loads(cli("info", "--socket", str(d.socket), "--json").stdout)
    assert info["from"].startswith("the daemon running")
    s = info["settings"]
    assert s["workers"] == {"value": 1, "source": "--workers"} and s["target"] == {"value": "c", "source": "--target"}
    assert s["max_entries"]["source"] == "--max-entries" and s["grace"] == {"value": 30.0, "source": "default"}
    assert s["cache_dir"] == {"value": str(d.cache_dir), "source": "--cache-dir"}

    env = {"KERNEL_SERVICE_CACHE_DIR": str(tmp_path / "from-env")}
    info = json.loads(cli("info", "--socket", str(tmp_path / "none.sock"), "--json", env=env).stdout)
    assert "no daemon is running" in info["from"]
    assert info["settings"]["cache_dir"] == {"value": str(tmp_path / "from-env"), "source": "$KERNEL_SERVICE_CACHE_DIR"}
    assert info["settings"]["workers"]["source"].startswith("CPUs usable here")
    assert not (tmp_path / "from-env").exists()  # info creates nothing


def test_ls_prune_and_clear_on_a_running_daemon(make_daemon):
    d = make_daemon()
    c = d.client()
    specs = [{**RMSNORM, "N": 16 + 8 * i} for i in range(3)]
    for s in specs:
        c.get_kernel("rmsnorm", **s)
    entries = json.loads(cli("ls", "--cache-dir", str(d.cache_dir), "--json").stdout)
    assert sorted(e["params"]["N"] for e in entries) == [16, 24, 32]
    assert all(e["built"] == "compiled" and e["bytes"] > 0 and e["last_used"] <= time.time() and "lower" in e["phases"] for e in entries)
    text = cli("ls", "--cache-dir", str(d.cache_dir)).stdout
    assert "rmsnorm" in text and "compiled in" in text and "3 entries" in text

    proc = cli("prune", "--max-size", "1", "--cache-dir", str(d.cache_dir))  # all used within the default min-age
    assert proc.returncode == 0 and proc.stdout.startswith("removed 0") and "--min-age" in proc.stdout
    proc = cli("prune", "--max-size", "1", "--min-age", "0", "--cache-dir", str(d.cache_dir))
    assert proc.returncode == 0 and proc.stdout.startswith("removed 0")  # the daemon may have used them in the last minute
    for entry in (d.cache_dir / "entries").glob("*/*"):  # it records a use on disk at most once a minute: age them past that
        os.utime(entry, (time.time() - 120,) * 2)
    proc = cli("prune", "--max-size", "1", "--min-age", "0", "--cache-dir", str(d.cache_dir))
    assert proc.returncode == 0 and proc.stdout.startswith("removed 3")
    assert d.client().get_kernel("rmsnorm", **specs[0]).outcome == "compiled"  # rebuilt on request, nothing corrupt

    proc = cli("clear", "--cache-dir", str(d.cache_dir))
    assert proc.returncode == 0 and proc.stdout.startswith("removed 1 entries")
    assert json.loads(cli("ls", "--cache-dir", str(d.cache_dir), "--json").stdout) == []
    assert not list((d.cache_dir / "blobs").glob("*/*"))
    fresh = d.client()
    assert fresh.get_kernel("rmsnorm", **specs[1]).outcome == "compiled"
    assert fresh.stats()["corrupt"] == 0
    one_line_error(cli("ls", "--cache-dir", str(d.cache_dir / "nope")))


def test_counters_survive_a_restart_until_zero_stats(make_daemon):
    d = make_daemon()
    d.client().get_kernel("rmsnorm", **RMSNORM)
    d.client(direct_hits=False).get_kernel("rmsnorm", **RMSNORM)
    before = d.client().stats()
    assert (before["compiles"], before["hits"]) == (1, 1)
    d.stop()
    d2 = make_daemon(cache_dir=d.cache_dir)
    after = d2.client().stats()
    assert (after["compiles"], after["hits"], after["stats_since"]) == (1, 1, before["stats_since"])
    proc = cli("zero-stats", "--socket", str(d2.socket))
    assert proc.returncode == 0 and "1 compiles" in proc.stdout
    zeroed = d2.client().stats()
    assert (zeroed["compiles"], zeroed["hits"]) == (0, 0) and zeroed["stats_since"] > after["stats_since"]
    assert zeroed["entries"] == 1  # the cache is untouched
    d2.client(direct_hits=False).get_kernel("rmsnorm", **RMSNORM)
    d2.stop()
    assert json.loads((d.cache_dir / "stats.json").read_text())["hits"] == 1  # saved at stop
    proc = cli("zero-stats", "--socket", str(d2.socket), "--cache-dir", str(d.cache_dir))  # no daemon: the saved totals
    assert proc.returncode == 0 and "no daemon running" in proc.stdout
    assert json.loads((d.cache_dir / "stats.json").read_text())["hits"] == 0


def test_counters_saved_by_an_older_release_go_on(make_daemon, tmp_path):
    """A counter a release adds (direct_hits) starts at zero; the saved totals are kept."""
    cache = tmp_path / "cache"
    make_daemon(cache_dir=cache).stop()
    saved = json.loads((cache / "stats.json").read_text())
    del saved["direct_hits"]
    (cache / "stats.json").write_text(json.dumps({**saved, "compiles": 7}))
    stats = make_daemon(cache_dir=cache).client().stats()
    assert (stats["compiles"], stats["direct_hits"], stats["stats_since"]) == (7, 0, saved["stats_since"])


_HIT_AGENT = """
import sys, client
c = client.connect(sys.argv[1])
print(c.get_kernel("rmsnorm", M=None, N=64, dtype="float32", target="c").outcome, flush=True)
sys.stdin.read()  # held open until the test closes it: the reporter's own report, then the exit
"""


def _free_port() -> int:
    import socket as sockets

    with sockets.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in body.splitlines() if line and not line.startswith("#"))}


def test_direct_hits_of_other_processes_are_counted_in_stats_and_metrics_without_a_getkernel(make_daemon):
    """Issue 49 item 2: a fresh process finds the kernel on disk (no GetKernel: the request
    histogram does not move), and the daemon's hits include it: while the process runs, within
    the reporter's period, and not twice at its exit; a process that exits at once reports at exit."""
    from client import hit_reports

    port = _free_port()
    d = make_daemon("--metrics-address", f"127.0.0.1:{port}")
    d.client(direct_hits=False).get_kernel("rmsnorm", **RMSNORM)  # compiled: a miss
    before = d.client().stats()
    agent = subprocess.Popen([sys.executable, "-c", _HIT_AGENT, str(d.socket)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout.readline().strip() == "hit"
        deadline = time.monotonic() + hit_reports.FLUSH_SECONDS + 10
        while (running := d.client().stats())["hits"] == before["hits"]:
            assert time.monotonic() < deadline, f"no report within {hit_reports.FLUSH_SECONDS} s of the hit"
            time.sleep(0.5)
    finally:
        agent.communicate("", timeout=60)
    assert agent.returncode == 0
    quick = subprocess.run([sys.executable, "-c", _HIT_AGENT, str(d.socket)], cwd=ROOT, input="", capture_output=True, text=True, timeout=120)
    assert quick.stdout.strip() == "hit", quick.stderr
    after = d.client().stats()
    assert (running["hits"], running["direct_hits"]) == (before["hits"] + 1, before["direct_hits"] + 1)
    assert (after["hits"], after["direct_hits"], after["misses"]) == (before["hits"] + 2, before["direct_hits"] + 2, before["misses"]), after
    metrics = _metrics(port)
    assert metrics["kernel_service_hits_total"] == after["hits"] and metrics["kernel_service_direct_hits_total"] == after["direct_hits"] == 2
    assert 'kernel_service_request_duration_seconds_count{outcome="hit"}' not in metrics  # neither hit was a GetKernel


def test_reported_hits_are_bounded_like_local_compiles(make_daemon):
    from proto.kernelservice.v1 import kernel_service_pb2 as pb

    c = make_daemon().client()
    with pytest.raises(Exception, match="direct_hits: expected 0 to 1000000, got -1"):
        c._stub.ReportUsage(pb.UsageReport(direct_hits=-1), timeout=10)
    assert c.stats()["hits"] == 0


# ----- observability


def test_prometheus_endpoint_reads_the_daemons_metrics(make_daemon):
    import socket as sockets

    with sockets.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = make_daemon("--metrics-address", f"127.0.0.1:{port}")
    c = d.client(direct_hits=False)
    c.get_kernel("rmsnorm", **RMSNORM)
    c._memo.clear()
    c.get_kernel("rmsnorm", **RMSNORM)
    with pytest.raises(client.InvalidSpec):  # a kind this process does not know: the daemon validates it
        c.get_kernel("no_such_kind", N=1)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    metrics = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            metrics[name] = float(value)
    stats = c.stats()
    assert metrics["kernel_service_compiles_total"] == stats["compiles"] == 1
    assert metrics["kernel_service_hits_total"] == stats["hits"] == 1
    assert metrics['kernel_service_compile_duration_seconds_count{kind="rmsnorm"}'] == 1
    assert metrics['kernel_service_compile_duration_seconds_bucket{kind="rmsnorm",le="+Inf"}'] == 1
    assert {f'kernel_service_compile_phase_duration_seconds_count{{phase="{p}"}}' for p in ("trace", "lower", "device", "link")} <= set(metrics)
    assert metrics['kernel_service_request_duration_seconds_count{outcome="hit"}'] == 1
    assert metrics['kernel_service_request_duration_seconds_count{outcome="compiled"}'] == 1
    assert metrics['kernel_service_request_duration_seconds_count{outcome="invalid_argument"}'] == 1
    for gauge in ("in_flight", "running", "queued", "workers", "workers_ready", "entries", "bytes", "evictions_total", "failures_total"):
        assert f"kernel_service_{gauge}" in metrics, gauge
    assert metrics["kernel_service_entries"] == 1 and metrics["kernel_service_bytes"] > 0
    # Loopback only unless told otherwise.
    proc = cli("serve", "--metrics-address", f"0.0.0.0:{port}", "--socket", str(d.socket) + "x")
    assert "--allow-remote" in one_line_error(proc)


def test_log_lines_for_compiles_corrupt_entries_and_slow_gets(make_daemon, caplog, monkeypatch):
    import client.api

    d = make_daemon()
    monkeypatch.setattr(client.api, "SLOW_GET", 0.0)  # every cold get counts as slow here
    with caplog.at_level(logging.INFO, logger="client.api"):
        k = d.client().get_kernel("rmsnorm", **RMSNORM)
    assert any("get_kernel(rmsnorm) waited" in r.getMessage() and "compiled" in r.getMessage() for r in caplog.records)
    assert (
        '"kind":"rmsnorm"' in d.log() and " in " in d.log() and "(trace " in d.log() and " lower " in d.log() and " device " in d.log() and " link " in d.log()
    )
    k.path.write_bytes(b"garbage")
    d.client(direct_hits=False).get_kernel("rmsnorm", **RMSNORM)
    assert "is corrupt or incomplete" in d.log()


# ----- hits without a round trip


def test_hits_are_served_from_the_cache_without_asking_and_eviction_sees_them(make_daemon):
    d = make_daemon("--max-entries", "1", "--evict-min-age", "3")
    d.client().get_kernel("rmsnorm", **RMSNORM)
    time.sleep(3.5)  # the daemon last handed it out longer ago than --evict-min-age
    before = d.client().stats()
    k = d.client().get_kernel("rmsnorm", **RMSNORM)
    assert k.outcome == "hit" and k.kind == "rmsnorm" and k.spec["params"]["N"] == 64
    after = d.client().stats()
    assert after["hits"] - after["direct_hits"] == before["hits"] - before["direct_hits"]  # no GetKernel reached the daemon
    assert time.time() - k.path.parent.stat().st_mtime < 2  # the use is on disk, where eviction looks

    d.client().get_kernel("rmsnorm", **{**RMSNORM, "N": 72})  # over budget: the other entry was just used
    stats = d.client().stats()
    assert (stats["evictions"], stats["entries"]) == (0, 2)

    # Anything amiss on disk: the client asks the daemon, which rebuilds it.
    k.path.write_bytes(k.path.read_bytes()[:100])
    fresh = d.client()
    assert fresh.get_kernel("rmsnorm", **RMSNORM).outcome == "compiled"
    assert fresh.stats()["corrupt"] == 1


def test_daemon_serves_at_once_and_warm_up_waits_for_idle_workers(make_daemon):
    t = time.monotonic()
    d = make_daemon(workers=2)
    serving = time.monotonic() - t
    stats = d.client().stats()
    assert stats["workers_ready"] < stats["workers"] == 2, stats  # TileLang still importing in the workers
    assert serving < 10
    d.client().get_kernel("rmsnorm", **RMSNORM)
    deadline = time.monotonic() + 60
    while d.client().stats()["workers_ready"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_channel_that_tried_before_the_daemon_listened_sees_it_at_once(tmp_path):
    """gRPC waits 1 s (+-20%) before retrying a socket that refused it, by default; an agent
    started beside its sidecar would wait that long after the daemon came up."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from proto import wire

    address = f"unix:{tmp_path / 'late.sock'}"
    with grpc.insecure_channel(address, options=wire.channel_options()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError):
            stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)  # nothing listens yet
        server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        server.add_insecure_port(address)
        server.start()
        try:
            started = time.monotonic()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=True)
            waited = time.monotonic() - started
        finally:
            server.stop(0)
    assert waited < 0.6, f"the channel took {waited:.2f} s to see a server that was listening"
