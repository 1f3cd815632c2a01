"""How a service process writes its logs: text (the default) or one JSON object per line.

Owns the two formats and installing one on the root logger. ``--log-format json`` writes
each record as a JSON object on one line, with ``timestamp`` (UTC, ISO 8601), ``level``,
``logger`` and ``message`` keys, the exception's traceback under ``exception`` when there is
one, and every field a caller passed in ``extra={"fields": {...}}`` as keys of its own (a
request's id, tokens, timings: see ``request_record``), so a log pipeline reads them without
parsing the message. The text format appends nothing: the message already says it all. It
does not own what is logged.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The keys a record's structured fields may not take (they name the record itself).
RESERVED_KEYS = frozenset({"timestamp", "level", "logger", "message", "exception"})


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update((key, value) for key, value in fields.items()
                         if key not in RESERVED_KEYS)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # default=str: a field that is not JSON (a path, an enum) is written as its text.
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str = "text", stream: TextIO | None = None) -> None:
    """Send the process's logs at ``level`` and above to ``stream`` (default: stderr) in
    ``log_format``, replacing whatever handlers the root logger had."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
