"""The compile workers: forked, warm, from one zygote that paid TileLang's import and NVRTC's
header parse once.

Workers are not forked from the daemon itself: it runs gRPC threads, which a fork does not
survive. The zygote is multiprocessing's forkserver, a fresh process started with the daemon's
scheduler (so its set-up overlaps the daemon's start) that imports `build.preload`: that runs
compiler.worker_init once with the daemon's worker settings, which the daemon leaves in
$KERNEL_SERVICE_WORKER_SETUP for it. Every worker forked from it starts with TileLang imported,
the plugins loaded, the device compiler installed and its PCHs built, in milliseconds: a pool
replaced after a crash starts as warm. Each worker only makes its own scratch directory
(compiler.worker_forked). Should the zygote's set-up fail, a worker runs worker_init itself, as
a spawned one would.

Lifetimes: the zygote dies with the daemon (die_with_parent, and multiprocessing's own pipe),
each worker with the zygote.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import os
import sys

from ..fsutil import die_with_parent
from . import compiler

ENV = "KERNEL_SERVICE_WORKER_SETUP"
PRELOAD = "compile_service.build.preload"
_context = multiprocessing.get_context("forkserver")


def start_zygote(initargs: tuple) -> None:
    """Starts the zygote now, set up with worker_init(*initargs), without waiting for it. Once
    per daemon: a running zygote is kept (its set-up is the daemon's, which does not change)."""
    from multiprocessing import forkserver

    os.environ[ENV] = json.dumps(initargs)  # the zygote's environment is the daemon's at this moment
    _context.set_forkserver_preload([PRELOAD])
    forkserver.ensure_running()


def pool(workers: int, initargs: tuple) -> cf.Executor:
    """The daemon's pool of `workers` processes forked from the zygote."""
    start_zygote(initargs)
    return cf.ProcessPoolExecutor(workers, mp_context=_context, initializer=_start_worker, initargs=initargs)


def _start_worker(*initargs) -> None:
    preload = sys.modules.get(PRELOAD)
    # Our parent is the zygote: a worker must never outlive it (nor, so, a killed daemon).
    die_with_parent(preload.PID if preload else os.getppid())
    if preload is not None and preload.ready:
        compiler.worker_forked()
    else:
        compiler.worker_init(*initargs)
