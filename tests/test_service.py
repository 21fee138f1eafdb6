"""The service end to end: real daemons on real sockets, real TileLang compiles."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

import client
import tests.failing_kind  # noqa: F401  (clients validate locally: they share the daemon's registry)
from compile_service.config import ServiceConfig
from tests.marks import needs_nvcc
from tests.processes import children

ROOT = Path(__file__).resolve().parent.parent


def rmsnorm_ref(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_gemm_and_rmsnorm_match_torch(make_daemon):
    d = make_daemon()
    c = d.client()
    gemm = c.get_kernel("gemm", M=48, N=40, K=72, dtype="float32", target="c")
    a, b = torch.randn(48, 72), torch.randn(72, 40)
    torch.testing.assert_close(gemm(a, b), a @ b, rtol=1e-4, atol=1e-4)
    assert gemm.outcome == "compiled"

    norm = c.get_kernel("rmsnorm", M=None, N=300, dtype="float32", target="c")
    for rows in (1, 19):  # one compiled kernel, two runtime row counts
        x, w = torch.randn(rows, 300), torch.randn(300)
        torch.testing.assert_close(norm(x, w), rmsnorm_ref(x, w), rtol=1e-4, atol=1e-4)

    assert c.get_kernel("gemm", M=48, N=40, K=72, dtype="float32", target="c") is gemm  # memoized
    stats = c.stats()
    assert (stats["compiles"], stats["misses"], stats["failures"], stats["entries"]) == (2, 2, 0, 2)


FRESH_PROCESS = textwrap.dedent(
    """
    import json, os, sys, time
    t0 = time.perf_counter()
    import client
    c = client.connect(sys.argv[1])
    out = []
    for spec in json.loads(sys.argv[2]):
        kind = spec.pop("kind")
        k = c.get_kernel(kind, target="c", **spec)
        out.append(k.outcome)
    print(json.dumps({"outcomes": out, "tilelang_imported": "tilelang" in sys.modules, "pid": os.getpid()}))
    """
)


def run_fresh(socket, specs) -> dict:
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(socket), json.dumps(specs)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


SPECS = [
    {"kind": "gemm", "M": 32, "N": 32, "K": 32, "dtype": "float32"},
    {"kind": "gemm", "M": None, "N": 16, "K": 64, "dtype": "float32", "trans_b": True},
    {"kind": "rmsnorm", "M": None, "N": 128, "dtype": "float32"},
]


def test_second_process_is_served_without_compiling(make_daemon):
    d = make_daemon()
    first = run_fresh(d.socket, [dict(s) for s in SPECS])
    assert first["outcomes"] == ["compiled"] * 3
    compiles = d.client().stats()["compiles"]
    second = run_fresh(d.socket, [dict(s) for s in SPECS])
    assert (second["outcomes"], second["tilelang_imported"]) == (["hit"] * 3, False)
    # The loader's private copies directory goes away with the process.
    assert not list(Path(tempfile.gettempdir()).glob(f"kernel-service-load-{second['pid']}-*"))
    assert d.client().stats()["compiles"] == compiles == 3

    # A restarted daemon on the same cache serves them from disk too; its counters go on from the last daemon's.
    d.stop()
    d2 = make_daemon(cache_dir=d.cache_dir)
    assert run_fresh(d2.socket, [dict(s) for s in SPECS])["outcomes"] == ["hit"] * 3
    assert d2.client().stats()["compiles"] == 3


def test_a_fresh_process_loads_cached_kernels_with_the_daemon_down(make_daemon):
    """Issue 49, item 1: the daemon leaves its ServiceInfo in the cache root; a process that finds
    no daemon computes keys from it and loads what the cache holds, strict or not, without
    TileLang. A miss still fails at once, as it did."""
    d = make_daemon()
    assert run_fresh(d.socket, [dict(s) for s in SPECS])["outcomes"] == ["compiled"] * 3
    info = d.cache_dir / "service-info.json"
    deadline = time.monotonic() + 30
    while not info.exists():  # written once the daemon is up
        assert time.monotonic() < deadline
        time.sleep(0.05)
    d.stop()
    env = {**os.environ, "KERNEL_SERVICE_CACHE_DIR": str(d.cache_dir)}
    for strict in ("0", "1"):
        done = subprocess.run(
            [sys.executable, "-c", FRESH_PROCESS, str(d.socket), json.dumps([dict(s) for s in SPECS])],
            cwd=ROOT,
            env={**env, "KERNEL_SERVICE_STRICT": strict},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert (out["outcomes"], out["tilelang_imported"]) == (["hit"] * 3, False)
    miss = 'import client; client.connect(__import__("sys").argv[1]).get_kernel("rmsnorm", M=None, N=96, dtype="float32", target="c")'
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", miss, str(d.socket)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ServiceUnavailable: no kernel service" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - start < 30


def test_stampede_of_8_processes_compiles_each_kernel_once(make_daemon):
    d = make_daemon()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FRESH_PROCESS, str(d.socket), json.dumps(SPECS)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(8)
    ]
    outcomes = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outcomes += json.loads(out.strip().splitlines()[-1])["outcomes"]
    stats = d.client().stats()
    assert stats["compiles"] == 3 and stats["failures"] == 0
    assert outcomes.count("compiled") == 3
    assert len(outcomes) == 24 and set(outcomes) <= {"compiled", "joined", "hit"}


@pytest.mark.parametrize(
    "kind, params, field",
    [
        ("conv3d", {"M": 1}, "kind"),
        ("gemm", {"N": 8, "K": 8, "dtype": "float32"}, "M"),
        ("gemm", {"M": 8, "N": 8, "K": 8, "dtype": "float32", "alpha": 2}, "alpha"),
        ("gemm", {"M": 8.0, "N": 8, "K": 8, "dtype": "float32"}, "M"),
        ("gemm", {"M": True, "N": 8, "K": 8, "dtype": "float32"}, "M"),
        ("gemm", {"M": 0, "N": 8, "K": 8, "dtype": "float32"}, "M"),
        ("gemm", {"M": 8, "N": 1 << 40, "K": 8, "dtype": "float32"}, "N"),
        ("gemm", {"M": 8, "N": 8, "K": 8, "dtype": "float16"}, "dtype"),
        ("gemm", {"M": 8, "N": 8, "K": 8, "dtype": "int4"}, "dtype"),
        ("rmsnorm", {"M": 8, "N": 8, "dtype": "float32", "eps": float("nan")}, "eps"),
    ],
)
def test_bad_input_is_rejected_before_any_work(shared_daemon, kind, params, field):
    c = shared_daemon.client()
    before = c.stats()
    with pytest.raises(client.InvalidSpec) as err:
        c.get_kernel(kind, target="c", **params)
    assert err.value.field == field and isinstance(err.value, ValueError)
    after = c.stats()
    assert (after["compiles"], after["misses"], after["entries"]) == (before["compiles"], before["misses"], before["entries"])


def test_daemon_validates_what_clients_send(shared_daemon):
    """A client that skips local validation still gets INVALID_ARGUMENT naming the field."""
    from client.api import _raise_for
    from proto.kernelservice.v1 import kernel_service_pb2 as pb
    from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
    import grpc

    c = shared_daemon.client()
    stub = pb_grpc.KernelServiceStub(c._channel)
    bad = [
        pb.KernelSpec(kind="gemm", target="c", params={"M": pb.ParamValue(string_value="x")}),
        pb.KernelSpec(kind="gemm", target="sm_12", params={}),
        pb.KernelSpec(kind="gemm", target="c", params={"M": pb.ParamValue()}),
    ]
    for spec in bad:
        with pytest.raises(grpc.RpcError) as err:
            stub.GetKernel(pb.GetKernelRequest(spec=spec), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(client.InvalidSpec):
            _raise_for(err.value, "x")
    with pytest.raises(client.InvalidSpec, match="target"):
        c.get_kernel("gemm", target="cuda -arch=sm_90", M=8, N=8, K=8, dtype="float32")


def test_compile_failure_is_reported_remembered_then_retried(make_daemon):
    d = make_daemon("--kernel-module", "tests.failing_kind", "--failure-ttl", "3")
    c = d.client()
    with pytest.raises(client.CompileError, match="Buffer X is 1-dimensional"):
        c.get_kernel("broken", target="c", N=4)
    t0 = time.monotonic()
    for _ in range(3):  # answered from memory: one compile for every caller
        with pytest.raises(client.CompileError, match=r"(?s)Buffer X is 1-dimensional.*remembered failure"):
            c.get_kernel("broken", target="c", N=4)
    stats = c.stats()
    assert (stats["failures"], stats["failures_cached"], stats["compiles"], stats["entries"]) == (1, 3, 0, 0)
    time.sleep(max(0.0, 3.2 - (time.monotonic() - t0)))
    with pytest.raises(client.CompileError) as err:  # the TTL passed: compiled again
        c.get_kernel("broken", target="c", N=4)
    assert "remembered" not in str(err.value)
    assert c.stats()["failures"] == 2


def test_truncated_library_is_rebuilt(make_daemon):
    d = make_daemon()
    c = d.client()
    k = c.get_kernel("gemm", M=16, N=16, K=16, dtype="float32", target="c")
    lib = k.path
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])
    fresh = d.client()
    k2 = fresh.get_kernel("gemm", M=16, N=16, K=16, dtype="float32", target="c")
    assert k2.outcome == "compiled"
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    torch.testing.assert_close(k2(a, b), a @ b, rtol=1e-4, atol=1e-4)
    stats = fresh.stats()
    assert stats["corrupt"] == 1 and stats["compiles"] == 2
    assert "corrupt or incomplete" in d.log()


def test_sigterm_during_compiles_leaves_no_partial_entry(make_daemon):
    d = make_daemon("--grace", "0")
    specs = [{"kind": "gemm", "M": 16 * i, "N": 16, "K": 16, "dtype": "float32", "target": "c"} for i in range(1, 9)]
    runner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import client, sys, json; print(client.connect(sys.argv[1]).prefetch(json.loads(sys.argv[2]), load=False))",
            str(d.socket),
            json.dumps(specs),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not any(d.cache_dir.joinpath("staging").iterdir()):  # wait until a compile is under way
        assert time.monotonic() < deadline
        time.sleep(0.02)
    d.signal(signal.SIGTERM)
    assert d.proc.wait(60) == 0
    runner.communicate(timeout=60)
    assert list(d.cache_dir.joinpath("staging").iterdir()) == []
    # Whatever was published is whole: a new daemon verifies every entry.
    from compile_service.metrics import Metrics
    from compile_service.store import LocalStore

    store = LocalStore(d.cache_dir, metrics=Metrics())
    keys = store.keys()
    assert len(keys) < len(specs)
    assert all(store.lookup(k) is not None for k in keys) and store.metrics.counters()["corrupt"] == 0


def test_second_daemon_is_refused_and_stale_socket_is_replaced(make_daemon):
    d = make_daemon()
    rival = make_daemon(cache_dir=d.cache_dir, start=False)
    rival.start(wait=False)
    assert rival.proc.wait(60) == 1
    assert "already serving cache dir" in rival.log() and f"pid {d.proc.pid}" in rival.log()

    d.signal(signal.SIGKILL)
    d.proc.wait()
    assert d.socket.exists()  # the socket file outlives a killed daemon
    successor = make_daemon(cache_dir=d.cache_dir, socket=d.socket)
    assert successor.client().get_kernel("rmsnorm", M=2, N=8, dtype="float32", target="c")(torch.ones(2, 8), torch.ones(8)).shape == (2, 8)


def test_missing_daemon_fails_fast(tmp_path):
    c = client.connect(tmp_path / "nobody.sock")
    t = time.monotonic()
    with pytest.raises(client.ServiceUnavailable):
        c.get_kernel("rmsnorm", M=2, N=8, dtype="float32", target="c")
    assert time.monotonic() - t < 1.0
    with pytest.raises(ConnectionError):
        c.stats()
    # An early prefetch with no daemon: sending returns at once, taking raises as prefetch does.
    pending = c.prefetch([{"kind": "rmsnorm", "M": None, "N": 8, "dtype": "float32", "target": "c"}], wait=False)
    with pytest.raises(client.ServiceUnavailable):
        pending.result()
    deadline = time.monotonic() + 2
    while not pending.sent() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pending.sent(), "the sending thread outlived the refusal"


FALLBACK = textwrap.dedent(
    """
    import sys, torch, client
    c = client.connect(sys.argv[1], fallback=True, cache_dir=sys.argv[2])
    k = c.get_kernel("rmsnorm", M=None, N=64, dtype="float32", target="c")
    x, w = torch.randn(3, 64), torch.randn(64)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(k(x, w), ref, atol=1e-5)
    print(k.outcome)
    """
)


def test_fallback_compiles_once_across_processes(tmp_path):
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FALLBACK, str(tmp_path / "nobody.sock"), str(cache)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outcomes = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outcomes.append(out.split()[-1])
    assert sorted(outcomes) == ["compiled", "hit", "hit"]


def test_a_crashed_build_reaches_a_prefetch_as_it_reaches_get_kernel(make_daemon, tmp_path):
    """A build whose worker dies on its retry too (CRASHED): its Prefetch slot holds the error
    get_kernel raises for it, type, status and message alike (proto.channel translates both)."""
    crashes = tmp_path / "crashes"
    crashes.mkdir()
    d = make_daemon("--kernel-module", "tests.failing_kind", workers=1, env={"KS_TEST_CRASH_DIR": str(crashes)})
    c = d.client()
    [slot] = c.prefetch([{"kind": "crashing", "N": 16, "times": 2, "target": "c"}])
    with pytest.raises(client.ServiceError) as raised:
        c.get_kernel("crashing", N=32, times=2, target="c")
    for err in (slot, raised.value):
        assert type(err) is client.ServiceError and err.code == "ABORTED", repr(err)
        assert str(err).startswith("kernel crashing: the compiler worker crashed: "), str(err)


def test_prefetch_streams_progress_and_reports_failures_per_kernel(make_daemon):
    d = make_daemon("--kernel-module", "tests.failing_kind")
    c = d.client()
    events = []
    specs = [
        {"kind": "rmsnorm", "M": None, "N": 32, "dtype": "float32", "target": "c"},
        {"kind": "broken", "N": 4, "target": "c"},
        {"kind": "rmsnorm", "M": None, "N": 32, "dtype": "float32", "target": "c"},  # same kernel twice
    ]
    results = c.prefetch(specs, progress=lambda done, total, e: events.append((done, total)))
    assert events == [(1, 3), (2, 3), (3, 3)]
    assert isinstance(results[1], client.CompileError)
    assert results[0] is results[2]
    x, w = torch.randn(5, 32), torch.randn(32)
    torch.testing.assert_close(results[0](x, w), rmsnorm_ref(x, w), rtol=1e-4, atol=1e-4)
    assert c.stats()["compiles"] == 1

    # An invalid spec fails its own slot only, whether this client catches it (a kind it knows)
    # or the daemon does (a kind only the daemon serves); a one-argument progress gets the event.
    mixed = [specs[0], {"kind": "rmsnorm", "M": 4, "N": -1, "dtype": "float32", "target": "c"}, {"kind": "broken", "N": "four", "target": "c"}, specs[1]]
    events = []
    results = c.prefetch(mixed, progress=events.append)
    assert isinstance(results[0], client.Kernel)
    assert [type(r) for r in results[1:]] == [client.InvalidSpec, client.InvalidSpec, client.CompileError]
    assert (results[1].field, results[2].field) == ("specs[1].N", "specs[2].N")
    assert sorted(e["index"] for e in events) == [0, 1, 2, 3] and [(e["done"], e["total"]) for e in events] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert {e["index"]: e["error_code"] for e in events if e["error_code"]} == {1: "INVALID_ARGUMENT", 2: "INVALID_ARGUMENT", 3: "FAILED_PRECONDITION"}
    assert c.prefetch([specs[2]], progress=lambda done, total: events.append((done, total)), load=False) == ["hit"] and events[-1] == (1, 1)
    with pytest.raises(TypeError, match=r"progress must take 1 \(event\), 2 \(done, total\) or 3"):
        c.prefetch([specs[0]], progress=lambda: None)
    assert c.stats()["compiles"] == 1


EARLY_AGENT = """
import json, sys, time
import client

specs = json.loads(sys.argv[2])
c = client.connect(sys.argv[1])
pending = c.prefetch(specs, wait=False)
assert "torch" not in sys.modules, "sending needs no torch"
deadline = time.monotonic() + 120
while not pending.sent() and time.monotonic() < deadline:
    time.sleep(0.05)
built = c.stats()["compiles"]  # before result(): what the daemon built on the early request alone
import torch

kernels = pending.result()
x, w = torch.randn(3, 48), torch.randn(48)
print(json.dumps({"built": built, "outcomes": [getattr(k, "outcome", type(k).__name__) for k in kernels], "y": kernels[0](x, w).tolist(), "x": x.tolist(), "w": w.tolist()}))
"""


def test_an_agent_sends_its_prefetch_before_importing_torch_and_takes_the_kernels_later(make_daemon):
    """prefetch(wait=False) sends the batch without torch; the daemon builds it before result() is
    called, and result() loads the kernels (hits now) and keeps each slot's error."""
    d = make_daemon()
    specs = [
        {"kind": "rmsnorm", "M": None, "N": 48, "dtype": "float32", "target": "c"},
        {"kind": "softmax", "M": None, "N": 48, "dtype": "float32", "target": "c"},
        {"kind": "rmsnorm", "M": None, "N": 0, "dtype": "float32", "target": "c"},  # invalid: its own slot
    ]
    run = subprocess.run([sys.executable, "-c", EARLY_AGENT, str(d.socket), json.dumps(specs)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["built"] == 2, out["built"]
    assert out["outcomes"] == ["hit", "hit", "InvalidSpec"]
    torch.testing.assert_close(torch.tensor(out["y"]), rmsnorm_ref(torch.tensor(out["x"]), torch.tensor(out["w"])), rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="progress must take"):
        d.client().prefetch(specs[:1], progress=lambda: None, wait=False)


def test_stats_cli_prints_json(shared_daemon):
    out = subprocess.run(
        [sys.executable, "-m", "compile_service.cli", "stats", "--socket", str(shared_daemon.socket), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    for name in ("compiles", "hits", "misses", "failures", "in_flight", "workers", "entries", "bytes"):
        assert name in stats
    assert stats["workers"] == 2


def test_config_sizes_pool_to_cpus_and_rejects_bad_workers(tmp_path):
    from compile_service.cpus import usable_cpus

    env = {"XDG_CACHE_HOME": str(tmp_path), "XDG_RUNTIME_DIR": "relative/ignored"}
    cfg = ServiceConfig.resolve(env=env)
    assert cfg.workers == usable_cpus()
    assert cfg.cache_dir == tmp_path / "kernel-service"
    assert cfg.socket == Path(f"/tmp/kernel-service-{os.getuid()}/kernel-service.sock")
    with pytest.raises(ValueError, match="workers"):
        ServiceConfig.resolve(workers=0, env=env)


def test_cache_budget_evicts_least_recently_used_but_not_recent_ones(make_daemon):
    specs = [dict(M=None, N=n, dtype="float32", target="c") for n in (8, 16, 24)]
    d = make_daemon("--max-entries", "2", "--evict-min-age", "0")
    c = d.client()
    for spec in specs[:2]:
        c.get_kernel("rmsnorm", **spec)
    assert d.client().get_kernel("rmsnorm", **specs[0]).outcome == "hit"  # specs[1] is now the LRU
    c.get_kernel("rmsnorm", **specs[2])
    stats = c.stats()
    assert (stats["evictions"], stats["entries"], stats["corrupt"]) == (1, 2, 0)
    fresh = d.client()
    assert fresh.get_kernel("rmsnorm", **specs[0]).outcome == "hit"
    assert fresh.get_kernel("rmsnorm", **specs[1]).outcome == "compiled"
    evicted = fresh.stats()["evictions"]
    d.stop()

    # A restart with the default min-age keeps everything handed out in the last minutes.
    d2 = make_daemon("--max-entries", "1", cache_dir=d.cache_dir)
    assert d2.client().get_kernel("rmsnorm", **specs[2]).outcome in ("hit", "compiled")
    stats = d2.client().stats()
    assert stats["evictions"] == evicted and stats["entries"] >= 2  # the counters go on; no eviction since


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o7777


def test_owner_only_by_default(shared_daemon):
    assert _mode(shared_daemon.cache_dir) == _mode(shared_daemon.socket.parent) == 0o700
    assert _mode(shared_daemon.socket) == 0o600


def test_group_shared_mode_and_loopback_tcp(make_daemon):
    import socket as sockets

    with sockets.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = make_daemon("--mode", "0750", "--tcp", f"127.0.0.1:{port}")
    assert _mode(d.cache_dir) == 0o750 and _mode(d.socket) == 0o660  # the group may read and connect
    c = client.connect(f"127.0.0.1:{port}", token_file=d.cache_dir / "tcp-token")  # TCP calls carry the daemon's token
    k = c.get_kernel("rmsnorm", M=None, N=40, dtype="float32", target="c")
    x, w = torch.randn(3, 40), torch.randn(40)
    torch.testing.assert_close(k(x, w), rmsnorm_ref(x, w), rtol=1e-4, atol=1e-4)
    assert _mode(k.path.parent) == 0o750 and {_mode(f) for f in k.path.parent.iterdir()} == {0o640}
    assert c.stats()["address"].endswith(f"tcp:127.0.0.1:{port}")

    # so_reuseport=0: a second daemon cannot bind the same port and take a share of the requests.
    rival = make_daemon("--tcp", f"127.0.0.1:{port}", start=False)
    rival.start(wait=False)
    assert rival.proc.wait(120) == 1 and "cannot listen on tcp" in rival.log()
    remote = make_daemon("--tcp", f"0.0.0.0:{port + 1}", start=False)
    remote.start(wait=False)
    assert remote.proc.wait(60) == 2 and "--allow-remote" in remote.log()


@needs_nvcc
def test_kernels_that_differ_only_on_the_host_share_one_device_binary(make_daemon):
    d = make_daemon()
    c = d.client()
    # An RMSNorm's static M (one row per block) changes only the grid, not the device code.
    specs = [{"kind": "rmsnorm", "M": m, "N": 1024, "dtype": "float16", "target": "sm_90a"} for m in (256, 512)]
    assert c.prefetch(specs, load=False) == ["compiled", "compiled"]
    binaries = list(d.cache_dir.glob("device-binaries/*/*/cuda-binaries/*"))
    assert len(binaries) == 1 and c.stats()["entries"] == 2


def _nice(stat_path: Path) -> int:
    # /proc/.../stat: "pid (comm) state ..."; nice is the 19th field, the 17th after the comm.
    return int(stat_path.read_text().rsplit(")", 1)[1].split()[16])


def test_request_threads_yield_to_compile_workers(make_daemon):
    d = make_daemon()
    d.client().stats()  # an RPC thread now exists
    threads = {int(t.name): _nice(t / "stat") for t in Path(f"/proc/{d.proc.pid}/task").iterdir()}
    below = children(d.proc.pid)
    assert below and all(_nice(Path(f"/proc/{c}/stat")) == 0 for c in below)  # the zygote, or spawned compile workers
    assert sum(nice == 10 for nice in threads.values()) >= len(threads) // 2  # gRPC's and the RPC pool's threads


def test_a_batch_compiles_its_longest_kernels_first(make_daemon):
    c = make_daemon(workers=1).client()  # one worker: kernels finish in the order they were queued
    specs = [
        {"kind": "rmsnorm", "M": 8, "N": 64, "dtype": "float32", "target": "c"},
        {"kind": "gemm", "M": 16, "N": 16, "K": 16, "dtype": "float32", "target": "c"},
        {"kind": "attention", "batch": 1, "heads": 2, "kv_heads": 1, "seq_len": 16, "head_dim": 16, "dtype": "float32", "target": "c"},
    ]
    order = []
    assert c.prefetch(specs, load=False, progress=lambda done, total, event: order.append(event["index"])) == ["compiled"] * 3
    assert order == [2, 1, 0]  # attention (cost 3), gemm (1), rmsnorm (0.5)
