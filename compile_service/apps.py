"""What each application asked for, kept in the cache so `kernel-service manifest` can write it.

    <cache root>/apps/<app>.jsonl    one canonical spec (JSON) per line, in the order first asked

Append-only: a spec already recorded costs a set lookup; a new one, one short
O_APPEND write. A line torn by a crash is skipped when read. Recording is a
side note to serving: a failed write is logged, never a failed request.

Bounded: an application keeps its newest MAX_APP_SPECS specs and all of them
together the newest MAX_SPECS (the oldest are dropped, the file rewritten
without them), so a client that asks for endless distinct specs costs a fixed
amount of memory and disk. The records count in the cache budget (--max-size):
the daemon lists apps/ with the device binaries in LocalStore's extra_usage, and
eviction may remove a record not written for longer than the least recently used entries.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from .fsutil import write_text_atomic

from proto.manifest import check_app

log = logging.getLogger(__name__)

APPS = "apps"
SUFFIX = ".jsonl"
MAX_APPS = 1024  # applications recorded by one daemon; more is a misconfiguration, not traffic
MAX_APP_SPECS = 4096  # specs kept per application, the newest
MAX_SPECS = 65536  # specs kept in all, the newest


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
    def __init__(self, root: Path, dir_mode: int = 0o700, max_app_specs: int = MAX_APP_SPECS, max_specs: int = MAX_SPECS):
        self.dir = Path(root) / APPS
        self.dir_mode = dir_mode
        self.file_mode = dir_mode & 0o640
        self.max_app_specs, self.max_specs = max_app_specs, max_specs
        self._known: dict[str, dict[str, int]] = {}  # app -> canonical spec on disk -> when recorded (a sequence number), oldest first
        self._total = 0
        self._seq = 0
        self._lock = threading.Lock()
        with self._lock:
            self._load()

    def _load(self) -> None:
        """What the cache holds, oldest file first, within the caps (under _lock)."""
        folder = self.dir
        files = sorted(folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
        for path in files[:MAX_APPS]:
            app = path.name[: -len(SUFFIX)]
            try:
                specs = read(self.dir.parent, app)
            except (OSError, ValueError) as exc:
                log.warning("cannot read the record of application %r: %s", app, exc)
                continue
            self._known[app] = {}
            for spec in specs:
                self._add(app, _canonical(spec))
        for app in self._drop_oldest():  # a cache recorded past today's caps
            self._rewrite(app)

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
                known = self._known[app] = {}
            elif known and not (self.dir / f"{app}{SUFFIX}").exists():  # evicted or cleared meanwhile
                self._total -= len(known)
                known.clear()
            if spec_json in known:
                return
            try:
                self._append(app, spec_json)
            except OSError as exc:
                log.warning("cannot record a kernel of application %r: %s", app, exc.strerror or exc)
                return
            self._add(app, spec_json)
            for dropped_from in self._drop_oldest():
                self._rewrite(dropped_from)

    def _add(self, app: str, spec_json: str) -> None:
        self._seq += 1
        self._known[app][spec_json] = self._seq
        self._total += 1

    def _drop_oldest(self) -> set[str]:
        """Drops the oldest specs past the caps; returns the apps whose files must be rewritten."""
        changed = set()
        for app, known in self._known.items():
            while len(known) > self.max_app_specs:
                del known[next(iter(known))]
                self._total -= 1
                changed.add(app)
        while self._total > self.max_specs:
            app = min((a for a in self._known if self._known[a]), key=lambda a: next(iter(self._known[a].values())))
            del self._known[app][next(iter(self._known[app]))]
            self._total -= 1
            changed.add(app)
        return changed

    def _rewrite(self, app: str) -> None:
        """The app's file holds its kept specs only (none: the file goes)."""
        path = self.dir / f"{app}{SUFFIX}"
        try:
            if self._known[app]:
                write_text_atomic(path, "".join(f"{spec}\n" for spec in self._known[app]), mode=self.file_mode, fsync=False)
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot drop the oldest kernels of application %r: %s", app, exc.strerror or exc)

    def _append(self, app: str, spec_json: str) -> None:
        if not self.dir.is_dir():
            self.dir.mkdir(mode=self.dir_mode, exist_ok=True)
            os.chmod(self.dir, self.dir_mode)
        fd = os.open(self.dir / f"{app}{SUFFIX}", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, self.file_mode)
        try:
            os.write(fd, (spec_json + "\n").encode())
        finally:
            os.close(fd)
