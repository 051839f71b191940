"""Process logging: one handler on the root logger, text or JSON lines, libraries quieted.

`configure_logging()` is called once by the CLI before a long-running command. The level
comes from --log-level, else TAILWATCH_LOG_LEVEL, else INFO; the format from --log-format,
else TAILWATCH_LOG_FORMAT, else text. APScheduler's "Running job ... executed
successfully" (two lines per job run) and httpx's line per webhook request stay below
WARNING, so INFO is what an operator acts on: alert and flag changes, warm-up, failures.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Loggers that speak per job run, per request or per connection ("Context impl
# SQLiteImpl."): only their warnings are shown.
QUIET = ("apscheduler", "httpx", "httpcore", "alembic")


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON object per line (time, level, logger, message, exc)."""

    def format(self, record: logging.LogRecord) -> str:
        """Return the record as a JSON line."""
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def resolve(level: str | None, fmt: str | None) -> tuple[str, str]:
    """Return (level, format) from the options, then the environment; raise ValueError."""
    level = (level or os.environ.get("TAILWATCH_LOG_LEVEL") or "info").lower()
    fmt = (fmt or os.environ.get("TAILWATCH_LOG_FORMAT") or "text").lower()
    if level not in LEVELS:
        raise ValueError(f"TAILWATCH_LOG_LEVEL: must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"TAILWATCH_LOG_FORMAT: must be one of {', '.join(FORMATS)}, "
                         f"got {fmt!r}")
    return level, fmt


class StderrHandler(logging.StreamHandler):
    """Write to whatever sys.stderr is at each record (it may be replaced after start-up)."""

    @property
    def stream(self) -> Any:
        """Return the current sys.stderr."""
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure_logging(level: str | None = None, fmt: str | None = None) -> tuple[str, str]:
    """Install the root handler and return the (level, format) in force."""
    level, fmt = resolve(level, fmt)
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        if isinstance(old, StderrHandler):  # ours, from an earlier call: replace it
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    quiet = logging.DEBUG if level == "debug" else logging.WARNING
    for name in QUIET:
        logging.getLogger(name).setLevel(quiet)
    return level, fmt
