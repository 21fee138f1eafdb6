"""The daemon's settings, resolved once from flags and environment; nothing reads them later."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

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

    @property
    def plugin_args(self) -> dict:
        """What the daemon and each compile worker load beyond the zoo (kernels.plugins.load)."""
        return {"modules": self.kernel_modules, "entry_points": self.entry_points, "allow": self.plugins}
    cuda_compiler: str = devices.NVCC  # "nvrtc" or "nvcc": how CUDA device code is compiled (resolved from "auto")

    @classmethod
    def resolve(
        cls,
        socket: str | None = None,
        cache_dir: str | None = None,
        workers: int | None = None,
        env=os.environ,
        **rest,
    ) -> ServiceConfig:
        """Flags win, then KERNEL_SERVICE_* variables, then the XDG defaults."""
        if workers is not None and workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        if rest.get("mode") not in (None, 0o700, 0o750):
            raise ValueError(f"--mode must be 0700 (owner only) or 0750 (group may read, never write), got {rest['mode']:04o}")
        for name in ("failure_ttl", "evict_min_age", "max_bytes", "max_entries"):
            if rest.get(name) is not None and rest[name] < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {rest[name]}")
        if rest.get("tcp") is not None:
            rest["tcp"] = tcp_address(rest["tcp"], rest.pop("allow_remote", False))
        rest.pop("allow_remote", None)
        rest["cuda_compiler"] = devices.choose(rest.get("cuda_compiler"), env).name
        return cls(
            socket=Path(socket) if socket else default_socket(env),
            cache_dir=Path(cache_dir) if cache_dir else default_cache_dir(env),
            workers=workers or usable_cpus(),
            **{k: v for k, v in rest.items() if v is not None},
        )


_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "123", "512M", "10G" or "10GiB" (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; use bytes or a suffix: 512M, 10G")
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).upper()])


def tcp_address(text: str, allow_remote: bool = False) -> str:
    """A gRPC listen address from "PORT", ":PORT", "HOST:PORT" or "[V6]:PORT"; the host
    defaults to 127.0.0.1 and must be loopback unless `allow_remote`."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--tcp {text!r}: expected HOST:PORT with a port from 1 to 65535")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        raise ValueError(f"--tcp {text!r}: {host} is not a loopback address; the token travels unencrypted over TCP, pass --allow-remote to expose it on a trusted network anyway")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
