"""common/logging.py RateLimited: the first few events of a kind per interval, then a count."""

from __future__ import annotations

import logging
import threading

from kvpool.common.logging import _GRPC_FILTER, RateLimited

from .conftest import FakeClock


class Sink:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields) -> None:
        self.lines.append((event, fields))

    error = warning


def test_5000_refusals_log_a_burst_then_one_summary_per_interval():
    clock, sink = FakeClock(), Sink()
    limit = RateLimited(sink, burst=10, interval_s=60.0, clock=clock)
    logged = sum(limit.warning("request_refused", kind="OUT_OF_BOUNDS", n=i) for i in range(5000))
    assert logged == 10 and len(sink.lines) == 10
    assert limit.suppressed() == 4990
    clock.advance(60.0)
    assert limit.warning("request_refused", kind="OUT_OF_BOUNDS", n=5000)
    assert sink.lines[-2] == ("log_suppressed", {"suppressed_event": "request_refused",
                                                 "count": 4990, "interval_s": 60.0})
    assert sink.lines[-1] == ("request_refused", {"n": 5000})
    assert limit.suppressed() == 0


def test_kinds_are_limited_apart_and_bounded():
    clock, sink = FakeClock(), Sink()
    limit = RateLimited(sink, burst=2, interval_s=60.0, clock=clock, max_kinds=4)
    for kind in ("A", "B"):
        for _ in range(5):
            limit.warning("refused", kind=kind)
    assert len(sink.lines) == 4   # two of each kind
    for i in range(1000):   # a client inventing kinds shares one entry past max_kinds
        limit.warning("refused", kind=f"invented-{i}")
    assert len(limit._kinds) <= 5


def test_thread_safe_counts():
    limit = RateLimited(Sink(), burst=5, interval_s=3600.0)

    def hammer():
        for _ in range(2000):
            limit.warning("x")
    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert limit.suppressed() == 8000 - 5


def test_grpc_log_records_are_rate_limited():
    record = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, __file__, 1,
                               "Unexpected [DecodeError] raised by servicer method", (), None)
    passed = sum(_GRPC_FILTER.filter(record) for _ in range(500))
    assert 1 <= passed <= 10
    ours = logging.LogRecord("kvpool.master", logging.ERROR, __file__, 1, "x", (), None)
    assert all(_GRPC_FILTER.filter(ours) for _ in range(100))
