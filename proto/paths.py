"""Default locations of the daemon's socket and cache root, and where an entry lies under it.

Part of the contract: the daemon listens and keeps its cache where clients look.
"""

from __future__ import annotations

import os
from pathlib import Path

APP = "kernel-service"
# Under the cache root: the secret TCP clients present (`authorization: Bearer <token>`),
# written owner-only at every start of a daemon with --tcp.
TOKEN_FILE = "tcp-token"
# Under the cache root: the secret owner-only RPCs (ZeroStats) carry in the ADMIN_METADATA
# header, written owner-only (whatever --mode says) at every start of a daemon.
ADMIN_TOKEN_FILE = "admin-token"
ADMIN_METADATA = "kernel-service-admin"
SOCKET_ENV = "KERNEL_SERVICE_SOCKET"
CACHE_DIR_ENV = "KERNEL_SERVICE_CACHE_DIR"
TOKEN_FILE_ENV = "KERNEL_SERVICE_TOKEN_FILE"
INDUCTOR_DIRNAME = "torchinductor"  # under the cache root: the directory agents point torch.compile at


def _absolute_env(name: str, env) -> Path | None:
    value = env.get(name)
    return Path(value) if value and os.path.isabs(value) else None


def default_socket(env=os.environ, uid: int | None = None) -> Path:
    """$KERNEL_SERVICE_SOCKET, else $XDG_RUNTIME_DIR/kernel-service/kernel-service.sock,
    else /tmp/kernel-service-<uid>/kernel-service.sock (`uid`: ours unless given)."""
    if env.get(SOCKET_ENV):
        return Path(env[SOCKET_ENV])
    runtime = _absolute_env("XDG_RUNTIME_DIR", env)
    base = runtime / APP if runtime else Path("/tmp") / f"{APP}-{os.getuid() if uid is None else uid}"
    return base / f"{APP}.sock"


def xdg_cache_home(env=os.environ) -> Path:
    """$XDG_CACHE_HOME when set and absolute, else ~/.cache (the XDG rule)."""
    return _absolute_env("XDG_CACHE_HOME", env) or Path.home() / ".cache"


def default_cache_dir(env=os.environ) -> Path:
    """$KERNEL_SERVICE_CACHE_DIR, else $XDG_CACHE_HOME/kernel-service or ~/.cache/kernel-service."""
    if env.get(CACHE_DIR_ENV):
        return Path(env[CACHE_DIR_ENV])
    return xdg_cache_home(env) / APP


def inductor_dir(cache_root: Path | str) -> Path:
    """The persistent torch.compile (Inductor) directory kept under a cache root."""
    return Path(cache_root) / INDUCTOR_DIRNAME


def default_token_file(env=os.environ) -> Path:
    """$KERNEL_SERVICE_TOKEN_FILE, else the tcp-token file under the default cache root."""
    if env.get(TOKEN_FILE_ENV):
        return Path(env[TOKEN_FILE_ENV])
    return default_cache_dir(env) / TOKEN_FILE


def socket_address(path: Path | str) -> str:
    """A gRPC target for a Unix socket path, or a host:port passed through."""
    text = str(path)
    if text.startswith(("unix:", "dns:", "ipv4:", "ipv6:")) or (":" in text and "/" not in text):
        return text
    return f"unix:{os.path.abspath(text)}"


SERVICE_INFO = "service-info.json"  # the daemon's ServiceInfo, so that clients find hits while it is down


def service_info_file(cache_root: Path | str) -> Path:
    """Where a daemon leaves its ServiceInfo (as JSON, proto field names) under its cache root: a
    client that finds no daemon computes keys and finds entries from it."""
    return Path(cache_root) / SERVICE_INFO


def entry_dir(cache_root: Path | str, key: str) -> Path:
    """A published entry's directory: <cache root>/entries/<key[:2]>/<key>."""
    return Path(cache_root) / "entries" / key[:2] / key
