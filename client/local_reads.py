"""Single gets served from a same-host node's shm index, and the hits they owe the master.

A single get over shm asked the master where the object is (GetReplicas) and then copied it.
Where this client's shm transport holds a link to a node that keeps an index of its committed
objects (net/shm_index.py), the get looks the stored key up there first and copies with no
master call; anything the index cannot prove (not there, changed during the copy) goes to the
master as before. The stored key is the tenant's (common/tenants.py): the client learns its
tenant from the master's first GetReplicas answer, and reads nothing locally before that.

The master still orders eviction by use and counts hits: the keys read locally are sent to it
in batches (a GetReplicas of them, whose answer is not needed) by one background thread, never
on a get's path, so a get served locally neither waits for the master nor fails with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvpool.common import tenants
from kvpool.common.errors import InvalidArgument, KVPoolError
from kvpool.common.logging import get_logger
from kvpool.common.loops import RESTART, Supervisor

log = get_logger(__name__)

FLUSH_KEYS = 64          # hits sent to the master in one call
FLUSH_AFTER_S = 0.5      # or this long after the first of them
MAX_PENDING = 16_384     # past this, the oldest hits are not sent (counts only, never data)


class LocalReads:
    """Reads through ``transport.read_local`` (shm), and reports each hit to ``master`` (a
    MasterClient: ``locate``) in the background."""

    def __init__(self, transport, master, *, flush_keys: int = FLUSH_KEYS,
                 flush_after_s: float = FLUSH_AFTER_S) -> None:
        self._transport, self._master = transport, master
        self._flush_keys, self._flush_after_s = flush_keys, flush_after_s
        self.tenant: str | None = None   # learned from a GetReplicas answer
        self.served = 0   # gets served from an index
        self._lock = threading.Condition()
        self._pending: list[str] = []
        self._first_at = 0.0
        self._sending = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self, key: str, alloc: Callable[[int], memoryview]) -> int | None:
        """``key``'s value copied into ``alloc(size)``: its size, or None (ask the master)."""
        if self.tenant is None:
            return None
        try:
            size = self._transport.read_local(tenants.scoped(self.tenant, key), alloc)
        except InvalidArgument:   # the caller's buffer: the master's answer says why
            return None
        if size is not None:
            self.served += 1
            self._hit(key)
        return size

    def _hit(self, key: str) -> None:
        with self._lock:
            if not self._pending:
                self._first_at = time.monotonic()
            self._pending.append(key)
            if len(self._pending) > MAX_PENDING:
                del self._pending[:len(self._pending) - MAX_PENDING]
            if self._thread is None:
                self._thread = Supervisor().start_thread("kvpool-local-hits", self._run,
                                                         RESTART, self._stop)
            if len(self._pending) >= self._flush_keys:
                self._lock.notify()

    def flush(self, timeout_s: float = 1.0) -> None:
        """Send the hits not sent yet now, waiting at most ``timeout_s`` (a Stats call reads
        the master's counts after this)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._pending:
                self._first_at = float("-inf")   # due now
                self._lock.notify()
            while (self._pending or self._sending) and self._thread is not None \
                    and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)

    def close(self) -> None:
        """Send what is left (waiting a second at most), then stop."""
        self.flush()
        self._stop.set()
        with self._lock:
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop.is_set() and not self._due():
                    self._lock.wait(self._flush_after_s if self._pending else None)
                if self._stop.is_set():
                    return
                batch, self._pending = self._pending[:self._flush_keys * 4], \
                    self._pending[self._flush_keys * 4:]
                self._first_at = time.monotonic()
                self._sending = True
            try:
                self._master.locate(batch)   # leases, the eviction order, the hit counts
            except KVPoolError as e:
                log.debug("local_hits_not_sent", keys=len(batch), error=str(e))
            finally:
                with self._lock:
                    self._sending = False
                    self._lock.notify_all()

    def _due(self) -> bool:
        return bool(self._pending) and (
            len(self._pending) >= self._flush_keys
            or time.monotonic() - self._first_at >= self._flush_after_s)
