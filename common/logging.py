"""structlog set-up: event names are snake_case facts (``segment_mounted``) with key=value fields."""

from __future__ import annotations

import logging
import sys

import structlog
from kvpool.common.config import LOG_FORMATS


def configure(level: str = "info", component: str | None = None, fmt: str = "console") -> None:
    """Log to stderr, one event per line: ``timestamp level event key=value`` (``console``)
    or one JSON object (``json``: ``timestamp``, ``level``, ``event``, the fields, and
    ``exception`` with the traceback as text); call once per process."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    render = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()] \
        if fmt == "json" else [structlog.dev.ConsoleRenderer(colors=False)]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    if component:
        structlog.contextvars.bind_contextvars(component=component)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    # A library must not chatter into its host process (an engine links the client): until a
    # kvpool process calls configure(), only warnings and errors are logged, to stderr.
    if not structlog.is_configured():
        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    return structlog.get_logger(name)
