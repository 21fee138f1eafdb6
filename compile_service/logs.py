"""How the daemon, its compile workers and the other commands log: text lines (the default) or,
with `--log-format json`, one JSON object per line for a log pipeline to parse.

A JSON line holds time (UTC, ISO 8601), level, logger, message, pid, and exception (the
traceback) when there is one.
"""

from __future__ import annotations

import datetime
import json
import logging

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
WORKER_TEXT = "%(asctime)s %(levelname)s %(name)s[worker %(process)d]: %(message)s"

_chosen: dict = {}  # as configure() last set them: what workers are started with


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        return json.dumps(line)


def level(text: str) -> str:
    """A level's name from its text, any case; ValueError names the levels."""
    if text.upper() not in LEVELS:
        raise ValueError(f"unknown level {text!r}; use one of {', '.join(LEVELS)}")
    return text.upper()


def configure(level: str | int, form: str = "text", worker: bool = False) -> None:
    """Sets up this process's logging: to stderr, at `level`, as `form` ("text" or "json")."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if form == "json" else logging.Formatter(WORKER_TEXT if worker else TEXT))
    logging.basicConfig(level=level, handlers=[handler])
    _chosen.update(level=level, format=form)


def chosen() -> tuple[str | int, str]:
    """(level, format) this process logs with: what its compile workers are started with (in a
    process that never called configure, an agent's fallback: its root logger's level, as text)."""
    return _chosen.get("level") or logging.getLogger().getEffectiveLevel(), _chosen.get("format", "text")
