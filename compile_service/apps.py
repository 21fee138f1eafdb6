"""What each application asked for, kept in the cache so `kernel-service manifest` can write it.

    <cache root>/apps/<app>.jsonl    one canonical spec (JSON) per line, in the order first asked

Append-only: a spec already recorded costs a set lookup; a new one, one short
O_APPEND write. A line torn by a crash is skipped when read. Recording is a
side note to serving: a failed write is logged, never a failed request.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from proto.manifest import MAX_KERNELS, check_app

log = logging.getLogger(__name__)

APPS = "apps"
SUFFIX = ".jsonl"
MAX_APPS = 1024  # applications recorded by one daemon; more is a misconfiguration, not traffic


def _canonical(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))  # CanonicalSpec.to_json's text


def read(root: Path, app: str) -> list[dict]:
    """The specs recorded for `app`, first asked first, once each; [] when none."""
    try:
        text = (Path(root) / APPS / f"{check_app(app)}{SUFFIX}").read_text()
    except FileNotFoundError:
        return []
    seen, specs = set(), []
    for line in text.splitlines():
        try:
            spec = json.loads(line)
        except ValueError:
            continue  # torn by a crash mid-write
        if isinstance(spec, dict) and _canonical(spec) not in seen:
            seen.add(_canonical(spec))
            specs.append(spec)
    return specs


def recorded(root: Path) -> list[str]:
    """The applications with a record in the cache at `root`."""
    folder = Path(root) / APPS
    return sorted(p.name[: -len(SUFFIX)] for p in folder.glob(f"*{SUFFIX}")) if folder.is_dir() else []


class AppRecorder:
    def __init__(self, root: Path, dir_mode: int = 0o700):
        self.dir = Path(root) / APPS
        self.dir_mode = dir_mode
        self.file_mode = dir_mode & 0o640
        self._known: dict[str, set[str]] = {}  # app -> canonical specs on disk
        self._lock = threading.Lock()

    def record(self, app: str, spec_json: str) -> None:
        """Notes that `app` (a checked name) asked for the canonical spec `spec_json`."""
        known = self._known.get(app)
        if known is not None and spec_json in known:  # the common case: no lock, no I/O
            return
        with self._lock:
            known = self._known.get(app)
            if known is None:
                if len(self._known) >= MAX_APPS:
                    log.warning("not recording application %r: %d applications already recorded", app, MAX_APPS)
                    return
                known = self._known[app] = {_canonical(s) for s in read(self.dir.parent, app)}
            if spec_json in known:
                return
            if len(known) >= MAX_KERNELS:
                log.warning("not recording more kernels for application %r: %d already", app, MAX_KERNELS)
                return
            try:
                self._append(app, spec_json)
            except OSError as exc:
                log.warning("cannot record a kernel of application %r: %s", app, exc.strerror or exc)
                return
            known.add(spec_json)

    def _append(self, app: str, spec_json: str) -> None:
        if not self.dir.is_dir():
            self.dir.mkdir(mode=self.dir_mode, exist_ok=True)
            os.chmod(self.dir, self.dir_mode)
        fd = os.open(self.dir / f"{app}{SUFFIX}", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, self.file_mode)
        try:
            os.write(fd, (spec_json + "\n").encode())
        finally:
            os.close(fd)
