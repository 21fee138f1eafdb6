"""The fleet tier against a real redis-server: several daemons on this machine, each with its
own cache and socket, stand in for hosts. Redis runs on a loopback port with docs/fleet.md's ACL
lines applied: writer hosts connect as `fleet-writer`, read-only ones as `fleet-reader`, so
the documented permissions are the ones every test runs under."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import redis
import torch

import client
import tests.slow_kind  # noqa: F401  (clients validate locally: they share the daemons' registry)
from compile_service.metrics import Metrics
from compile_service.store import BUILD, Claim, LocalStore
from compile_service.store.remote import DOWN, RETRY_AFTER, UP, RedisTier, TierUnavailable, TooLarge, blob_key, entry_key
from compile_service.store.tiered import with_fleet_tier
from devtools import redis_server
from devtools.launch import wait_serving
from proto.entry import index_record
from proto.paths import socket_address
from tests.marks import needs_nvrtc, require_redis_server
from tests.test_faults import assert_correct, get, specs, wait_for

ROOT = Path(__file__).resolve().parent.parent
LEASE = 2.0  # seconds: short, so a dead holder's build is taken over quickly
PASSWORDS = {"READER_PASSWORD": "reader-test-pw", "WRITER_PASSWORD": "writer-test-pw"}


def documented_acl() -> list[str]:
    """The ACL lines of docs/fleet.md for the fleet's two users, with test passwords."""
    lines = [line.strip() for line in (ROOT / "docs" / "fleet.md").read_text().splitlines() if line.strip().startswith("user fleet-")]
    assert sorted(line.split()[1] for line in lines) == ["fleet-reader", "fleet-writer"], lines
    for placeholder, password in PASSWORDS.items():
        lines = [line.replace(placeholder, password) for line in lines]
    return lines


@pytest.fixture(scope="module")
def redis_proc(tmp_path_factory):
    require_redis_server()
    r = redis_server.RedisProcess(documented_acl(), log_path=tmp_path_factory.mktemp("redis") / "redis.log").start()
    yield r
    r.stop()


@pytest.fixture
def tier(redis_proc):
    """The module's Redis, running and empty."""
    if redis_proc.proc.poll() is not None:
        redis_proc.start()
    with redis_proc.admin() as r:
        r.flushall()
    return redis_proc


def writer_url(r: redis_server.RedisProcess) -> str:
    return r.url("fleet-writer", PASSWORDS["WRITER_PASSWORD"])


def reader_url(r: redis_server.RedisProcess) -> str:
    return r.url("fleet-reader", PASSWORDS["READER_PASSWORD"])


def host(url: str, *extra: str, env: dict | None = None) -> dict:
    """One simulated host on the tier at `url`: one compile worker, short leases."""
    return {"args": ("--remote", url, "--remote-lease-seconds", str(LEASE), *extra), "env": env or {}}


def start_hosts(make_daemon, *hosts: dict) -> list:
    """The daemons, started together (each pays TileLang's import), each with its own cache and socket."""
    daemons = [make_daemon(*h["args"], workers=1, env=h["env"], start=False) for h in hosts]
    for d in daemons:
        d.start(wait=False)
    for d in daemons:
        wait_serving(socket_address(d.socket), 180, d.proc)
    return daemons


def assert_no_tracebacks(*daemons) -> None:
    """Background threads (the tier's watcher and uploader, housekeeping) fail only in the log."""
    for d in daemons:
        assert "Traceback" not in d.log(), d.log()[-3000:]


def stats(d) -> dict:
    with d.client() as c:
        return c.stats()


def shared(r: redis_server.RedisProcess, key: str) -> bool:
    with r.admin() as a:
        return a.exists(entry_key(key)) == 1


def whole(r: redis_server.RedisProcess, key: str) -> bool:
    """Whether the tier holds `key`'s index and every blob it names, each matching its digest."""
    with r.admin() as a:
        raw = a.get(entry_key(key))
        if raw is None:
            return False
        digests = [f["sha256"] for f in json.loads(raw)["files"].values()]
        return all((b is not None and hashlib.sha256(b).hexdigest() == d) for d, b in zip(digests, a.mget([blob_key(d) for d in digests])))


def test_a_kernel_compiled_on_one_host_is_served_on_another_without_compiling(make_daemon, tier):
    metrics_port = redis_server.free_port()
    a, b = start_hosts(make_daemon, host(writer_url(tier)), host(writer_url(tier), "--metrics-address", f"127.0.0.1:{metrics_port}"))
    spec = specs(1, base=40)[0]
    with a.client() as ca, b.client() as cb:
        ka = get(ca, spec)
        key = ka.key
        wait_for(lambda: shared(tier, key), timeout=30, what="host A's write-behind")
        kb = get(cb, spec)
        assert_correct(kb)
    assert kb.path != ka.path and kb.path.read_bytes() == ka.path.read_bytes()
    sa, sb = stats(a), stats(b)
    assert (sb["compiles"], sb["remote_hits"], sb["entries"]) == (0, 1, 1)
    assert sb["remote_bytes_in"] >= kb.path.stat().st_size
    assert (sa["compiles"], sa["remote_misses"]) == (1, 1) and sa["remote_bytes_out"] >= ka.path.stat().st_size
    for s in (sa, sb):  # the documented writer ACL allows everything a writer does
        assert (s["remote_errors"], s["remote_state"], s["remote_read_only"]) == (0, "up", False)
        assert s["remote"] == tier.url("fleet-writer", "***")
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for line in ("kernel_service_remote_hits_total 1.0", 'kernel_service_remote_state{state="up"} 1.0', 'kernel_service_remote_state{state="down"} 0.0'):
        assert line in scraped.splitlines(), line
    out = subprocess.run(
        [sys.executable, "-m", "compile_service.cli", "stats", "--socket", str(b.socket)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert re.search(r"remote: redis://fleet-writer:\*\*\*@127\.0\.0\.1:\d+/0 \(up\)", out.stdout) and re.search(r"remote_hits: 1\n", out.stdout), out.stdout
    # B's copy is an ordinary local entry now: the next agent's request is a local hit.
    with b.client(direct_hits=False) as cb:
        get(cb, spec)
        assert cb.stats()["hits"] == 1
    assert_no_tracebacks(a, b)


def test_four_hosts_asking_for_the_same_20_cold_kernels_compile_each_once(make_daemon, tier):
    hosts = start_hosts(make_daemon, *[host(writer_url(tier))] * 4)
    batch = specs(20, base=64)
    start = threading.Barrier(len(hosts))
    results: dict[int, list] = {}

    def agent(i: int) -> None:
        with hosts[i].client() as c:
            start.wait()
            results[i] = c.prefetch(batch, load=False)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(hosts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(not isinstance(r, Exception) for rs in results.values() for r in rs), results
    every = [stats(d) for d in hosts]
    assert sum(s["compiles"] for s in every) == 20, [s["compiles"] for s in every]
    assert sum(s["remote_hits"] for s in every) == 60  # every other host read each one through
    assert all(s["entries"] == 20 and s["remote_errors"] == 0 for s in every)
    assert sum(s["remote_lease_waits"] for s in every) > 0
    assert sum(s["compiles"] > 0 for s in every) > 1, "one host built everything: the others only waited"
    assert_no_tracebacks(*hosts)


def test_a_compile_failure_is_remembered_by_the_whole_fleet_for_its_ttl(make_daemon, tier):
    import tests.failing_kind  # noqa: F401

    broken = ("--kernel-module", "tests.failing_kind", "--failure-ttl", "30")
    a, b = start_hosts(make_daemon, host(writer_url(tier), *broken), host(writer_url(tier), *broken))
    with a.client() as ca, pytest.raises(client.CompileError):
        ca.get_kernel("broken", N=32, target="c")
    with tier.admin() as r:
        (failed,) = r.keys("ks:failed:*")
        assert 0 < r.pttl(failed) <= 30_000
    with b.client() as cb, pytest.raises(client.CompileError) as err:
        cb.get_kernel("broken", N=32, target="c")
    assert "this compile failed on" in str(err.value) and "the fleet tries it again in" in str(err.value)
    sb = stats(b)
    assert (sb["failures"], sb["failures_cached"], sb["compiles"]) == (0, 1, 0)
    with tier.admin() as r:
        assert r.keys("ks:lease:*") == []  # A let go of its lease when the compile failed


def test_kill_9_of_the_lease_holder_lets_another_host_build_within_the_lease_time(make_daemon, tier):
    # Host A builds slowly (its worker sleeps first), so it surely holds the lease when killed.
    slow = ("--kernel-module", "tests.slow_kind")
    a, b = start_hosts(make_daemon, host(writer_url(tier), *slow, env={"KS_TEST_BUILD_DELAY": "120"}), host(writer_url(tier), *slow))
    spec = {"kind": "slow_rmsnorm", "M": None, "N": 24, "dtype": "float32", "target": "c"}

    def ask_a() -> None:
        with contextlib.suppress(client.ServiceUnavailable, client.ServiceError), a.client(timeout=30) as c:
            get(c, spec)

    threading.Thread(target=ask_a, daemon=True).start()
    with tier.admin() as r:
        wait_for(lambda: r.keys("ks:lease:*"), timeout=60, what="host A's lease")
    got: dict = {}

    def ask_b() -> None:
        with b.client() as c:
            got["kernel"] = get(c, spec)
            got["at"] = time.monotonic()

    tb = threading.Thread(target=ask_b)
    tb.start()
    wait_for(lambda: stats(b)["remote_lease_waits"] == 1, timeout=30, what="host B waiting on A's lease")
    killed = time.monotonic()
    os.killpg(a.proc.pid, signal.SIGKILL)  # the daemon and its compile workers: the whole host
    a.proc.wait()
    tb.join(60)
    assert "kernel" in got, "host B never got the kernel"
    k = got["kernel"]
    assert_correct_like_rmsnorm(k)
    # B started building within the lease time after the kill (plus one poll and some slack).
    started_building = got["at"] - killed - k.compile_seconds
    assert started_building <= LEASE + 1.5, started_building
    sb = stats(b)
    assert (sb["compiles"], sb["remote_takeovers"], sb["remote_lease_waits"]) == (1, 1, 1)
    with tier.admin() as r:
        wait_for(lambda: shared(tier, k.key) and not r.keys("ks:lease:*"), timeout=30, what="B's entry shared and its lease released")


def assert_correct_like_rmsnorm(kernel) -> None:
    import torch

    from kernels.reference import make_inputs, reference

    p = kernel.spec["params"]
    inputs = make_inputs("rmsnorm", p)
    torch.testing.assert_close(kernel(*inputs), reference("rmsnorm", p, inputs), rtol=1e-4, atol=1e-4)


def test_redis_stopped_mid_burst_serves_every_request_and_the_tier_comes_back(make_daemon, tier):
    hosts = start_hosts(make_daemon, host(writer_url(tier)), host(writer_url(tier)))
    batch = specs(8, base=300)
    errors: list = []
    served = []

    def agent(d, items) -> None:
        with d.client() as c:
            for spec in items:
                try:
                    get(c, spec)
                    served.append(spec)
                except Exception as exc:  # noqa: BLE001 - counted: there must be none
                    errors.append(exc)

    threads = [threading.Thread(target=agent, args=(d, batch[::step])) for d in hosts for step in (1, -1)]
    for t in threads:
        t.start()
    wait_for(lambda: len(served) >= 2, timeout=120, what="the burst under way")
    tier.stop()
    for t in threads:
        t.join(300)
    assert errors == [] and len(served) == 4 * len(batch)
    down = [stats(d) for d in hosts]
    assert any(s["remote_state"] == DOWN and s["remote_errors"] > 0 for s in down), [(s["remote_state"], s["remote_errors"]) for s in down]

    tier.start()  # the same port, empty: the hosts find it again by themselves
    wait_for(lambda: all(stats(d)["remote_state"] == UP for d in hosts), timeout=RETRY_AFTER + 10, what="the tier back up")
    a, b = hosts
    late = specs(1, base=600)[0]
    with a.client() as ca, b.client() as cb:
        key = get(ca, late).key
        wait_for(lambda: shared(tier, key), timeout=30, what="a write-behind after the restart")
        before = cb.stats()
        assert_correct(get(cb, late))
        after = cb.stats()
    assert after["compiles"] == before["compiles"] and after["remote_hits"] == before["remote_hits"] + 1
    assert_no_tracebacks(*hosts)


def test_a_corrupt_blob_in_redis_is_refused_and_the_kernel_rebuilt_locally(make_daemon, tier):
    a, b = start_hosts(make_daemon, host(writer_url(tier)), host(writer_url(tier)))
    spec = specs(1, base=200)[0]
    with a.client() as ca:
        key = get(ca, spec).key
    wait_for(lambda: shared(tier, key), timeout=30, what="host A's write-behind")
    with tier.admin() as r:
        index = json.loads(r.get(entry_key(key)))
        library = blob_key(index["files"][index["library"]]["sha256"])
        data = bytearray(r.get(library))
        data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size
        r.set(library, bytes(data))
    with b.client() as cb:
        kb = get(cb, spec)
        assert_correct(kb)
    sb = stats(b)
    assert (sb["remote_corrupt"], sb["remote_hits"], sb["compiles"], sb["corrupt"]) == (1, 0, 1, 0)
    # B's rebuild replaced the damaged entry in the tier with a whole one.
    wait_for(lambda: whole(tier, key), timeout=30, what="the tier's entry whole again")
    assert_no_tracebacks(a, b)


def test_a_read_only_hosts_writes_are_refused_by_redis_itself(make_daemon, tier, tmp_path):
    # The ACL, not the flag: Redis refuses the reader user's writes, whoever sends them.
    with redis.Redis.from_url(reader_url(tier)) as reader:
        assert reader.get(entry_key("0" * 64)) is None  # reads are allowed
        for write in (lambda: reader.set(entry_key("0" * 64), b"x"), lambda: reader.delete(entry_key("0" * 64)), lambda: reader.eval("return 1", 0)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                write()
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.get("elsewhere:key")  # and only under ks:

    # A daemon given reader credentials but not --remote-read-only tries to write: refused, counted, served anyway.
    metrics = Metrics()
    store = with_fleet_tier(LocalStore(tmp_path / "cache", metrics=metrics), RedisTier(reader_url(tier), metrics=metrics), metrics)
    try:
        key = "ab" * 32
        assert not store.claims.claim(key, {"kind": "k"}, wake=lambda: None).waiting  # the lease was refused: build here
        staging = store.new_staging(key)
        (staging / "kernel.so").write_bytes(os.urandom(64))
        meta = {"spec": {"kind": "k"}, "abi": {"loader": "c", "symbol": "call", "device": "cpu", "params": [], "outputs": [], "dynamic": []}}
        assert store.put(key, staging, "kernel.so", meta).key == key
        wait_for(lambda: metrics.counters()["remote_errors"] >= 2, timeout=10, what="the refused upload")
    finally:
        store.close()
    with tier.admin() as r:
        assert r.keys("ks:*") == []

    # With the flag, the read-only host reads what writers share and tries no write at all.
    w, ro = start_hosts(make_daemon, host(writer_url(tier)), host(reader_url(tier), "--remote-read-only"))
    first, second = specs(2, base=500)
    with w.client() as cw, ro.client() as cr:
        key = get(cw, first).key
        wait_for(lambda: shared(tier, key), timeout=30, what="the writer's write-behind")
        assert_correct(get(cr, first))
        own = get(cr, second).key
    time.sleep(0.5)  # a write-behind, were there one, is done by now
    s = stats(ro)
    assert (s["remote_hits"], s["compiles"], s["remote_errors"], s["remote_bytes_out"], s["remote_read_only"]) == (1, 1, 0, 0, True)
    assert not shared(tier, own)
    assert_no_tracebacks(w, ro)


# ----- the tier's store in this process, on fake entries (no TileLang): its checks one by one

ABI = {"loader": "c", "symbol": "call", "device": "cpu", "params": [{"name": "Y", "dtype": "float32", "shape": [4]}], "outputs": [0], "dynamic": []}


def tiered(url: str, root: Path) -> LocalStore:
    metrics = Metrics()
    return with_fleet_tier(LocalStore(root, metrics=metrics), RedisTier(url, metrics=metrics), metrics)


def share_fake_entry(url: str, root: Path, key: str, spec: dict) -> None:
    """Publishes a fake entry on a writer host and waits until its write-behind is done."""
    store = tiered(url, root)
    try:
        staging = store.new_staging(key)
        (staging / "kernel.so").write_bytes(os.urandom(4096))
        (staging / "kernel.c").write_text("/* generated */")
        store.put(key, staging, "kernel.so", {"spec": spec, "abi": ABI})
    finally:
        store.close()  # drains the upload


def test_a_read_through_is_checked_like_a_local_build_and_published_without_fsync(tier, tmp_path, monkeypatch):
    key, spec = "cd" * 32, {"kind": "fake", "params": {"N": 4}}
    share_fake_entry(writer_url(tier), tmp_path / "a", key, spec)
    store = tiered(writer_url(tier), tmp_path / "b")
    fsyncs = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
    try:
        entry = store.claims.claim(key, spec, wake=lambda: None).entry
        assert entry is not None and entry.meta["spec"] == spec
        assert fsyncs == []  # a fetch is cheap to repeat: no fsync on the way (LocalStore.put durable=False)
        assert (entry.path / "kernel.c").read_text() == "/* generated */"
        assert store.metrics.counters()["remote_hits"] == 1
    finally:
        store.close()
    # Torn by a crash before the page cache reached the disk: after a restart, a miss.
    (entry.path / "kernel.so").write_bytes(b"\0" * 4096)
    assert LocalStore(tmp_path / "b", metrics=Metrics()).lookup(key, spec) is None


PLANTED = {  # what a compromised or buggy writer might leave under an index
    "another spec": lambda index: index["meta"].update(spec={"kind": "fake", "params": {"N": 8}}),
    "a path for a file name": lambda index: index["files"].update({"../../evil.so": index["files"]["kernel.so"]}),
    "no library": lambda index: index["files"].pop("kernel.so"),
    "a garbage abi": lambda index: index["meta"].update(abi={"loader": "c", "params": "all"}),
    "sizes past the limit": lambda index: index["files"]["kernel.so"].update(size=1 << 40),
    "another schema": lambda index: index.update(schema=99),
    "a name no entry may hold": lambda index: index["files"].update({"_kernel.so": index["files"]["kernel.so"]}),
    "its own entry.json listed": lambda index: index["files"].update({"entry.json": index["files"]["kernel.c"]}),
}


@pytest.mark.parametrize("damage", sorted(PLANTED))
def test_an_index_that_fails_the_checks_is_refused_counted_and_dropped(tier, tmp_path, damage):
    key, spec = "ef" * 32, {"kind": "fake", "params": {"N": 4}}
    share_fake_entry(writer_url(tier), tmp_path / "a", key, spec)
    with tier.admin() as r:
        index = json.loads(r.get(entry_key(key)))
        PLANTED[damage](index)
        r.set(entry_key(key), json.dumps(index))
    store = tiered(writer_url(tier), tmp_path / "b")
    try:
        claim = store.claims.claim(key, spec, wake=lambda: None)
        assert claim.entry is None and not claim.waiting  # refused: built here, under this host's lease
        assert store.metrics.counters()["remote_corrupt"] == 1 and store.keys() == []
        with tier.admin() as r:
            assert r.get(entry_key(key)) is None and r.get(f"ks:lease:{key}") == store.claims.tier.host.encode()
        store.claims.abandon(key)
    finally:
        store.close()
    assert not (tmp_path / "evil.so").exists()


def test_a_hung_redis_costs_one_timeout_per_interval_then_the_tier_recovers(tier):
    """SIGSTOP: connections are accepted, nothing answers (a slow or wedged server)."""
    tier_ = RedisTier(writer_url(tier), timeout=0.3, metrics=Metrics())
    try:
        tier_.ping()
        os.kill(tier.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(TierUnavailable):
                tier_.look("0" * 64)
            first = time.monotonic() - start
            start = time.monotonic()
            for _ in range(20):
                with pytest.raises(TierUnavailable):
                    tier_.look("0" * 64)
            rest = time.monotonic() - start
        finally:
            os.kill(tier.proc.pid, signal.SIGCONT)
        assert 0.25 <= first < 1.5 and rest < 0.1, (first, rest)
        assert tier_.state == DOWN and tier_.metrics.counters()["remote_errors"] == 1
        time.sleep(tier_.retry_in() + 0.05)
        assert tier_.look("0" * 64) == (None, None, 0.0, False) and tier_.state == UP
    finally:
        tier_.close()


def test_a_host_started_without_its_redis_says_so_and_finds_it_when_it_comes(tmp_path):
    require_redis_server()
    late = redis_server.RedisProcess(port=redis_server.free_port(), log_path=tmp_path / "late.log")
    store = tiered(late.url(), tmp_path / "cache")
    try:
        wait_for(lambda: store.claims.tier.state == DOWN, timeout=5, what="the tier reported down without any request")
        assert store.claims.claim("12" * 32, {}, wake=lambda: None) == BUILD  # served locally meanwhile
        late.start()
        wait_for(lambda: store.claims.tier.state == UP, timeout=RETRY_AFTER + 5, what="the tier up again by itself")
    finally:
        store.close()
        late.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--remote", "http://u:secret@host/0"], r"--remote 'http://u:\*\*\*@host/0': expected a redis://, rediss:// or unix:// URL"),
        (["--remote-read-only"], r"--remote-read-only needs a tier to read: pass --remote URL \(or set KERNEL_SERVICE_REMOTE\)"),
        (["--remote", "redis://h:6379", "--remote-lease-seconds", "0"], r"--remote-lease-seconds: expected a number of seconds above 0"),
    ],
)
def test_bad_fleet_flags_are_refused_with_one_line(args, message, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KERNEL_SERVICE_REMOTE"}
    out = subprocess.run(
        [sys.executable, "-m", "compile_service.cli", "serve", "--socket", str(tmp_path / "s.sock"), "--cache-dir", str(tmp_path / "c"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and re.search(message, out.stderr), out.stderr
    assert "secret" not in out.stderr


# ----- a fleet that never compiles where it serves: a CPU-only builder feeds serve-only hosts


def sm90a_specs(n: int, base: int = 256) -> list[dict]:
    """n distinct cheap CUDA kernels, cross-compiled here (no GPU needed)."""
    kinds = ("rmsnorm", "softmax", "swiglu")
    return [{"kind": kinds[i % 3], "M": None, "N": base + 64 * i, "dtype": "float16", "target": "sm_90a"} for i in range(n)]


def serve_only(url: str, *extra: str) -> dict:
    """A serve-only host: no compile workers, CUDA kernels keyed by the builders' NVRTC, reading the tier."""
    return host(url, "--remote-read-only", "--no-compile", "--cuda-compiler-id", NVRTC_ID, *extra)


NVRTC_ID = "nvrtc-13.0"


@needs_nvrtc
def test_a_cpu_only_builder_feeds_three_serve_only_hosts_that_never_compile(make_daemon, tier):
    """The builder compiles (cross-compiling sm_90a on this CPU-only machine) for the
    requests it is sent; strict agents on three --no-compile hosts get every kernel from the
    tier: each kernel built once in the whole fleet, none on the hosts that serve."""
    builder = make_daemon(*host(writer_url(tier), "--cuda-compiler", "nvrtc")["args"], workers=2, start=False)
    servers = [make_daemon(*serve_only(reader_url(tier))["args"], workers=1, start=False) for _ in range(3)]
    for d in (builder, *servers):
        d.start(wait=False)
    for d in (builder, *servers):
        wait_serving(socket_address(d.socket), 180, d.proc)
    assert stats(builder)["cuda_compiler"] == NVRTC_ID
    batch = sm90a_specs(20) + specs(20, base=900)
    with builder.client() as c:  # a builder-side request: what prewarm or a prefetch sends
        assert all(r == "compiled" for r in c.prefetch(batch, load=False)), "the builder did not build everything"
    with tier.admin() as r:  # the write-behind: every entry in the tier, every lease let go
        wait_for(lambda: len(r.keys("ks:entry:*")) == len(batch) and not r.keys("ks:lease:*"), timeout=60, what="the builder's uploads")

    results: dict[int, list] = {}

    def strict_agent(i: int) -> None:
        with servers[i].client(strict=True) as c:
            results[i] = c.prefetch(batch)

    threads = [threading.Thread(target=strict_agent, args=(i,)) for i in range(len(servers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1, 2]
    for kernels in results.values():
        assert all(not isinstance(k, Exception) for k in kernels), [k for k in kernels if isinstance(k, Exception)][:3]
        assert [k.abi["loader"] for k in kernels[:20]] == ["tvm_ffi"] * 20  # loaded (running them needs a GPU)
    for k in results[0][20:23]:
        assert_correct(k)
    every = [stats(d) for d in servers]
    assert [(s["compiles"], s["workers"], s["remote_hits"], s["entries"], s["not_ready"]) for s in every] == [(0, 0, 40, 40, 0)] * 3
    assert all(s["remote_errors"] == 0 and s["remote_bytes_out"] == 0 for s in every)
    assert stats(builder)["compiles"] == len(batch)  # each kernel built once in the fleet

    # What the tier lacks is not ready, at once, and says where kernels come from.
    missing = sm90a_specs(1, base=4096)[0]
    with servers[0].client(strict=True) as c, pytest.raises(client.KernelNotReady) as err:
        get(c, missing)
    assert "the fleet tier does not have it" in str(err.value) and "prewarm --remote" in str(err.value)
    assert stats(servers[0])["compiles"] == 0
    assert_no_tracebacks(builder, *servers)


def test_a_serve_only_host_whose_tier_is_unreachable_says_so_with_its_address(make_daemon):
    """Redis down (nothing listens on the port): the miss names the tier's address and says that
    it is unreachable, not that the tier lacks the kernel."""
    url = f"redis://127.0.0.1:{redis_server.free_port()}/0"
    d = make_daemon(*serve_only(url)["args"], workers=1)
    with d.client() as c, pytest.raises(client.KernelNotReady) as err:
        get(c, specs(1, base=4200)[0])
    assert f"the fleet tier {url} is unreachable (" in str(err.value), str(err.value)
    assert "does not have it" not in str(err.value)
    assert stats(d)["compiles"] == 0


# ----- bounds on what Redis sends: a hostile server on loopback, and a planted index on a real one

STREAM_CAP = 64 << 20  # what the hostile server sends at most before it gives up (unbounded reads take it all)


class HostileRedis:
    """A loopback server speaking just enough RESP2 for the tier; `answer(command)` gives the
    reply to each command as bytes, or an endless iterator of chunks, streamed until the client
    goes away or STREAM_CAP bytes are out. `sent` counts the bytes that got out."""

    def __init__(self, answer):
        import socket

        self.answer, self.sent = answer, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # what is sent is what the client read, near enough
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        reader = conn.makefile("rb")
        with conn:
            try:
                while True:
                    line = reader.readline()
                    if not line.startswith(b"*"):
                        return
                    command = []
                    for _ in range(int(line[1:])):
                        size = int(reader.readline()[1:])
                        command.append(reader.read(size + 2)[:-2])
                    reply = self.answer([command[0].upper(), *command[1:]])
                    for chunk in [reply] if isinstance(reply, bytes) else reply:
                        conn.sendall(chunk)
                        self.sent += len(chunk)
                        if self.sent >= STREAM_CAP:
                            return
            except OSError:  # the client closed its end: what it read is all it gets
                return

    def close(self) -> None:
        self.listener.close()


def endless(head: bytes):
    yield head
    while True:
        yield b"x" * (64 << 10)


def answers(entry_reply, mget_reply=b"*0\r\n"):
    """A Redis whose every key is absent, but for the entry (`entry_reply`) and MGET's reply."""

    def answer(command):
        name = command[0]
        if name == b"GET":
            return entry_reply if command[1].startswith(b"ks:entry:") else b"$-1\r\n"
        if name == b"MGET":
            return mget_reply
        known = {b"PTTL": b":-2\r\n", b"EXISTS": b":0\r\n", b"EVAL": b":1\r\n", b"DEL": b":1\r\n", b"PING": b"+PONG\r\n", b"CLIENT": b"+OK\r\n"}
        known[b"HELLO"] = b"%1\r\n$5\r\nproto\r\n:3\r\n"  # a client that asks for RESP3 (redis-py's default) gets it
        return known.get(name, b"-ERR unknown command\r\n")

    return answer


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(lambda: endless(b"$2000000000\r\n"), id="a bulk reply without end"),
        pytest.param(lambda: endless(b"+"), id="a status line without its CRLF"),
    ],
)
def test_a_redis_that_streams_an_endless_reply_is_read_no_further_than_a_look_allows(reply):
    server = HostileRedis(answers(reply()))
    tier_ = RedisTier(server.url, timeout=5, metrics=Metrics())
    try:
        start = time.monotonic()
        with pytest.raises(TooLarge, match="larger than the .* bytes this call allows"):
            tier_.look("0" * 64)
        took = time.monotonic() - start
    finally:
        tier_.close()
        server.close()
    # A look allows two indexes' worth (about 3 MiB); the rest is the kernel's socket buffers.
    assert server.sent < 16 << 20 and took < 5, (server.sent, took)
    assert tier_.metrics.counters()["remote_errors"] == 1 and tier_.state == UP  # counted; the breaker stays closed


def test_a_redis_that_drips_its_reply_costs_a_call_no_more_than_its_time_bound():
    """Each byte comes well within the socket timeout (a tenth of it), so no single read times
    out: the call's own bound ends it, and says so (redis-py 8.2 rewrites the message of any
    redis.TimeoutError raised under a read, so the bound is not one)."""

    def drip():
        yield b"$1000\r\n"
        for _ in range(400):  # 20 s in all, unless the client hangs up first
            time.sleep(0.05)
            yield b"x"

    server = HostileRedis(answers(drip()))
    tier_ = RedisTier(server.url, timeout=0.5, metrics=Metrics())
    try:
        start = time.monotonic()
        with pytest.raises(TierUnavailable, match="took longer than the .*s this call allows"):
            tier_.look("0" * 64)
        took = time.monotonic() - start
    finally:
        tier_.close()
        server.close()
    assert took < 5 * 0.5 + 1.5, took  # CALL_TIMEOUTS timeouts, plus one read's
    assert tier_.state == DOWN  # a server this slow is treated as a hung one


def test_blobs_larger_than_their_index_declares_are_read_no_further_and_refused(tmp_path):
    """The index is well-formed and declares a 1-byte library; the server sends a 256 MiB one."""
    key, spec = "a1" * 32, {"kind": "fake", "params": {"N": 4}}
    files = {"kernel.so": {"sha256": "b2" * 32, "size": 1}}
    index = json.dumps(index_record("kernel.so", files, {"spec": spec, "abi": ABI}, "elsewhere")).encode()
    server = HostileRedis(answers(b"$%d\r\n%s\r\n" % (len(index), index), endless(b"*1\r\n$268435456\r\n")))
    metrics = Metrics()
    store = with_fleet_tier(LocalStore(tmp_path / "cache", metrics=metrics), RedisTier(server.url, timeout=5, metrics=metrics), metrics)
    try:
        assert store.claims.claim(key, spec, wake=lambda: None) == BUILD  # refused: built here
        assert store.claims.fetch(key, spec) == Claim()  # and a host that may not build has nothing
    finally:
        store.close()
        server.close()
    assert server.sent < 16 << 20, server.sent  # two reads, each stopped past the declared byte (plus framing)
    assert metrics.counters()["remote_corrupt"] == 2 and store.keys() == []


def test_a_planted_index_declaring_one_byte_files_is_refused_and_not_published(tier, tmp_path):
    """On a real Redis: a writer's genuine entry (an 8 MiB library), its index then rewritten to
    declare 1-byte files. The blobs match their digests; only their sizes give it away."""
    key, spec = "5e" * 32, {"kind": "fake", "params": {"N": 4}}
    store = tiered(writer_url(tier), tmp_path / "a")
    try:
        staging = store.new_staging(key)
        (staging / "kernel.so").write_bytes(os.urandom(8 << 20))
        (staging / "kernel.c").write_text("/* generated */")
        store.put(key, staging, "kernel.so", {"spec": spec, "abi": ABI})
    finally:
        store.close()
    with tier.admin() as r:
        index = json.loads(r.get(entry_key(key)))
        for f in index["files"].values():
            f["size"] = 1
        r.set(entry_key(key), json.dumps(index))
    reader = tiered(writer_url(tier), tmp_path / "b")
    try:
        claim = reader.claims.claim(key, spec, wake=lambda: None)
        assert claim.entry is None and not claim.waiting  # refused: built here, under this host's lease
        reader.claims.abandon(key)
        counters = reader.metrics.counters()
        assert (counters["remote_corrupt"], counters["remote_hits"], counters["remote_bytes_in"]) == (1, 0, len(json.dumps(index)))
        assert reader.keys() == []
        with tier.admin() as r:
            assert r.get(entry_key(key)) is None  # dropped by this writer host: the next one builds it again
    finally:
        reader.close()


def test_prewarm_remote_fills_the_tier_without_a_daemon_and_serve_only_hosts_serve_it(make_daemon, tier, tmp_path):
    """Three kernels and one copy of a shared build (tests.shared_kind: its build is what
    travels; each host makes the copies)."""
    import tests.shared_kind  # noqa: F401
    from proto import manifest

    copy = {"kind": "row_double", "M": 8, "N": 16, "target": "c"}
    batch = [*specs(3, base=1400), copy]
    path = tmp_path / "app.json"
    path.write_text(
        json.dumps(
            manifest.make("app", [{"kind": s["kind"], "target": "c", "params": {k: v for k, v in s.items() if k not in ("kind", "target")}} for s in batch])
        )
    )

    zygotes = tmp_path / "zygotes"  # a line each time the prewarm starts the workers' zygote

    def prewarm() -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "KERNEL_SERVICE_SOCKET"} | {"KERNEL_SERVICE_SOCKET": str(tmp_path / "no-daemon.sock")}
        args = ["prewarm", str(path), "--remote", writer_url(tier), "--workers", "1", "--kernel-module", "tests.shared_kind"]
        script = (
            "import sys; import multiprocessing.forkserver as fs; start = fs.ForkServer.ensure_running\n"
            "def noted(self):\n"
            f"    if self._forkserver_pid is None: open({str(zygotes)!r}, 'a').write('started\\n')\n"
            "    return start(self)\n"
            "fs.ForkServer.ensure_running = noted; fs.ensure_running = fs._forkserver.ensure_running  # the module's alias too\n"
            f"from compile_service.cli import main; sys.exit(main({args!r}))"
        )
        return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    first = prewarm()
    assert first.returncode == 0, first.stderr[-3000:]
    assert "built 4, already there 0, failed 0 (of 4 kernels) in the fleet tier redis://fleet-writer:***@" in first.stdout, first.stdout
    assert PASSWORDS["WRITER_PASSWORD"] not in first.stdout + first.stderr
    assert zygotes.read_text() == "started\n"
    with tier.admin() as r:  # the copy's build (M=None) is shared, not the copy
        assert len(r.keys("ks:entry:*")) == 4 and r.keys("ks:lease:*") == []
    again = prewarm()  # what the tier holds is neither built nor fetched again
    assert again.returncode == 0 and "built 0, already there 4, failed 0" in again.stdout, again.stdout + again.stderr[-2000:]
    assert zygotes.read_text() == "started\n"  # nor is TileLang imported for nothing: no zygote started

    (server,) = start_hosts(make_daemon, serve_only(reader_url(tier), "--kernel-module", "tests.shared_kind"))
    with server.client(strict=True) as c:
        for spec in batch[:3]:
            assert_correct(get(c, spec))
        k = get(c, {**copy, "M": 5})  # a copy no one asked for before: its build is fetched, the copy made here
        x = torch.randn(5, 16)
        torch.testing.assert_close(k(x), 2 * x)
        assert k.abi["fixed"] == {"M": 5}
    s = stats(server)
    assert (s["compiles"], s["remote_hits"], s["derived"], s["not_ready"]) == (0, 4, 1, 0)


def test_a_host_that_may_not_build_says_a_builder_is_at_it_and_answers_with_the_fleets_failure(tier, tmp_path):
    """In this process: a serve-only scheduler (no workers) over the tier."""
    import kernels
    from compile_service.build.compiler import CompileFailed
    from compile_service.scheduler import NotReady, Scheduler

    store = tiered(reader_url(tier), tmp_path / "serve")
    scheduler = Scheduler(store, store.claims, workers=1, metrics=store.metrics, compiles=False, start=False)
    try:
        spec = kernels.canonicalize("rmsnorm", {"M": None, "N": 72, "dtype": "float32"}, "c")
        key = scheduler.key_of(spec)
        with tier.admin() as r:
            r.set(f"ks:lease:{key}", b"builder-1", px=30_000)
        start = time.monotonic()
        future, _ = scheduler.request(spec)
        with pytest.raises(NotReady, match="a builder of the fleet is building it now"):
            future.result(timeout=5)
        assert time.monotonic() - start < 1  # at once: a host that may not build never waits
        writer = RedisTier(writer_url(tier))
        writer.put_failure(key, "error: the lowering refused it", 30)
        writer.close()
        future, _ = scheduler.request(spec)
        with pytest.raises(CompileFailed, match="(?s)the lowering refused it.*this compile failed on"):
            future.result(timeout=5)
        counters = store.metrics.counters()
        assert (counters["compiles"], counters["not_ready"], counters["failures_cached"], counters["remote_misses"]) == (0, 1, 1, 1)
    finally:
        scheduler.shutdown(1)
        store.close()
