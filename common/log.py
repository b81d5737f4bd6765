"""Structured logging: every line names the service and rank; long steps report progress.

`text` format is for people (`12:00:01 thinker[r0] INFO loading weights 12/42 shards`), `json` for
collectors (one object per line with the same fields plus any `extra=` keys).
"""

from __future__ import annotations

import json
import logging
import os
import sys
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
