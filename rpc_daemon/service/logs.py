"""structlog set-up shared by the daemon and the coordinator."""
from __future__ import annotations

import logging
import sys

import structlog


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
