"""Misses that may not compile: served from where other builders publish, never built here.

A request that may not compile (a strict client), or any request to a scheduler that compiles
nothing (`serve --no-compile`), is answered from the cache, else from where other builders
publish (Claims.fetch: the fleet tier, read through and published here, once per key however
many ask), else its future raises NotReady. It never compiles, takes no lease and waits for no
build. The fetch runs on a publisher thread, never on the caller's: a slow or hung tier delays
only the requests waiting on it (the daemon's event loop goes on serving hits).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable

from kernels import label
from kernels.spec import CanonicalSpec
from proto.wire import Outcome, not_ready_details

from . import metrics as metrics_
from .build import compiler
from .futures import chain, settle, when_all_done
from .store import Claim, Claims, Entry

log = logging.getLogger(__name__)


class NotReady(Exception):
    """Not in the cache, and nothing may compile it."""

    def __init__(self, spec: CanonicalSpec, key: str, why: str):
        super().__init__(not_ready_details(label(spec), key, why))
        self.spec, self.key, self.why = spec, key, why


class ServeOnly:
    """The fetches of misses that may not compile, one per key however many ask at once."""

    def __init__(self, claims: Claims, publish: Callable, compiles: bool):
        """`publish(fn, *args)` runs `fn` on a publisher thread; `compiles`: whether the
        scheduler compiles anything (else every miss comes here)."""
        self.claims = claims
        self._publish = publish
        self._why = "the request asked for no compile (a strict client)" if compiles else "this daemon compiles nothing (serve --no-compile)"
        self._lock = threading.Lock()  # guards _fetching
        self._fetching: dict[str, cf.Future] = {}  # key -> the fetch from other builders under way

    def fetch(self, spec: CanonicalSpec, key: str, expect: dict, tally) -> tuple[cf.Future, Outcome]:
        """A miss looked up where other builders publish (the fleet tier), and published here.
        Returns at once: the future raises NotReady when no builder has it, CompileFailed when
        it failed on a builder."""
        with self._lock:
            fetching = self._fetching.get(key)
            if fetching is None:
                self._fetching[key] = future = cf.Future()
        if fetching is not None:
            tally(misses=1, joined=1)
            return fetching, Outcome.JOINED
        self._publish(self._fetch_now, spec, key, expect, tally, future)
        return future, Outcome.COMPILED

    def fetch_builds(self, spec: CanonicalSpec, key: str, missing: list[tuple[CanonicalSpec, str, dict]], tally, make: Callable[[], cf.Future]) -> cf.Future:
        """A copy of builds (a copy compiles nothing) whose `missing` builds (spec, key, expected
        spec) are not here: each fetched, then the copy made by `make()`. The future raises
        NotReady, naming `spec`, when one is nowhere; CompileFailed when one failed on a builder."""
        fetches = [self.fetch(build, k, e, metrics_.ignore)[0] for build, k, e in missing]
        future = cf.Future()

        def all_fetched():
            failed = next((f.exception() for f in fetches if f.exception() is not None), None)
            if isinstance(failed, NotReady):
                tally(not_ready=1)
                future.set_exception(NotReady(spec, key, f"{failed.why} (the build it is a copy of, {failed.key[:16]})"))
            elif failed is not None:
                tally(misses=1, failures_cached=1)
                future.set_exception(failed)
            else:
                try:
                    made = make()
                except Exception as exc:  # noqa: BLE001 - refused (ShuttingDown, QueueFull): the caller learns why, never hangs
                    future.set_exception(exc)
                    return
                chain(made, future)

        when_all_done(fetches, all_fetched)
        return future

    def _fetch_now(self, spec: CanonicalSpec, key: str, expect: dict, tally, future: cf.Future) -> None:
        """The fetch itself (a publisher thread): settles `future`, counted, once it is out of `_fetching`."""
        try:
            found = self.claims.fetch(key, expect)
        except Exception:  # a store's trouble with other hosts never fails a request
            log.exception("fetching %s from other builders failed", key[:16])
            found = Claim()
        outcome: Entry | BaseException
        if found is not None and found.entry is not None:
            tally(misses=1)
            outcome = found.entry
        elif found is not None and found.failure is not None:
            tally(misses=1, failures_cached=1)
            outcome = compiler.CompileFailed(found.failure)
        else:
            tally(not_ready=1)
            outcome = NotReady(spec, key, self._not_ready_why(found))
        with self._lock:
            del self._fetching[key]
        settle(future, outcome)

    def _not_ready_why(self, found: Claim | None) -> str:
        if found is None:  # no other builders to ask
            return self._why
        if found.tier_error:
            return f"{self._why}, and {found.tier_error}"
        if found.waiting:
            return f"{self._why}, and a builder of the fleet is building it now: ask again once it is done"
        return f"{self._why}, and the fleet tier does not have it: a builder puts it there (a request or prefetch to a builder, or `kernel-service prewarm --remote`)"
