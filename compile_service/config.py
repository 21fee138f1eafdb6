"""The daemon's settings, resolved once from flags and environment; nothing reads them later."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from proto.paths import default_cache_dir, default_socket

from .build import devices
from .cpus import usable_cpus


@dataclass(frozen=True)
class ServiceConfig:
    socket: Path  # Unix socket path the daemon listens on
    cache_dir: Path  # root of the kernel cache
    workers: int  # size of the compile pool
    target: str = "auto"  # target for specs that name none
    grace: float = 30.0  # seconds SIGTERM waits for running compiles
    queue_limit: int = 4096  # compiles queued or running before RESOURCE_EXHAUSTED
    warm_up: bool = True  # start every compile worker at launch
    kernel_modules: tuple[str, ...] = ()  # extra modules (MODULE or MODULE:ATTR) that register kernel kinds
    entry_points: bool = True  # load installed kinds (entry-point group kernel_service.kinds)
    plugins: tuple[str, ...] | None = None  # only these installed kinds (None: all)
    failure_ttl: float = 60.0  # seconds a failed compile is answered from memory before a retry
    max_bytes: int | None = None  # cache budget in bytes (None: unbounded)
    max_entries: int | None = None  # cache budget in entries (None: unbounded)
    evict_min_age: float = 300.0  # never evict an entry handed out this many seconds ago or less
    mode: int = 0o700  # cache and socket directories: 0o700 owner only, 0o750 group may read
    tcp: str | None = None  # "host:port" to listen on besides the Unix socket (None: no TCP); token-authenticated
    cuda_compiler: str = devices.NVCC  # "nvrtc" or "nvcc": how CUDA device code is compiled (resolved from "auto")
    metrics_address: str | None = None  # "host:port" of the Prometheus endpoint (None: none)
    no_compile: bool = False  # serve only: a miss answers NOT_FOUND, no compile workers run
    cuda_compiler_id: str | None = None  # with no_compile: CUDA keys as if built by this compiler ("nvrtc-13.0")
    remote: str | None = None  # the fleet tier's Redis URL (None: this host alone)
    remote_read_only: bool = False  # read the tier, never write it
    remote_lease_seconds: float = 30.0  # a build lease lasts this long unless its holder renews it
    remote_timeout: float = 1.0  # seconds any one Redis call may take
    remote_ttl: float = 7 * 86400.0  # seconds an entry stays in the tier after it was last written
    sources: dict = field(default_factory=dict, compare=False)  # field -> where its value came from (describe)

    @property
    def plugin_args(self) -> dict:
        """What the daemon and each compile worker load beyond the zoo (kernels.plugins.load)."""
        return {"modules": self.kernel_modules, "entry_points": self.entry_points, "allow": self.plugins}

    @property
    def device(self) -> devices.DeviceCompiler:
        """The device compiler CUDA keys name: the named one on a serve-only host, else the one that runs."""
        return devices.named(self.cuda_compiler_id) if self.cuda_compiler_id else devices.get(self.cuda_compiler)

    def describe(self) -> dict:
        """Every setting with where it came from: {"name": {"value": ..., "source": ...}} (`kernel-service info`)."""
        out = {}
        for f in fields(self):
            if f.name == "sources":
                continue
            value = getattr(self, f.name)
            value = f"{value:04o}" if f.name == "mode" else str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
            if f.name == "remote" and value:
                value = without_password(value)
            out[f.name] = {"value": value, "source": self.sources.get(f.name, "default")}
        return out

    @classmethod
    def resolve(
        cls,
        socket: str | None = None,
        cache_dir: str | None = None,
        workers: int | None = None,
        env=os.environ,
        **rest,
    ) -> ServiceConfig:
        """Flags win, then KERNEL_SERVICE_* variables, then the XDG defaults. Raises ValueError
        naming the flag and what to give instead."""
        defaults = {f.name: f.default for f in fields(cls)}
        sources = {name: f"--{name.replace('_', '-')}" for name, value in rest.items() if value is not None and name in defaults and value != defaults[name]}
        if workers is not None and workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        if rest.get("mode") not in (None, 0o700, 0o750):
            raise ValueError(f"--mode must be 0700 (owner only) or 0750 (group may read, never write), got {rest['mode']:04o}")
        for name in ("failure_ttl", "evict_min_age", "max_bytes", "max_entries"):
            if rest.get(name) is not None and rest[name] < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {rest[name]}")
        allow_remote = rest.pop("allow_remote", False)
        if rest.get("tcp") is not None:
            rest["tcp"] = tcp_address(rest["tcp"], allow_remote)
        if rest.get("metrics_address") is not None:
            rest["metrics_address"] = tcp_address(rest["metrics_address"], allow_remote, flag="--metrics-address")
        if rest.get("target") not in (None, "auto"):
            check_target(rest["target"])
        if not rest.get("remote") and env.get("KERNEL_SERVICE_REMOTE"):
            rest["remote"] = env["KERNEL_SERVICE_REMOTE"]
            sources["remote"] = "$KERNEL_SERVICE_REMOTE"
        rest["remote"] = remote_url(rest.get("remote") or None)
        if rest.get("remote_read_only") and not rest["remote"]:
            raise ValueError("--remote-read-only needs a tier to read: pass --remote URL (or set KERNEL_SERVICE_REMOTE)")
        for name in ("remote_lease_seconds", "remote_timeout", "remote_ttl"):
            if rest.get(name) is not None and rest[name] <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {rest[name]}")
        requested = rest.get("cuda_compiler") or env.get(devices.ENV) or "auto"
        rest["cuda_compiler_id"] = rest.get("cuda_compiler_id") or env.get(devices.ID_ENV) or None
        if rest["cuda_compiler_id"]:
            if not rest.get("no_compile"):
                raise ValueError("--cuda-compiler-id needs --no-compile: a daemon that compiles keys its entries by the compiler it runs")
            sources.setdefault("cuda_compiler_id", f"${devices.ID_ENV}")
            rest["cuda_compiler"] = devices.named(rest["cuda_compiler_id"]).name  # named, never looked for: nothing compiles
            sources["cuda_compiler"] = "--cuda-compiler-id"
        else:
            rest["cuda_compiler"] = devices.choose(rest.get("cuda_compiler"), env).name
            sources.setdefault("cuda_compiler", f"${devices.ENV}" if env.get(devices.ENV) else "default")
            if requested == "auto":
                sources["cuda_compiler"] += " (auto: NVRTC where it can run)"
        sources["socket"] = "--socket" if socket else "$KERNEL_SERVICE_SOCKET" if env.get("KERNEL_SERVICE_SOCKET") else "default"
        sources["cache_dir"] = "--cache-dir" if cache_dir else "$KERNEL_SERVICE_CACHE_DIR" if env.get("KERNEL_SERVICE_CACHE_DIR") else "default"
        sources["workers"] = "--workers" if workers else "CPUs usable here (affinity and cgroup quota)"
        config = cls(
            socket=Path(socket) if socket else default_socket(env),
            cache_dir=Path(cache_dir) if cache_dir else default_cache_dir(env),
            workers=workers or usable_cpus(),
            sources=sources,
            **{k: v for k, v in rest.items() if v is not None},
        )
        check_socket_path(config.socket)
        return config


def remote_url(text: str | None) -> str | None:
    """A Redis URL redis-py can open: redis://[user:password@]host[:port][/db], rediss:// (TLS)
    or unix://[user:password@]/path/to/redis.sock[?db=N]."""
    if text is None:
        return None
    parts = urlsplit(text)
    shown = without_password(text)  # errors never echo a password
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"--remote {shown!r}: expected a redis://, rediss:// or unix:// URL (e.g. redis://user:password@cache-host:6379/0)")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ValueError(f"--remote {shown!r}: the port is not a number from 1 to 65535") from None
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"--remote {shown!r}: no host; expected {parts.scheme}://host:port/db")
    if parts.scheme == "unix" and not parts.path:
        raise ValueError(f"--remote {shown!r}: no socket path; expected unix:///path/to/redis.sock")
    return text


def without_password(url: str) -> str:
    """A URL as stats, logs and errors may show it: any password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, where = parts.netloc.rpartition("@")
    return urlunsplit((parts.scheme, f"{userinfo.split(':', 1)[0]}:***@{where}", parts.path, parts.query, parts.fragment))


MAX_SOCKET_PATH = 107  # bytes of a Unix socket path, the terminating NUL excluded (sun_path is 108)


def check_socket_path(path: Path) -> None:
    length = len(os.fsencode(os.path.abspath(path)))
    if length > MAX_SOCKET_PATH:
        raise ValueError(f"--socket {path}: {length} bytes, but a Unix socket path may have at most {MAX_SOCKET_PATH}; choose a shorter path (e.g. under /tmp)")


def check_target(text: str) -> None:
    import kernels

    try:
        kernels.parse_target(text)
    except kernels.InvalidSpec as exc:
        raise ValueError(f"--target: {str(exc).removeprefix('target: ')}") from None


_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "123", "512M", "10G" or "10GiB" (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; use bytes or a suffix: 512M, 10G")
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).upper()])


def tcp_address(text: str, allow_remote: bool = False, flag: str = "--tcp") -> str:
    """A listen address from "PORT", ":PORT", "HOST:PORT" or "[V6]:PORT"; the host
    defaults to 127.0.0.1 and must be loopback unless `allow_remote`."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} {text!r}: expected HOST:PORT with a port from 1 to 65535")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        raise ValueError(f"{flag} {text!r}: {host} is not a loopback address; nothing on it is encrypted, pass --allow-remote to expose it on a trusted network anyway")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
