"""Logging setup: one line per event, as text or JSON, extra fields kept."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from vgpu_plugin.commands.logs import parse_level, setup_logging


@pytest.fixture(autouse=True)
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_time_level_logger_message_and_extras() -> None:
    out = io.StringIO()
    setup_logging("json", "info", stream=out)
    log = logging.getLogger("vgpu_plugin.test")
    log.info("registered %s", "nvidia.com/gpu", extra={"endpoint": "vgpu-1.sock", "n": 3})
    log.debug("hidden at info")
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        log.exception("it failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["level"] == "info"
    assert first["logger"] == "vgpu_plugin.test"
    assert first["message"] == "registered nvidia.com/gpu"
    assert first["endpoint"] == "vgpu-1.sock" and first["n"] == 3
    assert first["time"].endswith("Z") and "T" in first["time"]
    assert second["level"] == "error"
    assert "ValueError: boom" in second["exception"]


def test_text_is_one_line_per_event_with_extras() -> None:
    out = io.StringIO()
    setup_logging("text", "debug", stream=out)
    log = logging.getLogger("vgpu_plugin.test")
    log.warning("two\nlines", extra={"gpu_uuid": "GPU-a", "why": "has space"})
    try:
        raise RuntimeError("x")
    except RuntimeError:
        log.error("failed", exc_info=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert ' WARNING vgpu_plugin.test: two\\nlines gpu_uuid=GPU-a why="has space"' in lines[0]
    assert "Traceback" in lines[1] and "RuntimeError: x" in lines[1]


def test_calling_setup_twice_does_not_duplicate_lines() -> None:
    out = io.StringIO()
    setup_logging("text", "info", stream=out)
    setup_logging("json", "info", stream=out)
    logging.getLogger("x").info("once")
    assert len(out.getvalue().splitlines()) == 1


def test_bad_format_or_level_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        setup_logging("xml")
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        parse_level("loud")
    assert parse_level("WARNING") == logging.WARNING
    assert parse_level("10") == logging.DEBUG
