"""The daemon's settings, resolved once from flags and environment; nothing reads them later."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .cpus import usable_cpus
from .paths import default_cache_dir, default_socket


@dataclass(frozen=True)
class ServiceConfig:
    socket: Path  # Unix socket path the daemon listens on
    cache_dir: Path  # root of the kernel cache
    workers: int  # size of the compile pool
    target: str = "auto"  # target for specs that name none
    grace: float = 30.0  # seconds SIGTERM waits for running compiles
    queue_limit: int = 4096  # compiles queued or running before RESOURCE_EXHAUSTED
    warm_up: bool = True  # start every compile worker at launch
    kernel_modules: tuple[str, ...] = ()  # extra modules that register kernel kinds

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
        return cls(
            socket=Path(socket) if socket else default_socket(env),
            cache_dir=Path(cache_dir) if cache_dir else default_cache_dir(env),
            workers=workers or usable_cpus(),
            **{k: v for k, v in rest.items() if v is not None},
        )
