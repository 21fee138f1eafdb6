"""The fleet tier: the local store (L1) over a Redis every host shares (L2, store.remote).

- lookup, eviction, usage: the local store's. A hit never leaves the host.
- claim (after a local miss, before compiling; on a compile driver): one round
  trip to Redis. An entry there is read through: every blob checked against its
  digest, written to a staging directory and published by the local store's own
  put, with the checks of a local build; only then served. Otherwise this host
  takes the key's lease (SET NX PX, renewed while it builds) and builds; when
  another host holds it, the job waits (one watcher thread polls every waiting
  key in one round trip) until that host's entry or failure appears, or its
  lease expires: then this host takes over.
- put: published locally, then written behind to Redis by a background thread,
  so an agent never waits for Redis; the lease is released after the upload, so
  hosts waiting on it find the entry, not a free lease.
- A failed compile's message goes to Redis for --failure-ttl seconds: the whole
  fleet answers with it instead of compiling again.
- Redis down, slow, flushed or refusing: every step falls back to the local
  path (store.remote's breaker bounds the cost), uploads wait for it to return.
- Copies of shared builds stay local: each host makes them from the build, which
  itself comes through the tier, in a millisecond.
- A read-only tier (--remote-read-only) reads and waits on leases, never writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

from proto.abi import ENTRY_META, MANIFEST, check_entry_meta

from .base import BUILD, Budget, Claim, Entry, Storage, StoreError
from .local import LocalStore
from .remote import INDEX_SCHEMA, TierUnavailable, RedisTier

log = logging.getLogger(__name__)

POLL = 0.1  # seconds between looks at the keys other hosts are building
UPLOAD_BACKLOG = 4096  # entries waiting to be written behind; past that, dropped (and counted)
DRAIN = 5.0  # seconds close() gives the uploads still queued
MAX_ENTRY_BYTES = 256 << 20  # the most one entry read through may hold
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


class TieredStore(Storage):
    def __init__(self, local: LocalStore, tier: RedisTier, metrics):
        self.local = local
        self.tier = tier
        self.metrics = metrics
        self.root = local.root
        self._lock = threading.Lock()  # guards the three below
        self._waiting: dict[str, Callable[[], None]] = {}  # key another host builds -> wake
        self._waited: set[str] = set()  # keys found leased by another host (taking them is a takeover)
        self._held: set[str] = set()  # keys whose lease is ours
        self._uploads: queue.Queue[str] = queue.Queue(UPLOAD_BACKLOG)
        self._closing = threading.Event()
        self._threads = [threading.Thread(target=self._watch, name="tier-watch", daemon=True), threading.Thread(target=self._upload, name="tier-upload", daemon=True)]
        for t in self._threads:
            t.start()

    # ----- the local store's jobs
    def lookup(self, key: str, spec: dict | None = None) -> Entry | None:
        return self.local.lookup(key, spec)

    def new_staging(self, key: str) -> Path:
        return self.local.new_staging(key)

    def discard_staging(self, staging: Path) -> None:
        self.local.discard_staging(staging)

    def remove(self, key: str) -> None:
        self.local.remove(key)

    def recheck(self, key: str) -> str | None:
        return self.local.recheck(key)

    def keys(self) -> list[str]:
        return self.local.keys()

    def records(self):
        return self.local.records()

    def usage(self) -> tuple[int, int]:
        return self.local.usage()

    def evict(self, budget: Budget, protect: str | None = None) -> int:
        return self.local.evict(budget, protect)

    def put(self, key: str, staging: Path, library: str, meta: dict) -> Entry:
        entry = self.local.put(key, staging, library, meta)
        if not self.tier.read_only and "shared_build" not in meta:
            try:
                self._uploads.put_nowait(key)
            except queue.Full:
                self.metrics.add(remote_errors=1)
                log.warning("fleet tier upload backlog full (%d entries); %s stays local", UPLOAD_BACKLOG, key[:16])
                self._release(key)
        return entry

    # ----- the claim
    def claim(self, key: str, spec: dict, wake: Callable[[], None]) -> Claim:
        try:
            return self._claim(key, spec, wake, tries=2)
        except TierUnavailable:  # down or refusing: build here, as a host without a tier would
            with self._lock:
                self._waited.discard(key)
            return BUILD

    def _claim(self, key: str, spec: dict, wake: Callable[[], None], tries: int) -> Claim:
        index, failure, failure_left, leased = self.tier.look(key)
        if index is not None:
            entry = self._read_through(key, spec, index)
            if entry is not None:
                self._settled(key)
                self.metrics.add(remote_hits=1)
                return Claim(entry=entry)
        elif failure is not None:
            self._settled(key)
            note = f"\n(this compile failed on {failure['host']} {time.time() - failure['at']:.0f}s ago; the fleet tries it again in {failure_left:.0f}s)"
            return Claim(failure=failure["error"] + note, failure_ttl=failure_left)
        if self.tier.read_only:
            taken = 0 if leased else 1  # a reader builds without a lease: it can take none
        else:
            taken = self.tier.take_lease(key)
            if taken == 2 and tries > 1:  # the entry (or a failure) landed since our look
                return self._claim(key, spec, wake, tries - 1)
        self.metrics.add(remote_misses=1)
        took_over = False
        with self._lock:
            if taken == 0:
                self._waiting[key] = wake
                self._waited.add(key)
            else:
                took_over = key in self._waited
                self._waited.discard(key)
                if taken == 1 and not self.tier.read_only:
                    self._held.add(key)
        if taken == 0:
            self.metrics.add(remote_lease_waits=1)
            return Claim(waiting=True)
        if took_over:
            self.metrics.add(remote_takeovers=1)
            log.info("took over the build of %s: its holder's lease expired without an entry", key[:16])
        return BUILD

    def _settled(self, key: str) -> None:
        with self._lock:
            self._waited.discard(key)

    def _read_through(self, key: str, spec: dict, raw: bytes) -> Entry | None:
        """The tier's entry for `key`, checked and published locally; None when it cannot be
        served (then counted, and removed from the tier so that it is built again)."""
        try:
            library, files, meta = _check_index(raw, spec)
        except (ValueError, KeyError, TypeError) as exc:
            return self._refuse(key, [], f"its index is unusable: {exc}")
        digests = sorted({f["sha256"] for f in files.values()})
        found = dict(zip(digests, self.tier.blobs(digests)))
        bad = [d for d in digests if found[d] is not None and hashlib.sha256(found[d]).hexdigest() != d]
        if bad:
            return self._refuse(key, bad, f"{len(bad)} blob(s) do not match their sha256")
        if any(found[d] is None for d in digests):  # evicted (LRU) or flushed: a miss, not damage
            self._drop(key, [])
            return None
        staging = None
        try:
            staging = self.local.new_staging(key)
            for name, f in files.items():
                fd = os.open(staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as out:
                    out.write(found[f["sha256"]])
            # The checks of a local build; no fsync: a fetch is cheap to repeat (LocalStore.put).
            return self.local.put(key, staging, library, meta, durable=False)
        except OSError as exc:
            log.warning("cannot publish %s read from the fleet tier: %s", key[:16], exc)
            return None
        finally:
            if staging is not None:
                self.local.discard_staging(staging)

    def _refuse(self, key: str, digests: list[str], why: str) -> None:
        self.metrics.add(remote_corrupt=1)
        log.warning("fleet tier entry %s refused: %s; building it here", key[:16], why)
        self._drop(key, digests)
        return None

    def _drop(self, key: str, digests: list[str]) -> None:
        if not self.tier.read_only:
            try:
                self.tier.drop(key, digests)
            except TierUnavailable:
                pass

    # ----- the end of a build this host claimed
    def abandon(self, key: str, failure: str | None = None, failure_ttl: float = 0.0) -> None:
        with self._lock:
            held = key in self._held
        if held and failure is not None and failure_ttl > 0:
            try:
                self.tier.put_failure(key, failure, failure_ttl)
            except TierUnavailable:
                pass
        self._release(key)

    def _release(self, key: str) -> None:
        with self._lock:
            if key not in self._held:
                return
            self._held.discard(key)
        try:
            self.tier.release(key)
        except TierUnavailable:
            pass  # it expires by itself

    # ----- background: waiting keys, lease renewal, the tier's recovery
    def _watch(self) -> None:
        renew_every = self.tier.lease_ms / 3000
        renewed = time.monotonic()
        try:
            self.tier.ping()  # at start: stats say "down" from the first second, not the first miss
        except TierUnavailable:
            pass
        while not self._closing.wait(POLL):
            if time.monotonic() - renewed >= renew_every:
                renewed = time.monotonic()
                self._renew()
            with self._lock:
                keys = list(self._waiting)
            if keys:
                try:
                    over = self.tier.settled(keys)
                except TierUnavailable:
                    over = [True] * len(keys)  # no tier to wait on: build here
                self._wake([k for k, done in zip(keys, over) if done])
            elif self.tier.state != "up" and self.tier.retry_in() == 0:
                try:
                    self.tier.ping()  # the tier comes back by itself, with or without traffic
                except TierUnavailable:
                    pass

    def _renew(self) -> None:
        with self._lock:
            held = list(self._held)
        if not held:
            return
        try:
            lost = self.tier.renew(held)
        except TierUnavailable:
            return
        if lost:
            log.warning("lost the lease on %d kernel(s) being built here (expired, or Redis restarted): another host may build them too", len(lost))
            with self._lock:
                self._held.difference_update(lost)

    def _wake(self, keys: list[str]) -> None:
        with self._lock:
            wakes = [self._waiting.pop(k) for k in keys if k in self._waiting]
        for wake in wakes:
            try:
                wake()
            except Exception:  # noqa: BLE001 - one waiter's trouble must not stop the watcher
                log.exception("waking a job that waited on the fleet failed")

    # ----- background: write-behind
    def _upload(self) -> None:
        while not (self._closing.is_set() and self._uploads.empty()):
            try:
                key = self._uploads.get(timeout=0.2)
            except queue.Empty:
                continue
            while True:
                try:
                    self._send(key)
                except TierUnavailable:
                    # Down: wait for the breaker and send again (this entry and the ones queued
                    # behind it). Refused (NOPERM, OOM): it would be refused again; drop it.
                    if self.tier.state == "up" or self._closing.wait(max(self.tier.retry_in(), POLL)):
                        break
                    continue
                except OSError as exc:  # evicted or unreadable meanwhile: nothing to share
                    log.info("not sharing %s: %s", key[:16], exc)
                break
            self._release(key)

    def _send(self, key: str) -> None:
        entry = self.local.lookup(key)
        if entry is None:
            return
        files, blobs = {}, {}
        for item in sorted(entry.path.iterdir()):
            if item.name in (ENTRY_META, MANIFEST) or not item.is_file():
                continue
            data = item.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            files[item.name] = {"sha256": digest, "size": len(data)}
            blobs[digest] = data
        self.tier.put_entry(key, {"library": entry.library, "files": files, "meta": entry.meta}, blobs)

    def close(self) -> None:
        """Wakes every waiting job, gives queued uploads up to DRAIN seconds, releases our leases."""
        self._closing.set()
        with self._lock:
            waiting = list(self._waiting)
        self._wake(waiting)
        deadline = time.monotonic() + DRAIN
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            held = list(self._held)
        for key in held:
            self._release(key)
        self.tier.close()


def _check_index(raw: bytes, spec: dict) -> tuple[str, dict, dict]:
    """(library, files, meta) of an index, after every check a local entry must pass that
    can be made before its bytes are read; raises ValueError/KeyError/TypeError."""
    index = json.loads(raw)
    if not isinstance(index, dict) or index.get("schema") != INDEX_SCHEMA:
        raise ValueError("not an index of this schema")
    library, files, meta = index["library"], index["files"], dict(index["meta"])
    if not isinstance(files, dict) or library not in files:
        raise ValueError("its files do not include the library")
    total = 0
    for name, f in files.items():
        if not _FILE_NAME.fullmatch(name) or name in (ENTRY_META, MANIFEST):
            raise ValueError(f"it names a file {name!r} an entry cannot hold")
        if not isinstance(f["size"], int) or not isinstance(f["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", f["sha256"]):
            raise ValueError(f"{name}'s size or sha256 is malformed")
        total += f["size"]
    if total > MAX_ENTRY_BYTES:
        raise ValueError(f"it holds {total} bytes, over the {MAX_ENTRY_BYTES}-byte limit")
    check_entry_meta(meta)
    if meta["spec"] != spec:
        raise ValueError(f"it records spec {meta['spec']!r}, not the one its key was computed from")
    meta["fetched_from"] = {"host": index.get("host"), "at": time.time()}
    return library, files, meta
