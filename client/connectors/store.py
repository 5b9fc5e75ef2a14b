"""The store an engine's connector talks to (connectors/vllm.py, connectors/sglang.py): a
KVClient made on first use, with the engine's buffers registered in it, and left alone for
``retry_s`` after the cluster could not be reached, so an engine whose store is down pays one
timeout per ``retry_s``, not one per request, and serves as if the store were empty."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.common.errors import KVPoolError

if TYPE_CHECKING:
    from kvpool.client.kv_client import KVClient
    from prometheus_client import CollectorRegistry


class LazyStore:
    """``log``: the engine's logger (its outages and registration failures are told there);
    ``metrics``: the registry the client counts in (None: not counted)."""

    def __init__(self, master: str, *, replicas: int, transports: Sequence[str] | None,
                 timeout_s: float, retry_s: float, log: logging.Logger,
                 metrics: CollectorRegistry | None = None) -> None:
        self._master, self._replicas, self._transports = master, replicas, transports
        self._timeout_s, self._retry_s, self._log, self._metrics = timeout_s, retry_s, log, metrics
        self._client: KVClient | None = None
        self._buffers: list = []
        self._down_until = 0.0
        self._lock = threading.Lock()

    def register(self, buffer) -> None:
        """Register ``buffer`` (the engine's KV memory) with the client now and with any
        client made later; one that cannot be registered is copied through staging instead."""
        with self._lock:
            self._buffers.append(buffer)
            if self._client is not None:
                self._register(self._client, buffer)

    def connect_soon(self) -> None:
        """Make the client now, on a daemon thread, so the engine's first request does not
        pay for it (TLS handshakes, the cluster map, node connections: seconds on a busy
        host, longer than a decode engine waits for a prefill's blocks). A failure is logged
        and left to the first real use, as any outage is."""
        threading.Thread(target=self.client, name="kvpool-connect", daemon=True).start()

    def client(self) -> KVClient | None:
        """The KVClient, or None while the store counts as unreachable."""
        if time.monotonic() < self._down_until:
            return None
        with self._lock:
            if self._client is None:
                from kvpool.client.kv_client import KVClient
                t0 = time.perf_counter()
                try:
                    client = KVClient(self._master, replicas=self._replicas,
                                      transports=self._transports, timeout_s=self._timeout_s,
                                      metrics=self._metrics)
                except KVPoolError as e:
                    self.failed(e)
                    return None
                for buffer in self._buffers:
                    self._register(client, buffer)
                self._client = client
                self._log.info("kvpool_store_connected master=%s seconds=%.3f", self._master,
                               time.perf_counter() - t0)
            return self._client

    def _register(self, client: KVClient, buffer) -> None:
        try:
            client.register_buffer(buffer)
        except KVPoolError as e:   # still correct, only staged: say so
            self._log.warning("kvpool_register_buffer_failed error=%r (copied through staging)",
                              str(e))

    def failed(self, error: BaseException) -> None:
        """Note that a call failed for want of the cluster; log once per outage."""
        if time.monotonic() >= self._down_until:
            self._log.warning("kvpool_unavailable master=%s retry_in_s=%.0f error=%r",
                              self._master, self._retry_s, str(error))
        self._down_until = time.monotonic() + self._retry_s

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
