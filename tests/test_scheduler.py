"""The scheduler's bookkeeping, on a real store with workers not started: nothing compiles, so
what is in flight stays put while the test looks at it (single-flight, the queue's shares,
release() dropping what no one waits for, a shared build's copy releasing its build, shutdown
failing what is queued, serving only); and, with one in-process worker, the order builds run
in and when warm-up runs; with two, a LATER build waiting while a request's build runs."""

import concurrent.futures as cf
import os
import time

import pytest

import kernels
import tests.routed_kind  # noqa: F401 - registers routed_scale, a router over two builds
import tests.shared_kind  # noqa: F401 - registers row_double, a kind with shared builds
from compile_service.build import compiler
from compile_service.scheduler import BACKGROUND, URGENT, Cancelled, NotReady, QueueFull, Scheduler, ShuttingDown, in_process_pool
from compile_service.store.local import LocalStore
from compile_service.warmup import WARM_AFTER_IDLE
from compile_service.workers import Workers
from proto.wire import Outcome


def rmsnorm(n: int):
    return kernels.canonicalize("rmsnorm", {"M": None, "N": n, "dtype": "float32"}, "c")


def row_double(m):
    return kernels.canonicalize("row_double", {"M": m, "N": 4}, "c")


@pytest.fixture
def scheduler(tmp_path):
    made = []

    def make(workers=1, pool=in_process_pool, **options):
        store = LocalStore(tmp_path / "cache")
        s = Scheduler(store, store.claims, workers=workers, pool=pool, start=False, **options)
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown(0)


def test_single_flight_the_queue_shares_and_release(scheduler):
    s = scheduler(queue_limit=4)  # background work may hold 2
    first, outcome = s.request(rmsnorm(64), BACKGROUND)
    assert outcome == Outcome.COMPILED
    assert s.request(rmsnorm(64), BACKGROUND) == (first, Outcome.JOINED)
    s.request(rmsnorm(65), BACKGROUND)
    with pytest.raises(QueueFull, match=r"2 prefetched compiles are already queued \(prefetches may take half of the queue, 2\)"):
        s.request(rmsnorm(66), BACKGROUND)
    s.request(rmsnorm(66), URGENT)  # a blocked caller still finds room
    assert (s.in_flight, s.queued, s.running) == (3, 3, 0)
    counts = s.metrics.counters()
    assert (counts["misses"], counts["joined"]) == (4, 1)

    assert s.release([first]) == 0  # the joiner still waits on it
    assert not first.done()
    assert s.release([first]) == 1
    assert isinstance(first.exception(0), Cancelled) and s.in_flight == 2
    assert s.release([first]) == 0  # settled: nothing more to give back

    s.request(rmsnorm(67), BACKGROUND)  # the dropped one's share is back
    s.request(rmsnorm(68), URGENT)
    with pytest.raises(QueueFull, match=r"4 compiles are already queued \(limit 4\)"):
        s.request(rmsnorm(69), URGENT)


def test_a_copy_released_releases_the_build_it_waits_on(scheduler):
    s = scheduler()
    copy, outcome = s.request(row_double(8), BACKGROUND)
    assert outcome == Outcome.COMPILED and s.in_flight == 2  # the copy and the runtime-M build
    assert s.release([copy]) == 1  # the build: no one else waited on it
    assert isinstance(copy.exception(10), Cancelled)  # the copy learns why from its build
    assert s.in_flight == 0

    build, _ = s.request(row_double(None), URGENT)  # someone waits on the build itself
    copy, _ = s.request(row_double(8), BACKGROUND)
    assert s.release([copy]) == 0
    assert not build.done() and s.in_flight == 2


def test_shutdown_fails_queued_compiles(scheduler):
    s = scheduler()
    future, _ = s.request(rmsnorm(64))
    s.shutdown(10)
    assert isinstance(future.exception(10), ShuttingDown) and s.in_flight == 0
    with pytest.raises(ShuttingDown):
        s.request(rmsnorm(64))


def test_serving_only_refuses_a_miss_unless_it_is_a_copy_of_what_is_there(scheduler):
    s = scheduler(compiles=False)
    with pytest.raises(NotReady, match=r"this daemon compiles nothing \(serve --no-compile\)"):
        s.request(rmsnorm(64))[0].result(5)
    with pytest.raises(NotReady, match="the build it is a copy of"):  # its build is not in the cache either
        s.request(row_double(8))[0].result(5)
    assert s.metrics.counters()["not_ready"] == 2 and s.in_flight == 0


def test_warm_up_waits_until_no_build_has_run_for_a_while(scheduler, monkeypatch):
    """An agent asking for kernels one by one sends its next request within milliseconds of
    the last answer; a warm-up step (a PCH build: seconds) started in that gap would hold a
    worker the next builds need. So warm-up starts WARM_AFTER_IDLE after the last build, and
    then does start (a held step that is never put back would leave workers cold for good)."""
    steps = []
    monkeypatch.setattr(compiler, "warm_step", lambda: (steps.append(time.monotonic()), (os.getpid(), True))[1])
    s = scheduler()
    future, _ = s.request(rmsnorm(64))  # queued above the warm-up step start_workers puts behind it
    s.start_workers()
    future.result(120)
    built = time.monotonic()
    deadline = built + 10
    while not steps and time.monotonic() < deadline:
        time.sleep(0.01)
    assert steps, "the held warm-up step never ran"
    assert steps[0] - built >= WARM_AFTER_IDLE - 0.05, steps[0] - built
    while s.workers_ready < 1 and time.monotonic() < deadline:  # the step's answer is on its way back
        time.sleep(0.01)
    assert s.workers_ready == 1


def test_a_cache_that_holds_kernels_warms_up_only_once_a_build_runs(scheduler, monkeypatch):
    """A daemon restarted on a warm cache serves hits: its workers parse no header (a co-located
    agent starting meanwhile is not slowed) until a miss shows it will build. Until then a
    started worker counts as ready."""
    steps = []
    monkeypatch.setattr(compiler, "warm_step", lambda: (steps.append(time.monotonic()), (os.getpid(), True))[1])
    first = scheduler()
    first.start_workers()
    first.request(rmsnorm(64))[0].result(120)
    first.shutdown(0)
    steps.clear()

    s = scheduler()  # the same cache, now holding rmsnorm(64)
    s.start_workers()
    deadline = time.monotonic() + 10
    while s.workers_ready < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.workers_ready == 1  # started, nothing to warm for
    assert s.request(rmsnorm(64))[1] == Outcome.HIT
    time.sleep(WARM_AFTER_IDLE + 0.5)
    assert not steps, "warm-up ran on a cache holding what was asked for"

    s.request(rmsnorm(65))[0].result(120)  # a miss: this daemon builds, so its workers warm up
    deadline = time.monotonic() + 10
    while not steps and time.monotonic() < deadline:
        time.sleep(0.01)
    assert steps, "a build did not start the warm-up"


def routed(n: int, schedule: str = "auto"):
    return kernels.canonicalize("routed_scale", {"M": None, "N": n, "schedule": schedule}, "c")


def test_a_router_waits_for_one_build_its_others_come_last_and_a_joiner_moves_a_build_up(scheduler):
    """A router is a copy of its last range's build: that build alone is its base; its other
    ranges are built after every request (LATER), unless a request joins one and takes it up."""
    s = scheduler()
    a, _ = s.request(routed(8), BACKGROUND)
    b, _ = s.request(routed(16), BACKGROUND)
    assert s.in_flight == 6  # each router, its last range's build, and its other range's, not waited on
    small_b, outcome = s.request(routed(16, "small"), URGENT)  # a GetKernel for it: up to the top of the queue
    assert outcome == Outcome.JOINED
    order = []
    for name, future in (("large 8", a), ("large 16", b), ("small 16", small_b)):
        future.add_done_callback(lambda _, name=name: order.append(name))
    s.start_workers()
    for future in (a, b, small_b):
        future.result(120)
    assert order == ["small 16", "large 8", "large 16"]
    deadline = time.monotonic() + 120
    while s.in_flight and time.monotonic() < deadline:  # the small build of 8, with no waiter, still made
        time.sleep(0.05)
    assert s.in_flight == 0 and s.metrics.counters()["compiles"] == 4


def test_a_later_build_waits_while_a_request_s_build_runs(scheduler, tmp_path, monkeypatch):
    """On two workers, a router's other range (LATER) does not take the idle one while a
    request's build runs: it starts once that build is done, and is still made."""
    gate = tmp_path / "gate"
    monkeypatch.setenv("ROUTED_SMALL_GATE", str(gate))  # every small build waits for the gate

    def two_threads(workers, initargs):
        return Workers(workers, lambda: cf.ThreadPoolExecutor(1, initializer=compiler.worker_init, initargs=initargs), killable=False)

    s = scheduler(pool=two_threads, workers=2)
    held, _ = s.request(routed(16, "small"), URGENT)  # a request's build, held at the gate
    router, _ = s.request(routed(8), BACKGROUND)  # its large build on the other worker, then its small one LATER
    s.start_workers()
    router.result(120)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert s.running == 1 and not held.done()  # the small build of 8 has not taken the idle worker
        time.sleep(0.02)
    gate.touch()
    held.result(120)
    deadline = time.monotonic() + 120
    while s.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.in_flight == 0 and s.metrics.counters()["compiles"] == 3
