"""Readiness for systemd's `Type=notify`: the sd_notify protocol, without libsystemd.

When systemd (or another supervisor) sets NOTIFY_SOCKET, the daemon sends `READY=1` once its
socket answers and `STOPPING=1` as it starts to drain: one datagram each to that Unix socket
(a path, or an abstract name written with a leading '@'). Without the variable nothing is sent.
A supervisor that cannot be told is logged, never fatal.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

ENV = "NOTIFY_SOCKET"


def notify(state: str, env=os.environ) -> None:
    """Sends `state` ("READY=1", "STOPPING=1") to $NOTIFY_SOCKET, if set."""
    where = env.get(ENV)
    if not where:
        return
    address = "\0" + where[1:] if where.startswith("@") else where  # '@': Linux's abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode(), address)
    except OSError as exc:
        log.warning("cannot tell the supervisor %s at $%s=%s: %s", state, ENV, where, exc.strerror or exc)
