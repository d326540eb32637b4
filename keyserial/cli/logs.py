"""How the ``keyserial`` command logs: lines of text for people, or one JSON object per line
for log pipelines (``--log-format json``)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

from .._logfields import FIELDS

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message"}``, then each structured field the record
    carries (``shard``, ``epoch``, ``key``, ``op``, ``op_id``, ``error``: see ``_logfields``),
    and ``exc_info`` (the formatted traceback) when it carries an exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({name: record.__dict__[name] for name in FIELDS if name in record.__dict__})
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, log_format: str) -> None:
    """Log to stderr at ``level`` (one of :data:`LEVELS`) in ``log_format`` (:data:`FORMATS`)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(_TEXT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
