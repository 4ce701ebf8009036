"""Logging setup for the plugin: one line per event, as text or as JSON (``--log-format``).

Extra fields passed with ``log.info("...", extra={"gpu_uuid": u})`` are kept: as ``key=value``
pairs at the end of a text line, as their own keys in a JSON line.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any, Literal, TextIO

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")

# Attributes every LogRecord has; anything else on a record came in through ``extra``.
_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
) | {"message", "asctime", "taskName"}


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a caller attached to ``record`` through ``extra``."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS}


def _timestamp(record: logging.LogRecord) -> str:
    moment = datetime.fromtimestamp(record.created, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <message> k=v ...``, newlines escaped to keep one line."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [_timestamp(record), record.levelname, f"{record.name}:", record.getMessage()]
        parts += [f"{k}={_text_value(v)}" for k, v in extra_fields(record).items()]
        line = " ".join(parts)
        if record.exc_info:
            line += " | " + self.formatException(record.exc_info)
        return line.replace("\\", "\\\\").replace("\n", "\\n")


def _text_value(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (not text or any(c.isspace() or c == '"' for c in text)) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then the extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in extra_fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def parse_level(level: str | int) -> int:
    """``info``/``INFO``/``20`` -> 20; raises ValueError naming the bad value."""
    if isinstance(level, int):
        return level
    text = level.strip()
    if text.isdigit():
        return int(text)
    value = logging.getLevelName(text.upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r} (use debug, info, warning or error)")
    return value


def setup_logging(
    fmt: LogFormat | str = "text", level: str | int = "info", stream: TextIO | None = None
) -> logging.Handler:
    """Routes every logger to one handler on ``stream`` (stderr); returns the handler."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (use text or json)")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    # Replaces handlers we installed before, so calling this twice does not double lines.
    for old in [h for h in root.handlers if getattr(h, "_vgpu_plugin", False)]:
        root.removeHandler(old)
    handler._vgpu_plugin = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(parse_level(level))
    # grpc's own chatter stays at warnings unless we debug.
    logging.getLogger("grpc").setLevel(max(parse_level(level), logging.WARNING))
    return handler
