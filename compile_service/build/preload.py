"""Imported by the zygote alone (build.workers): sets up the compile workers' process once, from
the settings the daemon left in $KERNEL_SERVICE_WORKER_SETUP, before any worker forks from it.

A failure is logged, not raised (multiprocessing's forkserver would die on it): the workers then
set themselves up (build.workers._start_worker).
"""

from __future__ import annotations

import json
import logging
import os

from ..fsutil import die_with_parent
from . import compiler
from .workers import ENV

PID = os.getpid()
ready = False

die_with_parent(os.getppid())  # the daemon: its thread that started us lives as long as it does
try:
    compiler.worker_init(*json.loads(os.environ[ENV]))
    ready = True
except Exception as exc:  # noqa: BLE001 - the workers retry it and report what fails
    logging.getLogger(__name__).warning("the compile workers' zygote could not set up (%s: %s); each worker sets itself up", type(exc).__name__, exc)
