"""Structured logging: every line names the service and rank; long steps report progress.

`text` format is for people (`12:00:01 thinker[r0] INFO loading weights 12/42 shards`), `json` for
collectors (one object per line with the same fields plus any `extra=` keys).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

_CONTEXT = {"service": os.environ.get("OMNISTAGE_SERVICE", "omnistage"), "rank": None}


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        who = _CONTEXT["service"] + (f"[r{_CONTEXT['rank']}]" if _CONTEXT["rank"] is not None else "")
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        extra = getattr(record, "fields", None)
        tail = " " + " ".join(f"{k}={v}" for k, v in extra.items()) if extra else ""
        line = f"{ts} {who} {record.levelname} {record.getMessage()}{tail}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": _CONTEXT["service"],
            "rank": _CONTEXT["rank"],
            "logger": record.name,
            "msg": record.getMessage(),
        }
        obj.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def setup_logging(service: str, rank: int | None = None, level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger of this process once (stderr)."""
    _CONTEXT["service"] = service
    _CONTEXT["rank"] = rank
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("grpc", "asyncio", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def log_fields(logger: logging.Logger, level: int, msg: str, **fields: object) -> None:
    """Log `msg` with structured key=value fields."""
    logger.log(level, msg, extra={"fields": fields})


class RateLimitedLog:
    """At most one line per `interval_s` for one kind of event a client can cause at will (bad bytes):
    a flood must not flood the log. The next line says how many were left out meanwhile."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._suppressed = 0

    def log(self, level: int, msg: str, **fields: object) -> bool:
        """Log now (True), or count this one as suppressed (False)."""
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval_s:
                self._suppressed += 1
                return False
            self._last, suppressed, self._suppressed = now, self._suppressed, 0
        if suppressed:
            fields = {**fields, "suppressed_since_last": suppressed}
        log_fields(self.logger, level, msg, **fields)
        return True
