"""structlog set-up: event names are snake_case facts (``segment_mounted``) with key=value fields."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info", component: str | None = None) -> None:
    """Log to stderr as ``timestamp level event key=value``; call once per process."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.dev.ConsoleRenderer(colors=False),
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
