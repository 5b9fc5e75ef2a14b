"""structlog set-up: event names are snake_case facts (``segment_mounted``) with key=value fields."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

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
    # gRPC logs a traceback for each request it cannot decode, before any handler runs: a
    # client sending garbage must not fill the disk (the master answers those itself too).
    for handler in logging.getLogger().handlers:
        handler.addFilter(_GRPC_FILTER)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    # A library must not chatter into its host process (an engine links the client): until a
    # kvpool process calls configure(), only warnings and errors are logged, to stderr.
    if not structlog.is_configured():
        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    return structlog.get_logger(name)


class RateLimited:
    """Log the first ``burst`` events of each kind every ``interval_s``, then only count them;
    the next one after the interval logs ``log_suppressed`` (event, count) before itself.

    For what clients cause, once per request (refused frames, malformed protobuf, reads out of
    range): a misbehaving or hostile client must not turn each request into a log line. A kind
    is the event name, or ``(event, kind)``; at most ``max_kinds`` are told apart (the rest
    share one), so a client inventing kinds cannot grow the table. Thread-safe."""

    def __init__(self, logger, burst: int = 10, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, max_kinds: int = 256) -> None:
        self._log = logger
        self.burst, self.interval_s = burst, interval_s
        self._clock = clock
        self._max_kinds = max_kinds
        self._lock = threading.Lock()
        # kind -> [interval start, logged in it, suppressed in it]
        self._kinds: dict[object, list] = {}

    def warning(self, event: str, *, kind: object = None, **fields) -> bool:
        """Log ``event`` at warning level unless its kind is over its burst; True if logged."""
        return self._emit(self._log.warning, event, kind, fields)

    def error(self, event: str, *, kind: object = None, **fields) -> bool:
        return self._emit(self._log.error, event, kind, fields)

    def _emit(self, method, event: str, kind: object, fields: dict) -> bool:
        key = event if kind is None else (event, kind)
        now = self._clock()
        with self._lock:
            entry = self._kinds.get(key)
            if entry is None:
                if len(self._kinds) >= self._max_kinds:
                    key = (event, "(other)")
                entry = self._kinds.setdefault(key, [now, 0, 0])
            suppressed = 0
            if now - entry[0] >= self.interval_s:
                suppressed, entry[:] = entry[2], [now, 0, 0]
            if entry[1] >= self.burst:
                entry[2] += 1
                return False
            entry[1] += 1
        if suppressed:
            self._log.warning("log_suppressed", suppressed_event=event, count=suppressed,
                              interval_s=self.interval_s)
        method(event, **fields)
        return True

    def suppressed(self) -> int:
        """Events counted but not logged in the current intervals (for tests and stats)."""
        with self._lock:
            return sum(e[2] for e in self._kinds.values())


class _GRPCLogFilter(logging.Filter):
    """Rate-limits gRPC's own log records (10 a minute per message start), tracebacks too."""

    def __init__(self, burst: int = 10, interval_s: float = 60.0) -> None:
        super().__init__()
        self._limit = RateLimited(_StdlibSink(), burst, interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("grpc"):
            return True
        return self._limit.warning(record.name, kind=str(record.msg)[:40])


class _StdlibSink:
    """What RateLimited logs for the gRPC filter: the summary line through stdlib logging
    (the record itself is let through by the filter)."""

    def warning(self, event: str, **fields) -> None:
        if event == "log_suppressed":
            logging.getLogger("kvpool.grpc").warning(
                "log_suppressed: %d gRPC log records like %s in %ss", fields["count"],
                fields["suppressed_event"], fields["interval_s"])

    error = warning


_GRPC_FILTER = _GRPCLogFilter()
