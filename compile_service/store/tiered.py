"""The fleet tier: claims on builds shared by every host through one Redis (store.remote).

The local store stays the store: lookup, eviction, usage are its own, and a hit
never leaves the host. The tier is the fleet form of claims (FleetClaims, which
with_fleet_tier sets as the store's `claims`), and the store's publish hook:
- claim (after a local miss, before compiling; on a compile driver): one round
  trip to Redis. An entry there is read through: every blob checked against its
  digest, written to a staging directory and published by the local store's own
  put, with the checks of a local build; only then served. Otherwise this host
  takes the key's lease (SET NX PX, renewed while it builds) and builds; when
  another host holds it, the job waits (one watcher thread polls every waiting
  key in one round trip) until that host's entry or failure appears, or its
  lease expires: then this host takes over.
- fetch (a local miss on a host that may not build: serve --no-compile, a strict
  request): the same look and read-through, but never a lease and never a wait;
  what the tier lacks (or another host is building) is not ready.
- Blobs are read no further than the sizes their index declares (RedisTier.blobs):
  a blob of another size than declared is refused like a corrupt one.
- the publish hook: what the store publishes is written behind to Redis by a
  background thread, so an agent never waits for Redis; the lease is released
  after the upload, so hosts waiting on it find the entry, not a free lease.
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
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from proto.entry import RECORDS, Entry, EntryRefused, index_record, read_index
from proto.trust import read_owned

from .base import BUILD, Claim, Claims
from .local import LocalStore
from .remote import Lease, RedisTier, TierRefused, TierUnavailable, TooLarge

log = logging.getLogger(__name__)

POLL = 0.1  # seconds between looks at the keys other hosts are building
UPLOAD_BACKLOG = 4096  # entries waiting to be written behind; past that, dropped (and counted)
DRAIN = 5.0  # seconds close() gives the uploads still queued
MAX_ENTRY_BYTES = 256 << 20  # the most one entry read through may hold


def with_fleet_tier(local: LocalStore, tier: RedisTier, metrics) -> LocalStore:
    """`local`, its builds claimed through the fleet `tier` and what it publishes shared there."""
    fleet = FleetClaims(local, tier, metrics)
    local.claims = fleet
    local.on_publish.append(fleet.share)
    return local


class FleetClaims(Claims):
    """Claims on builds through the fleet tier (fleet-wide single flight, read-through, failures
    remembered by the fleet), and `share`, the local store's publish hook (write-behind)."""

    def __init__(self, local: LocalStore, tier: RedisTier, metrics):
        self.local = local
        self.tier = tier
        self.metrics = metrics
        self._lock = threading.Lock()  # guards the three below
        self._waiting: dict[str, Callable[[], None]] = {}  # key another host builds -> wake
        self._waited: set[str] = set()  # keys found leased by another host (taking them is a takeover)
        self._held: set[str] = set()  # keys whose lease is ours
        self._uploads: queue.Queue[str] = queue.Queue(UPLOAD_BACKLOG)
        self._closing = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch, name="tier-watch", daemon=True),
            threading.Thread(target=self._upload, name="tier-upload", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ----- the publish hook: write-behind
    def share(self, entry: Entry) -> None:
        """Queues `entry`, just published here, for upload (never a copy of a shared build:
        each host makes those from the build, itself shared, in a millisecond)."""
        if self.tier.read_only or "shared_build" in entry.meta:
            return
        try:
            self._uploads.put_nowait(entry.key)
        except queue.Full:
            self.metrics.add(remote_errors=1)
            log.warning("fleet tier upload backlog full (%d entries); %s stays local", UPLOAD_BACKLOG, entry.key[:16])
            self._release(entry.key)

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
            return _failed(failure, failure_left)
        if self.tier.read_only:
            lease = Lease.HELD if leased else Lease.FREE  # a reader takes no lease: it builds without one
        else:
            lease = self.tier.take_lease(key)
            if lease is Lease.SETTLED and tries > 1:  # the entry (or a failure) landed since our look
                return self._claim(key, spec, wake, tries - 1)
        self.metrics.add(remote_misses=1)
        took_over = False
        with self._lock:
            if lease is Lease.HELD:
                self._waiting[key] = wake
                self._waited.add(key)
            else:
                took_over = key in self._waited
                self._waited.discard(key)
                if lease is Lease.TAKEN:
                    self._held.add(key)
        if lease is Lease.HELD:
            self.metrics.add(remote_lease_waits=1)
            return Claim(waiting=True)
        if took_over:
            self.metrics.add(remote_takeovers=1)
            log.info("took over the build of %s: its holder's lease expired without an entry", key[:16])
        return BUILD

    # ----- a host that may not build: read through, never a lease, never a wait
    def fetch(self, key: str, spec: dict) -> Claim:
        try:
            index, failure, failure_left, leased = self.tier.look(key)
            if index is not None:
                entry = self._read_through(key, spec, index)
                if entry is not None:
                    self.metrics.add(remote_hits=1)
                    return Claim(entry=entry)
                return Claim()  # refused or evicted (counted): no builder has it
        except TierUnavailable as exc:  # down or refusing: nothing to serve, and the answer says why
            how = "refused the read" if isinstance(exc, TierRefused) else "is unreachable"
            return Claim(tier_error=f"the fleet tier {self.tier.url} {how} ({exc})")
        if failure is not None:
            return _failed(failure, failure_left)
        self.metrics.add(remote_misses=1)
        return Claim(waiting=leased)

    def _settled(self, key: str) -> None:
        with self._lock:
            self._waited.discard(key)

    def _read_through(self, key: str, spec: dict, raw: bytes) -> Entry | None:
        """The tier's entry for `key`, checked and published locally; None when it cannot be
        served (then counted, and removed from the tier so that it is built again)."""
        try:
            library, files, meta, host = read_index(raw, spec, MAX_ENTRY_BYTES)
        except EntryRefused as exc:
            return self._refuse(key, [], f"its index is unusable: {exc}")
        meta["fetched_from"] = {"host": host, "at": time.time()}
        sizes: dict[str, int] = {}
        for f in files.values():
            if sizes.setdefault(f["sha256"], f["size"]) != f["size"]:
                return self._refuse(key, [], "it declares two sizes for one blob")
        digests = sorted(sizes)
        try:  # read no more than the index declares (TooLarge: the read stopped there)
            found = dict(zip(digests, self.tier.blobs({d: sizes[d] for d in digests})))
        except TooLarge:
            return self._refuse(key, [], "its blobs hold more bytes than it declares")
        wrong = [d for d in digests if found[d] is not None and len(found[d]) != sizes[d]]
        if wrong:
            return self._refuse(key, [], f"{len(wrong)} blob(s) are not of the size it declares")
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
            # The checks of a local build; no fsync: a fetch is cheap to repeat (LocalStore.put);
            # no publish hook: what came from the tier is not sent back to it.
            return self.local.put(key, staging, library, meta, durable=False, hooks=False)
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
            try:
                self._send_while_up(key)
                self._release(key)
            finally:
                self._uploads.task_done()

    def _send_while_up(self, key: str) -> None:
        while True:
            try:
                self._send(key)
            except TierUnavailable:
                # Down: wait for the breaker and send again (this entry and the ones queued
                # behind it). Refused (NOPERM, OOM): it would be refused again; drop it.
                if self.tier.state == "up" or self._closing.wait(max(self.tier.retry_in(), POLL)):
                    return
                continue
            except OSError as exc:  # evicted or unreadable meanwhile: nothing to share
                log.info("not sharing %s: %s", key[:16], exc)
            return

    def flush(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for every upload queued so far to be over (sent, or
        given up on); whether they are."""
        deadline = time.monotonic() + timeout
        while self._uploads.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL / 2)
        return True

    def _send(self, key: str) -> None:
        entry = self.local.lookup(key)
        if entry is None:
            return
        files, blobs = {}, {}
        for item in sorted(entry.path.iterdir()):
            if item.name in RECORDS or not item.is_file():
                continue
            data = read_owned(item, self.local.owner, limit=MAX_ENTRY_BYTES)
            digest = hashlib.sha256(data).hexdigest()
            files[item.name] = {"sha256": digest, "size": len(data)}
            blobs[digest] = data
        self.tier.put_entry(key, index_record(entry.library, files, entry.meta, self.tier.host), blobs)

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


def _failed(failure: dict, seconds_left: float) -> Claim:
    """The claim of a key whose compile failed on another host: its message, saying where and when."""
    note = f"\n(this compile failed on {failure['host']} {time.time() - failure['at']:.0f}s ago; the fleet tries it again in {seconds_left:.0f}s)"
    return Claim(failure=failure["error"] + note, failure_ttl=seconds_left)
