"""A redis-server child process on a loopback port, for tests and benchmarks.

It keeps nothing on disk (--save '' --appendonly no), listens on 127.0.0.1
only, and takes ACL lines (`user NAME ...`, as a Redis ACL file holds them),
applied again after every restart. Production runs its own Redis (README: a fleet).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

SERVER = "redis-server"


def available() -> bool:
    return shutil.which(SERVER) is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    def __init__(self, acl: list[str] = (), port: int | None = None, log_path: Path | None = None, maxmemory: str = "512mb"):
        self.acl = list(acl)
        self.port = port or free_port()
        self.log_path = Path(log_path or Path(tempfile.mkdtemp(prefix="ks-redis-")) / "redis.log")
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None

    def url(self, user: str | None = None, password: str | None = None, db: int = 0) -> str:
        auth = f"{user or ''}:{password}@" if password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def admin(self) -> redis.Redis:
        """A client as the default user (every command), for set-up and inspection."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, timeout: float = 30) -> RedisProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The fleet's documented settings: bounded memory, least recently used keys go first.
        args = [SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.log_path.parent), "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]  # fmt: skip
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with status {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                with self.admin() as r:
                    r.ping()
                    for line in self.acl:
                        words = line.split()
                        if words[:1] != ["user"]:
                            raise ValueError(f"not an ACL user line: {line!r}")
                        r.execute_command("ACL", "SETUSER", *words[1:])
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout:.0f}s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> RedisProcess:
        """Stopped and started again on the same port, empty (nothing is saved)."""
        self.stop()
        return self.start()

    def __enter__(self) -> RedisProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
