"""A process's HTTP port for operators: Prometheus metrics and Kubernetes-style probes.

``/metrics``: the registry in Prometheus' text format (prometheus-client). ``/healthz``: 200
while the process serves HTTP at all (a liveness probe). ``/readyz``: 200 when the process is
ready for traffic, else 503 with the reason (a readiness probe; each kind of process says what
ready means). Anything else is 404. Served by a thread of its own, so a scrape never waits for
the process's main work; what it reads of that work is each collector's business.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

from kvpool.common.logging import get_logger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector

log = get_logger(__name__)


def new_registry() -> CollectorRegistry:
    """A registry of one server's metrics, with the process' own (CPU, memory, open files)."""
    registry = CollectorRegistry()   # collectors are not asked to describe themselves
    ProcessCollector(registry=registry)
    return registry


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` (0: a free port, see
    ``port``). ``not_ready()`` returns why the process is not ready, or None when it is."""

    def __init__(self, registry: CollectorRegistry, not_ready: Callable[[], str | None],
                 host: str = "127.0.0.1", port: int = 0) -> None:
        try:
            self._http = _Server((host, port), _Handler)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port} for metrics: "
                          f"{e.strerror or e}") from None
        self._http.registry, self._http.not_ready = registry, not_ready
        self.host, self.port = host, self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="metrics",
                                        daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Self:
        self._thread.start()
        log.info("metrics_serving", address=self.address)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._http.shutdown()
            self._thread.join()
        self._http.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True   # a scrape in progress does not hold up the process's exit
    registry: CollectorRegistry
    not_ready: Callable[[], str | None]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        try:
            try:
                self._get(self.path.split("?", 1)[0])
            except (TimeoutError, RuntimeError, CancelledError) as e:
                # A snapshot the process could not take (it is stopping, or stuck): an answer,
                # not a traceback.
                self._answer(500, f"cannot answer now: {type(e).__name__}: {e}\n".encode())
        except ConnectionError:
            # The scraper hung up before its answer was written (a scrape timeout, a
            # Prometheus reload): nothing to answer, and no traceback in the log.
            self.close_connection = True

    def _get(self, path: str) -> None:
        if path == "/metrics":
            self._answer(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._answer(200, b"ok\n")
        elif path == "/readyz":
            why = self.server.not_ready()
            if why:
                self._answer(503, f"not ready: {why}\n".encode())
            else:
                self._answer(200, b"ready\n")
        else:
            self._answer(404, b"not found: try /metrics, /healthz or /readyz\n")

    def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass   # a line per scrape is noise

    def log_error(self, format: str, *args: object) -> None:
        log.warning("metrics_request_failed", error=format % args)   # e.g. a malformed request
