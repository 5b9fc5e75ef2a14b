"""The /metrics server: a scraper that hangs up mid-answer costs a log line at most, never a
traceback (one in a master's log failed test_grafana_dashboard_live in CI)."""

from __future__ import annotations

import socket
import struct
import urllib.request

from kvpool.common.metrics import MetricsServer
from prometheus_client import CollectorRegistry, Gauge


def test_a_scraper_that_hangs_up_mid_answer_leaves_no_traceback(capfd):
    registry = CollectorRegistry()
    gauge = Gauge("kvpool_test_wide", "many series: an answer larger than a socket's buffers",
                  ["n"], registry=registry)
    for n in range(40_000):
        gauge.labels(str(n)).set(n)
    with MetricsServer(registry, lambda: None) as server:
        host, port = server.address.rsplit(":", 1)
        for _ in range(5):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                s.recv(1)   # the answer has begun
                # Close with a reset, so the server's next write fails at once.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with urllib.request.urlopen(f"http://{server.address}/healthz", timeout=5) as r:
            assert r.read() == b"ok\n"   # still serving
    assert "Traceback" not in capfd.readouterr().err
