"""Redis replies read within a bound: a server never makes the daemon buffer more than it expects.

redis-py reads whatever a server sends: a bulk reply that declares 10 GB is buffered
until 10 GB arrived, a line without its CRLF grows without end. It has no option to
bound a reply (hiredis' `maxbuf` only trims its buffer). So the tier's connections
read through BoundedParser (their `parser_class`), redis-py's own RESP2 parser on a
metered socket: every byte received counts against the budget of the call in
progress (`budget(n, seconds)`, per thread: a pooled connection serves one call at
a time), and a receive never asks for more than is left. Past it, ReplyTooLarge;
past the call's seconds (a server that drips its reply, each byte inside the
socket timeout), ReplyTooSlow. Either way the connection is closed with whatever
the server had still to send.
"""

from __future__ import annotations

import contextlib
import threading
import time

import redis
from redis._parsers import _RESP2Parser

_calls = threading.local()


class ReplyTooLarge(redis.RedisError):
    """A call's replies went past the bytes it allowed: the read stopped there."""


class ReplyTooSlow(redis.RedisError):
    """A call's replies took longer than it allowed: the read stopped there. Not a
    redis.TimeoutError: redis-py 8.2 re-raises those as a new "Timeout reading from <host>",
    and the tier should say which bound ended the call."""


@contextlib.contextmanager
def budget(limit: int, seconds: float):
    """The calls made inside, on this thread, may receive at most `limit` bytes in all, and
    receive nothing more `seconds` after they started (a receive blocks at most the socket's
    timeout beyond that)."""
    _calls.left, _calls.limit, _calls.seconds = limit, limit, seconds
    _calls.deadline = time.monotonic() + seconds
    try:
        yield
    finally:
        del _calls.left, _calls.limit, _calls.seconds, _calls.deadline


class _MeteredSocket:
    """What redis-py's SocketBuffer uses of a socket (recv, settimeout), counted against the budget."""

    def __init__(self, sock):
        self._sock = sock

    def recv(self, size: int) -> bytes:
        left = getattr(_calls, "left", None)
        if left is None:  # outside budget(): no bound (the tier makes every call inside one)
            return self._sock.recv(size)
        if left <= 0:
            raise ReplyTooLarge(f"the reply is larger than the {_calls.limit} bytes this call allows; the connection was closed")
        if time.monotonic() > _calls.deadline:
            raise ReplyTooSlow(f"the reply took longer than the {_calls.seconds:.1f}s this call allows; the connection was closed")
        data = self._sock.recv(min(size, left))
        _calls.left = left - len(data)
        return data

    def settimeout(self, timeout) -> None:
        self._sock.settimeout(timeout)


class BoundedParser(_RESP2Parser):
    """redis-py's RESP2 parser, reading from a metered socket."""

    def on_connect(self, connection):
        super().on_connect(connection)
        self._buffer._sock = _MeteredSocket(self._buffer._sock)
