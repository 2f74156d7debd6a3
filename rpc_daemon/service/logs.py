"""structlog set-up shared by the daemon and the coordinator."""
from __future__ import annotations

import datetime
import json
import logging
import sys

import structlog

_json = False  # configure()'s format, which say() follows


class _Unbreakable:
    """A log stream whose failure is not the caller's. When the reader of our
    stderr is gone (the coordinator that started a local worker died, journald
    restarted) every write raises BrokenPipeError; a log call must not abort a
    connection callback or the daemon's shutdown half-way."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):  # EPIPE, EIO; ValueError: the stream was closed
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass


def configure(fmt: str = "console", level: str = "info") -> None:
    global _json
    _json = fmt == "json"
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_Unbreakable(sys.stderr)),
        cache_logger_on_first_use=False,
    )


def say(text: str, level: str = "info", prog: str = "ggml-coordinator", new_line: bool = False,
        **fields) -> None:
    """A line for whoever runs the program, printed to stderr whatever the log
    level (the URL it serves, why it cannot start): `prog: text` in the console
    format (after a line break if `new_line`: generated text may have left the
    cursor mid-line); under --log-format json one JSON object like every other
    line (`event` is `text`, with `level`, `timestamp` and `fields`)."""
    if _json:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        line = json.dumps({"event": text, **fields, "level": level, "timestamp": stamp}, default=str)
    else:
        line = f"{chr(10) if new_line else ''}{prog}: {text}"
    out = _Unbreakable(sys.stderr)
    out.write(line + "\n")
    out.flush()
