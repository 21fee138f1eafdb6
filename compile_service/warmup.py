"""The workers' warm-up, in the background, in the gaps between builds.

Every worker starts at once (TileLang is imported in the zygote, not in the daemon), and with
NVRTC each builds its precompiled headers one prelude per step (compiler.warm_step). A step is a
job of the scheduler's queue, below every request; it runs only when no build has run for
WARM_AFTER_IDLE seconds, on whichever worker is idle, and goes round again until every worker
is warm (a step that lands on a warm worker returns at once). One worker is always left free
for a request while others warm. Steps are admitted within the memory limit as builds are.

The warm-up starts with the workers on a cache that holds no kernel (a cold start's first burst
then finds its headers parsed), and otherwise at the first build: a daemon whose cache already
holds what its agents ask for parses no header at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from . import memory as memory_
from .build import compiler
from .workers import BrokenProcessPool, Workers

log = logging.getLogger(__name__)

WARM_UP = "(warm-up)"  # what a warm-up step is admitted and measured as (compile_service.memory)
# A warm-up step (a PCH build: seconds) starts only after this long with no build running: an
# agent asking for kernels one by one sends its next request sooner, and a step started in that
# gap would hold a worker the next request's builds (a router's ranges, side by side) need.
WARM_AFTER_IDLE = 0.5


class WarmUp:
    """The warm-up steps going round the queue, and which workers are warm."""

    def __init__(self, pool: Workers | None, workers: int, memory: memory_.BuildMemory, queue_step: Callable[[], None], last_build: Callable[[], float | None]):
        """`pool`: the workers (None: serving only, nothing warms up); `queue_step()` puts a
        step in the scheduler's queue; `last_build()`: when the last build ended
        (time.monotonic), None while one runs."""
        self._pool = pool
        self.workers = workers
        self.memory = memory
        self._queue_step = queue_step
        self._last_build = last_build
        self._lock = threading.Lock()  # guards the three below
        self._warm: set[int] = set()  # pids of workers done warming up
        self._steps = 0  # steps going round the queue (or held back: _hold)
        self._begun = False  # start() has run: until then no worker warms, and a started one counts as ready
        self._closing = False

    @property
    def ready(self) -> int:
        """Workers that finished their warm-up; before it starts, workers that have started."""
        with self._lock:
            if not self._begun and self._pool is not None:
                return self._pool.started()
            return len(self._warm)

    def start(self) -> None:
        """Puts the first steps in the queue, leaving one worker free for a request; once."""
        with self._lock:
            if self._begun or self._pool is None:
                return
            self._begun = True
            for _ in range(max(1, self.workers - 1)):
                self._put()

    def stop(self) -> None:
        """No step runs or goes round again from now on."""
        with self._lock:
            self._closing = True

    def take(self) -> None:
        """A driver took a step from the queue: runs it now, or holds it while builds run."""
        if not self._closing and not self._hold():
            self._step()

    def worker_replaced(self) -> None:
        """A worker was killed or died, and a fresh one started: it warms up as the first ones did."""
        with self._lock:
            self._warm &= self._pool.pids()
            if self._begun and not self._steps and not self._closing:
                self._put()

    def _put(self) -> None:
        """Under self._lock."""
        self._steps += 1
        self._queue_step()

    def _hold(self) -> bool:
        """While builds run or have just run (WARM_AFTER_IDLE), puts the step back in the queue
        later, where it is asked again; returns whether it did."""
        ended = self._last_build()
        wait = WARM_AFTER_IDLE if ended is None else ended + WARM_AFTER_IDLE - time.monotonic()
        if wait <= 0:
            return False
        timer = threading.Timer(wait, self._queue_step)
        timer.daemon = True
        timer.start()
        return True

    def _step(self) -> None:
        """One step on whichever worker is idle; it goes round again until every worker is warm."""
        pid = warm = None
        try:
            with self.memory.admit(WARM_UP):
                (pid, warm), peak = self._pool.run(memory_.measured, compiler.warm_step)
            self.memory.record(WARM_UP, peak)
        except BrokenProcessPool:
            self.worker_replaced()  # this step goes round again, for the fresh worker
        except Exception as exc:  # noqa: BLE001 - a failed warm-up costs only speed
            if not self._closing:
                log.warning("worker warm-up step failed: %s: %s", type(exc).__name__, exc)
            with self._lock:
                self._steps -= 1  # this step ends here
            return
        with self._lock:
            if warm:
                self._warm.add(pid)
            self._steps -= 1
            if len(self._warm) < self.workers and not self._closing:
                self._put()
