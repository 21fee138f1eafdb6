"""The fleet tier's Redis side: its key layout, its few commands, and a circuit breaker.

Keys (all under `ks:`, so one ACL pattern covers them):

    ks:entry:<key>     the index: JSON {schema, host, library, files: {name: {sha256, size}},
                       meta (entry.json)} (proto.entry.index_record); written after every blob it names
    ks:blob:<sha256>   one file's bytes, stored once however many entries name them
    ks:lease:<key>     the host building <key> now (SET NX PX, renewed while it builds)
    ks:failed:<key>    JSON {host, error, at}: a compile that failed, for --failure-ttl

Entries and blobs expire `ttl` seconds after they were last written;
`maxmemory-policy allkeys-lru` on the server bounds the rest (README).

Redis is an optimisation, never a dependency: every call has a bounded timeout,
and the first connection error or timeout opens the breaker: for RETRY_AFTER
seconds every call fails at once with TierUnavailable, then one call tries
again (state "up" again when it works). A refused command (NOPERM from an ACL,
OOM) is counted and raised the same way, without opening the breaker.

Every call receives at most a bounded number of bytes (store.resp): a look at most
two indexes' worth, a read of blobs at most the sizes their index declares, the
rest SMALL_REPLIES; and a whole call may take CALL_TIMEOUTS timeouts (plus a
second per CALL_RATE bytes it may receive), however slowly a server drips its reply.
Past the bytes the read stops and the call raises TooLarge, counted, without
opening the breaker (the server answers; it answers too much); past the time it
is a timeout like any other.
Nothing here touches the local disk.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..config import without_password
from .resp import BoundedParser, ReplyTooLarge, ReplyTooSlow, budget

log = logging.getLogger(__name__)

PREFIX = "ks:"
RETRY_AFTER = 5.0  # seconds the breaker stays open after a connection error or timeout
MAX_INDEX = 1 << 20  # bytes of one index: far above any real one (a few KB)
SMALL_REPLIES = 1 << 20  # bytes a call that reads no index or blob may receive (statuses, integers)
CALL_TIMEOUTS = 5  # a whole call may take this many --remote-timeouts (each read is bounded by one) ...
CALL_RATE = 8 << 20  # ... plus a second per this many bytes it may receive
FRAMING = 64  # bytes of RESP framing allowed per bulk reply ($<length>\r\n ... \r\n)

UP, DOWN = "up", "down"


class Lease(enum.Enum):
    """What taking a key's lease found; the values are what the TAKE script answers."""

    HELD = 0  # another host holds it: wait for it
    TAKEN = 1  # the lease is ours: build, then release it
    SETTLED = 2  # the entry or a failure is already there: look again (a build that finished
    # between our look and our take is never repeated)
    FREE = -1  # no one holds it, and a read-only host takes none: build without it (never from Redis)


# Atomic lease steps, answering with Lease's values.
_TAKE = """
if redis.call('exists', KEYS[2]) == 1 or redis.call('exists', KEYS[3]) == 1 then return 2 end
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class TierUnavailable(Exception):
    """Redis is down, slow, or refused the command: the caller goes on locally."""


class TierRefused(TierUnavailable):
    """Redis answered, and refused the command (NOPERM, OOM)."""


class TooLarge(TierUnavailable):
    """A reply held more bytes than the call allows (a blob larger than its index declares, a
    server streaming without end): the read stopped there and the connection was closed."""


def entry_key(key: str) -> str:
    return f"{PREFIX}entry:{key}"


def blob_key(sha256: str) -> str:
    return f"{PREFIX}blob:{sha256}"


def lease_key(key: str) -> str:
    return f"{PREFIX}lease:{key}"


def failed_key(key: str) -> str:
    return f"{PREFIX}failed:{key}"


class RedisTier:
    def __init__(self, url: str, *, read_only: bool = False, lease_seconds: float = 30.0, timeout: float = 1.0, ttl: float = 7 * 86400, metrics=None):
        """`url`: redis://, rediss:// (TLS) or unix://, credentials and db included
        (redis-py's from_url). Connects lazily: a Redis that is down at start costs nothing."""
        self.url = without_password(url)
        self.read_only = read_only
        self.lease_ms = int(lease_seconds * 1000)
        self.ttl_ms = int(ttl * 1000)
        self.metrics = metrics
        self.timeout = timeout
        self.host = f"{socket.gethostname()}/{os.getpid()}/{os.urandom(3).hex()}"  # this daemon, as leases name it
        # One immediate retry on a connection error only (a pooled socket the server
        # closed on restart); a timeout is never retried: it already cost the caller.
        self.redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            parser_class=BoundedParser,
            protocol=2,  # what BoundedParser reads
        )
        if self.redis.connection_pool.connection_kwargs.get("protocol") != 2:  # the URL's ?protocol=3 wins over the argument
            self.redis.connection_pool.connection_kwargs.update(protocol=2, maint_notifications_config=None)
        self._lock = threading.Lock()
        self.state = UP
        self._retry_at = 0.0
        self._refusals: set[str] = set()

    # ----- the breaker
    def _call(self, fn, limit: int = SMALL_REPLIES):
        """fn(redis client), receiving at most `limit` bytes, through the breaker."""
        with self._lock:
            if self.state == DOWN:
                now = time.monotonic()
                if now < self._retry_at:
                    raise TierUnavailable(f"down since a call failed; the next try in {self._retry_at - now:.1f}s")
                self._retry_at = now + RETRY_AFTER  # this call is the one probe; the others go on locally
        try:
            with budget(limit, CALL_TIMEOUTS * self.timeout + limit / CALL_RATE):
                result = fn(self.redis)
        except ReplyTooLarge as exc:  # the server is up, and sent more than asked: read no further
            self._count(remote_errors=1)
            log.warning("fleet tier %s: %s", self.url, exc)
            raise TooLarge(str(exc)) from exc
        except (redis.ConnectionError, redis.TimeoutError, ReplyTooSlow) as exc:  # a server this slow is a hung one
            self._count(remote_errors=1)
            with self._lock:
                if self.state == UP:
                    log.warning("fleet tier %s unreachable (%s); serving from the local cache, retrying every %.0fs", self.url, exc, RETRY_AFTER)
                self.state, self._retry_at = DOWN, time.monotonic() + RETRY_AFTER
            raise TierUnavailable(str(exc)) from exc
        except redis.RedisError as exc:  # refused (NOPERM, OOM): the tier is up, this command is not allowed
            self._count(remote_errors=1)
            with self._lock:
                first = str(exc) not in self._refusals
                self._refusals.add(str(exc))
            if first:  # once per distinct refusal: a reader's every upload would say the same
                log.warning("fleet tier %s refused a command: %s (read-only credentials? then pass --remote-read-only)", self.url, exc)
            raise TierRefused(str(exc)) from exc
        with self._lock:
            if self.state == DOWN:
                log.info("fleet tier %s is reachable again", self.url)
            self.state = UP
        return result

    def retry_in(self) -> float:
        """Seconds until a call may reach Redis again (0 when the breaker is closed)."""
        with self._lock:
            return max(0.0, self._retry_at - time.monotonic()) if self.state == DOWN else 0.0

    def _count(self, **deltas) -> None:
        if self.metrics is not None:
            self.metrics.add(**deltas)

    def ping(self) -> None:
        self._call(lambda r: r.ping())

    # ----- reading
    def look(self, key: str) -> tuple[bytes | None, dict | None, float, bool]:
        """One round trip: (the index as stored, the failure record, its seconds left, whether
        a lease is held). The index is checked by the caller, with the entry it describes."""

        def run(r):
            p = r.pipeline(transaction=False)
            p.get(entry_key(key)).get(failed_key(key)).pttl(failed_key(key)).exists(lease_key(key))
            return p.execute()

        raw_index, raw_failure, failure_ms, leased = self._call(run, limit=2 * MAX_INDEX + SMALL_REPLIES)
        self._count(remote_bytes_in=len(raw_index or b"") + len(raw_failure or b""))
        return raw_index, _failure(raw_failure), max(0, failure_ms) / 1000, bool(leased)

    def blobs(self, sizes: dict[str, int]) -> list[bytes | None]:
        """The blobs of these digests, in order (None: not there), receiving no more bytes than
        the sizes given (an index's, checked against its limit): TooLarge past them."""
        limit = sum(sizes.values()) + FRAMING * (len(sizes) + 1)
        found = self._call(lambda r: r.mget([blob_key(d) for d in sizes]), limit=limit)
        self._count(remote_bytes_in=sum(len(b) for b in found if b))
        return found

    def present(self, keys: list[str]) -> list[bool]:
        """For each key: is its index in the tier? One round trip for all of them."""

        def run(r):
            p = r.pipeline(transaction=False)
            for key in keys:
                p.exists(entry_key(key))
            return p.execute()

        return [bool(n) for n in self._call(run, limit=SMALL_REPLIES + 16 * len(keys))]

    def settled(self, keys: list[str]) -> list[bool]:
        """For each key another host was building: is it over (entry or failure there, or the
        lease gone)? One round trip for all of them."""

        def run(r):
            p = r.pipeline(transaction=False)
            for key in keys:
                p.exists(entry_key(key), failed_key(key)).exists(lease_key(key))
            return p.execute()

        flags = self._call(run)
        return [done > 0 or not leased for done, leased in zip(flags[::2], flags[1::2])]

    # ----- writing (never on a read-only tier: the caller checks, the ACL enforces)
    def take_lease(self, key: str) -> Lease:
        """Takes `key`'s lease unless another host holds it or its entry or failure is there."""
        return Lease(int(self._call(lambda r: r.eval(_TAKE, 3, lease_key(key), entry_key(key), failed_key(key), self.host, self.lease_ms))))

    def renew(self, keys: list[str]) -> list[str]:
        """Extends our leases on `keys`; returns those no longer ours (expired, or the server lost them)."""

        def run(r):
            p = r.pipeline(transaction=False)
            for key in keys:
                p.eval(_RENEW, 1, lease_key(key), self.host, self.lease_ms)
            return p.execute()

        return [key for key, kept in zip(keys, self._call(run)) if not kept]

    def release(self, key: str) -> None:
        self._call(lambda r: r.eval(_RELEASE, 1, lease_key(key), self.host))

    def put_entry(self, key: str, index: dict, files: dict[str, bytes]) -> None:
        """Stores `index` (proto.entry.index_record) and the blobs it names by sha256: blobs
        first, so a reader never finds an index whose blobs were not written (though LRU may
        evict one later: a reader's miss)."""
        body = json.dumps(index, sort_keys=True).encode()

        def run(r):
            p = r.pipeline(transaction=False)
            for digest, data in files.items():
                p.set(blob_key(digest), data, px=self.ttl_ms)
            p.set(entry_key(key), body, px=self.ttl_ms).delete(failed_key(key))
            return p.execute()

        self._call(run)
        self._count(remote_bytes_out=len(body) + sum(len(d) for d in files.values()))

    def put_failure(self, key: str, error: str, ttl: float) -> None:
        body = json.dumps({"host": self.host, "error": error, "at": time.time()}).encode()
        self._call(lambda r: r.set(failed_key(key), body, px=max(1, int(ttl * 1000))))
        self._count(remote_bytes_out=len(body))

    def drop(self, key: str, digests: list[str]) -> None:
        """Removes an index that cannot be served (a blob gone or corrupt) and those blobs, so
        the key can be leased and built again, and its bytes stored whole."""
        self._call(lambda r: r.delete(entry_key(key), *(blob_key(d) for d in digests)))

    def close(self) -> None:
        self.redis.close()


def _failure(raw: bytes | None) -> dict | None:
    """A failure record, or None when absent or unreadable (a failure is advice, never trusted further)."""
    try:
        record = json.loads(raw) if raw is not None and len(raw) <= MAX_INDEX else None
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("error"), str) or not isinstance(record.get("host"), str):
        return None
    return record if isinstance(record.get("at"), (int, float)) else None
