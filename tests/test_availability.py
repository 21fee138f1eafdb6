"""Availability under hostile clients: idle calls, unread streams, waiting compiles, idle
scrapers and floods must not delay another client's hits and health checks (issue 32).

The attacks run in a subprocess of their own (grpc.aio, so thousands of calls cost it no
threads), over loopback and the daemon's Unix socket, against a daemon whose one compile
worker sleeps in the slow test kind (tests/slow_kind.py), so cold requests surely wait.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket as sockets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from proto.wire import Outcome

ROOT = Path(__file__).resolve().parent.parent
HIT = {"M": None, "N": 128, "dtype": "float32"}
HOSTILE = 200  # of each kind of attack: well past the 64 threads the daemon's pool once had
HIT_P99 = 0.010  # seconds: the bound the issue states for a legitimate client's hits
HIT_SAMPLE = 600  # hits a p99 is measured over

# Holds, until killed: HOSTILE GetKernel calls that never send their message, on the Unix
# socket and over TCP without the token; HOSTILE Prefetch streams of a slow cold kernel,
# never read; HOSTILE cold GetKernels of slow kernels. Prints "ready" once all are sent.
ATTACK = r"""
import asyncio, sys
import grpc
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2 as pb

unix, tcp, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
GET = "/kernelservice.v1.KernelService/GetKernel"
PREFETCH = "/kernelservice.v1.KernelService/Prefetch"

def slow(i):
    return wire.spec_to_proto("slow_rmsnorm", {"M": None, "N": 64 * (i + 1), "dtype": "float32"}, "c")

async def never():
    await asyncio.Event().wait()
    yield b""

async def main():
    # As a raw client makes them: a process's channels to one target share one connection.
    unix_channel, tcp_channel = grpc.aio.insecure_channel(unix), grpc.aio.insecure_channel(tcp)
    idle = [ch.stream_unary(GET, request_serializer=bytes, response_deserializer=bytes) for ch in (unix_channel, tcp_channel)]
    prefetch = unix_channel.unary_stream(PREFETCH, request_serializer=pb.PrefetchRequest.SerializeToString, response_deserializer=pb.PrefetchEvent.FromString)
    get = unix_channel.unary_unary(GET, request_serializer=pb.GetKernelRequest.SerializeToString, response_deserializer=pb.GetKernelResponse.FromString)
    calls = []
    for i in range(n):
        calls += [call(never(), timeout=600) for call in idle]  # the message never comes
        calls.append(prefetch(pb.PrefetchRequest(specs=[slow(0)]), timeout=600))  # never read
        calls.append(get(pb.GetKernelRequest(spec=slow(i % 4)), timeout=600))
    await asyncio.sleep(3)
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

# Sends sys.argv[3] GetKernel requests of sys.argv[2] bytes each to TCP address sys.argv[1],
# 8 at a time, without the token; prints the status codes it got, one per line.
FLOOD = r"""
import asyncio, sys
import grpc

address, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

async def main():
    channel = grpc.aio.insecure_channel(address)
    call = channel.unary_unary("/kernelservice.v1.KernelService/GetKernel", request_serializer=bytes, response_deserializer=bytes)
    payload = b"\xfa\x01" + bytes(size)
    codes = []
    async def one():
        try:
            await call(payload, timeout=60)
            codes.append("OK")
        except grpc.aio.AioRpcError as err:
            codes.append(err.code().name)
    for _ in range(count // 8):
        await asyncio.gather(*(one() for _ in range(8)))
    print("\n".join(codes), flush=True)

asyncio.run(main())
"""


def free_port() -> int:
    with sockets.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def script(code: str, *args: str, **options) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env, text=True, **options)


def idle_connections(port: int, n: int) -> list[sockets.socket]:
    """`n` connections to the metrics port that never send a request."""
    held = []
    for _ in range(n):
        s = sockets.create_connection(("127.0.0.1", port), timeout=5)
        held.append(s)
    return held


def hit_latencies(stub, n: int) -> list[float]:
    request = pb.GetKernelRequest(spec=wire.spec_to_proto("rmsnorm", HIT, "c"))
    seconds = []
    for _ in range(n):
        start = time.perf_counter()
        reply = stub.GetKernel(request, timeout=5)
        seconds.append(time.perf_counter() - start)
        assert reply.cached_result
    return seconds


def p99(seconds: list[float]) -> float:
    return statistics.quantiles(seconds, n=100)[98]


@pytest.fixture
def daemon(make_daemon):
    """A daemon with TCP and metrics, one worker whose slow builds take a minute, a hit ready."""
    metrics_port, tcp = free_port(), f"127.0.0.1:{free_port()}"
    d = make_daemon(
        "--tcp",
        tcp,
        "--metrics-address",
        f"127.0.0.1:{metrics_port}",
        "--kernel-module",
        "tests.slow_kind",
        "--grace",
        "2",
        workers=1,
        env={"KS_TEST_BUILD_DELAY": "60"},
    )
    d.tcp, d.metrics_port = tcp, metrics_port
    d.client(direct_hits=False).get_kernel("rmsnorm", target="c", **HIT)  # compiled: every later ask is a hit
    return d


def test_hostile_idle_calls_and_streams_do_not_delay_a_legitimate_client(daemon, make_daemon, tmp_path):
    """Issue 32, finding 3, and issue 47, item 5: idle calls (Unix and unauthenticated TCP),
    unread Prefetch streams, waiting cold GetKernels and idle scrapers, each HOSTILE of them,
    all at once, each kind from one connection as a raw client makes them (a limit of 100 calls
    per connection once refused or held the rest): a legitimate client's hits keep a p99 within
    HIT_P99 of the same hits to a daemon beside it that no one attacks, asked in turn (what the
    machine alone costs: on a shared 2-core machine other processes take the CPUs from the
    daemons' RPC loops, nice 10, attack or not), and its health checks answer."""
    channel = grpc.insecure_channel(f"unix:{daemon.socket}", options=wire.channel_options())
    stub, health = pb_grpc.KernelServiceStub(channel), health_pb2_grpc.HealthStub(channel)
    reference = unattacked_daemon(make_daemon, tmp_path)
    reference_channel = grpc.insecure_channel(f"unix:{reference.socket}", options=wire.channel_options())
    stubs = [stub, pb_grpc.KernelServiceStub(reference_channel)]
    hits_in_turn(stubs, 20)  # the channels connected, the daemons' memos warm
    attack = script(ATTACK, f"unix:{daemon.socket}", daemon.tcp, HOSTILE, stdout=subprocess.PIPE)
    scrapers = []
    try:
        assert attack.stdout.readline().strip() == "ready", "the attack did not start"
        scrapers = idle_connections(daemon.metrics_port, HOSTILE)
        deadline = time.monotonic() + 60
        while stub.GetStats(pb.GetStatsRequest(), timeout=10).misses < 2 * HOSTILE:  # the cold calls and streams all arrived, waiting
            assert time.monotonic() < deadline, "the attack's cold calls did not all arrive"
            time.sleep(0.2)
        attacked, alone = hits_in_turn(stubs, HIT_SAMPLE)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
        token = (daemon.cache_dir / "tcp-token").read_text().strip()
        with grpc.insecure_channel(daemon.tcp) as tcp:  # a legitimate TCP client too
            check = health_pb2_grpc.HealthStub(tcp).Check(health_pb2.HealthCheckRequest(), timeout=2, metadata=(("authorization", f"Bearer {token}"),))
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        import urllib.request  # and a scraper, past the idle ones

        assert b"kernel_service_hits_total" in urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read()
        print(
            f"hits under attack: p50 {statistics.median(attacked) * 1000:.2f} ms, p99 {p99(attacked) * 1000:.2f} ms; beside it, unattacked: p99 {p99(alone) * 1000:.2f} ms"
        )
        assert p99(attacked) < p99(alone) + HIT_P99, f"hit p99 {p99(attacked) * 1000:.1f} ms under attack, {p99(alone) * 1000:.1f} ms unattacked"
    finally:
        attack.kill()
        attack.wait()
        for s in scrapers:
            s.close()
        channel.close()
        reference_channel.close()


def unattacked_daemon(make_daemon, tmp_path):
    """A serve-only daemon with the hit planted (no compile, no TileLang): the reference."""
    from compile_service.store import LocalStore
    from tests.plant import host_toolchain, plant, spec_of
    from tests.test_fleet import NVRTC_ID

    cache = tmp_path / "reference"
    planted = spec_of("rmsnorm", "c", **HIT)
    plant(LocalStore(cache), planted, host_toolchain(planted, NVRTC_ID))
    return make_daemon("--no-compile", "--cuda-compiler-id", NVRTC_ID, cache_dir=cache)


def hits_in_turn(stubs, n: int) -> list[list[float]]:
    """`n` hits to each stub's daemon, asked in turn, so that both see the machine's same moments."""
    seconds = [[] for _ in stubs]
    for _ in range(n):
        for stub, taken in zip(stubs, seconds):
            taken += hit_latencies(stub, 1)
    return seconds


def test_an_unauthenticated_tcp_flood_is_refused_without_buffering_it(daemon):
    """Issue 32, finding 4: 15 MB requests over TCP without the token are refused
    UNAUTHENTICATED from their metadata; the daemon's peak memory grows by less than 64 MiB
    (it once reached 641 MB), and a hit meanwhile stays fast."""
    pid = daemon.proc.pid
    before = status_kib(pid, "VmHWM")
    flood = script(FLOOD, daemon.tcp, 15 << 20, 48, stdout=subprocess.PIPE)
    stub = pb_grpc.KernelServiceStub(grpc.insecure_channel(f"unix:{daemon.socket}", options=wire.channel_options()))
    seconds = []
    while flood.poll() is None:
        seconds += hit_latencies(stub, 10)
        time.sleep(0.01)
    codes = flood.stdout.read().split()
    assert codes == ["UNAUTHENTICATED"] * 48, codes
    grown = status_kib(pid, "VmHWM") - before
    print(f"flood: peak RSS +{grown >> 10} MiB, hit p50 {statistics.median(seconds) * 1000:.2f} ms")
    assert grown < 64 << 10, f"the daemon's peak RSS grew by {grown >> 10} MiB"
    assert len(seconds) >= 10 and statistics.median(seconds) < HIT_P99, f"hit p50 {statistics.median(seconds) * 1000:.1f} ms during the flood"


def test_idle_scrapers_hold_no_thread_and_the_daemon_stops_on_sigterm(daemon):
    """Issue 32, finding 3: 700 idle connections to the metrics port once held a daemon thread
    each, and kept the daemon from exiting. Now they hold no thread, a scrape still answers
    past them, and SIGTERM stops the daemon at once."""
    threads = len(os.listdir(f"/proc/{daemon.proc.pid}/task"))
    scrapers = idle_connections(daemon.metrics_port, 700)
    try:
        import urllib.request

        assert b"kernel_service_hits_total" in urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5).read()
        grown = len(os.listdir(f"/proc/{daemon.proc.pid}/task")) - threads
        assert grown < 16, f"{grown} more threads in the daemon with 700 idle scrapers connected"
        started = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.proc.wait(20)
        assert time.monotonic() - started < 15
    finally:
        for s in scrapers:
            s.close()


# Sends sys.argv[2] GetKernels of one slow cold kernel at once, as a raw gRPC client (no retries)
# on the one connection a process's channels share, to the Unix socket sys.argv[1]; prints "sent",
# then after 10 s a JSON line: the status of each call that ended, how many still wait, and
# the slowest BUSY answer in seconds. Then it holds the waiting calls until killed.
WAITERS = r"""
import asyncio, json, sys, time
import grpc
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2 as pb

unix, n = sys.argv[1], int(sys.argv[2])

async def main():
    channel = grpc.aio.insecure_channel(unix)
    get = channel.unary_unary("/kernelservice.v1.KernelService/GetKernel", request_serializer=pb.GetKernelRequest.SerializeToString,
                              response_deserializer=pb.GetKernelResponse.FromString)
    spec = wire.spec_to_proto("slow_rmsnorm", {"M": None, "N": 64, "dtype": "float32"}, "c")
    busy = []

    async def call():
        start = time.monotonic()
        try:
            return await get(pb.GetKernelRequest(spec=spec), timeout=120)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                busy.append(time.monotonic() - start)
            raise

    tasks = [asyncio.ensure_future(call()) for _ in range(n)]
    print("sent", flush=True)
    await asyncio.wait(tasks, timeout=10)
    ended = [t.exception().code().name if isinstance(t.exception(), grpc.aio.AioRpcError) else repr(t.exception() or t.result()) for t in tasks if t.done()]
    print(json.dumps({"ended": ended, "waiting": sum(1 for t in tasks if not t.done()), "slowest_busy": max(busy, default=0)}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""
BUSY_AT_ONCE = 5.0  # seconds: a BUSY answer comes without waiting for the build (a minute here)
# gRPC's server core ends a few streams of such a burst CANCELLED about 0.1 s in, before the
# daemon's code sees them (0 to 4 of 1100 on one connection here; clients retry CANCELLED).
CORE_CANCELLED = 8


def test_waiting_calls_past_the_cap_are_refused_busy_and_hits_go_on(daemon):
    """Issue 32, finding 3, and issue 47, item 3: 1100 cold GetKernels of one slow kernel at once,
    from a raw client on one connection, past the 1024 calls that may wait at once
    (servicer.MAX_WAITING): none is refused UNAVAILABLE by a per-connection stream limit (813
    were), the 1024 wait (one compile for all), the rest are refused BUSY at once, and another
    client's hits and health checks answer meanwhile."""
    from compile_service.servicer import MAX_WAITING

    waiters = script(WAITERS, f"unix:{daemon.socket}", str(MAX_WAITING + 76), stdout=subprocess.PIPE)
    channel = grpc.insecure_channel(f"unix:{daemon.socket}", options=wire.channel_options())
    stub, health = pb_grpc.KernelServiceStub(channel), health_pb2_grpc.HealthStub(channel)
    try:
        assert waiters.stdout.readline().strip() == "sent"
        seconds = []
        for _ in range(20):  # during the burst
            seconds += hit_latencies(stub, 5)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
            time.sleep(0.1)
        result = json.loads(waiters.stdout.readline())
    finally:
        waiters.kill()
        waiters.wait()
        channel.close()
    codes = collections.Counter(result["ended"])
    print(f"{MAX_WAITING + 76} waiting calls on one connection: {result['waiting']} wait, ended {dict(codes)}, slowest BUSY {result['slowest_busy']:.2f} s")
    assert result["waiting"] == MAX_WAITING, result["waiting"]
    assert set(codes) <= {"RESOURCE_EXHAUSTED", "CANCELLED"}, codes
    assert codes["CANCELLED"] <= CORE_CANCELLED and codes["RESOURCE_EXHAUSTED"] + codes["CANCELLED"] == 76, codes
    assert result["slowest_busy"] < BUSY_AT_ONCE, f"a BUSY answer took {result['slowest_busy']:.1f} s"
    assert statistics.median(seconds) < HIT_P99, f"hit p50 {statistics.median(seconds) * 1000:.1f} ms"


# Opens sys.argv[2] channels to sys.argv[1] at once, as a raw gRPC client would (they share one
# new connection), and makes one hit on each; prints the status of each call.
CONNECTS = r"""
import asyncio, sys
import grpc
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2 as pb

target, n = sys.argv[1], int(sys.argv[2])
request = pb.GetKernelRequest(spec=wire.spec_to_proto("rmsnorm", {"M": None, "N": 128, "dtype": "float32"}, "c"))

async def one():
    async with grpc.aio.insecure_channel(target) as channel:
        get = channel.unary_unary("/kernelservice.v1.KernelService/GetKernel", request_serializer=pb.GetKernelRequest.SerializeToString,
                                  response_deserializer=pb.GetKernelResponse.FromString)
        try:
            await get(request, timeout=30)
            return "OK"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name

async def main():
    print(*await asyncio.gather(*(one() for _ in range(n))), flush=True)

asyncio.run(main())
"""


def test_a_burst_of_new_channels_is_served_without_retries(daemon):
    """Issue 47, item 7: 120 new raw channels at once, one hit each, with no retries (health
    probes and other languages' clients do not retry): all succeed. A per-connection limit of
    100 streams refused 19 to 27 of them UNAVAILABLE, since they share one connection."""
    connects = script(CONNECTS, f"unix:{daemon.socket}", "120", stdout=subprocess.PIPE)
    codes = collections.Counter(connects.communicate(timeout=60)[0].split())
    assert codes == {"OK": 120}, codes


FETCH_P99 = 0.100  # seconds: well under the hostile tier's --remote-timeout (2 s) the daemon once stalled for


def test_a_fleet_tier_that_never_answers_a_look_delays_no_hit_and_no_health_check(make_daemon, tmp_path):
    """A serve-only daemon whose fleet tier answers PING but never a look (a sick or hostile
    Redis on loopback, --remote-timeout 2 s): while a strict GetKernel of a missing kernel waits
    on that look, another client's hits and health checks answer at once (the fetch once ran on
    the event loop and stalled every call for its whole timeout); the strict call then ends
    KernelNotReady, its reason explained."""
    import client
    from compile_service.store import LocalStore
    from tests.plant import host_toolchain, plant, spec_of
    from tests.test_fleet import NVRTC_ID, HostileRedis, answers

    cache = tmp_path / "cache"
    planted = spec_of("rmsnorm", "c", **HIT)
    plant(LocalStore(cache), planted, host_toolchain(planted, NVRTC_ID))  # the hit: no compile, no TileLang
    looking, hung_up = threading.Event(), threading.Event()
    absent = answers(b"$-1\r\n")

    def hang():
        looking.set()
        hung_up.wait(30)  # never answered while the test runs
        yield b""

    redis = HostileRedis(lambda command: hang() if command[0] == b"GET" else absent(command))
    d = make_daemon(
        "--no-compile", "--cuda-compiler-id", NVRTC_ID, "--remote", redis.url, "--remote-read-only", "--remote-timeout", "2", cache_dir=cache
    )  # fmt: skip
    channel = grpc.insecure_channel(f"unix:{d.socket}", options=wire.channel_options())
    stub, health = pb_grpc.KernelServiceStub(channel), health_pb2_grpc.HealthStub(channel)
    strict: dict = {}

    def ask_strictly() -> None:
        try:
            d.client(strict=True).get_kernel("rmsnorm", target="c", M=None, N=256, dtype="float32")
        except Exception as exc:  # noqa: BLE001 - checked below
            strict["error"] = exc

    asking = threading.Thread(target=ask_strictly)
    try:
        hit_latencies(stub, 20)  # the channel connected, the daemon's memo warm
        asking.start()
        assert looking.wait(10), "the strict miss never asked the fleet tier"
        start = time.perf_counter()
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        checked = time.perf_counter() - start
        seconds = hit_latencies(stub, 100)
        fetching = asking.is_alive()
        print(f"while a fetch hangs: health {checked * 1000:.2f} ms, hits p50 {statistics.median(seconds) * 1000:.2f} ms, p99 {p99(seconds) * 1000:.2f} ms")
        assert checked < FETCH_P99, f"a health check took {checked * 1000:.0f} ms while a fetch from the fleet tier hung"
        assert p99(seconds) < FETCH_P99, f"hit p99 {p99(seconds) * 1000:.0f} ms while a fetch from the fleet tier hung"
        assert fetching, "the strict request was over before the hits were measured"
        asking.join(30)
        assert not asking.is_alive()
    finally:
        hung_up.set()
        redis.close()
        channel.close()
    error = strict.get("error")
    assert isinstance(error, client.KernelNotReady), repr(error)
    assert "this daemon compiles nothing (serve --no-compile)" in str(error) and "N=256 vs 128" in str(error), str(error)  # explained: the nearest entry
    s = d.client().stats()
    assert (s["not_ready"], s["hits"] - s["direct_hits"], s["remote_errors"]) == (1, 120, 1), s


CANCELLED_GETS = 60  # distinct cold GetKernels whose callers leave: at 3 s each, three minutes of compiles if kept
BUILD_DELAY = 3  # seconds each slow build sleeps


def slow_request(n: int) -> pb.GetKernelRequest:
    return pb.GetKernelRequest(spec=wire.spec_to_proto("slow_rmsnorm", {"M": None, "N": 64 * n, "dtype": "float32"}, "c"))


def test_cancelled_and_expired_gets_leave_the_compile_queue(make_daemon):
    """Issue 47, item 4: distinct cold GetKernels whose callers cancel them (half) or whose
    deadlines pass (half) give their queued compiles back: the queue drains to the one build
    running, and a fresh cold request is answered after that one build, not behind the
    abandoned ones (once 184 compiles stayed queued, and a later request timed out)."""
    d = make_daemon("--kernel-module", "tests.slow_kind", workers=1, env={"KS_TEST_BUILD_DELAY": str(BUILD_DELAY)})
    d.wait_workers_ready(120)  # TileLang imported: the calls below reach a daemon not busy starting
    channel = grpc.insecure_channel(f"unix:{d.socket}", options=wire.channel_options())
    stub = pb_grpc.KernelServiceStub(channel)
    try:
        # Half the callers cancel, half let a short deadline pass (whether or not their call has
        # reached the daemon by then: a loaded machine may be slower than the deadline).
        calls = [stub.GetKernel.future(slow_request(n), timeout=60 if n % 2 else 3) for n in range(1, CANCELLED_GETS + 1)]
        assert {call.exception(timeout=30).code() for call in calls[1::2]} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        for call in calls[::2]:
            call.cancel()
        deadline = time.monotonic() + 15
        while (stats := stub.GetStats(pb.GetStatsRequest(), timeout=10)).in_flight > 1 or stats.queued:
            assert time.monotonic() < deadline, f"{stats.queued} compiles still queued, {stats.in_flight} in flight, for callers who left"
            time.sleep(0.05)
        assert stats.misses >= CANCELLED_GETS // 2, f"only {stats.misses} of the abandoned calls reached the daemon"
        start = time.monotonic()
        reply = stub.GetKernel(slow_request(CANCELLED_GETS + 1), timeout=60)  # a legitimate cold request
        waited = time.monotonic() - start
        print(f"after {stats.misses} abandoned cold calls: {stats.in_flight} in flight; a fresh cold request answered in {waited:.1f} s")
        assert reply.outcome == Outcome.COMPILED.value
        # The build running and its own, slower on a loaded machine; behind the abandoned: 180 s.
        assert waited < 10 * BUILD_DELAY, f"a fresh cold request waited {waited:.1f} s behind abandoned compiles"
    finally:
        channel.close()
