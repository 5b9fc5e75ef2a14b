"""Single gets with no master call, and the hits they owe the master.

A single get asked the master where the object is (GetReplicas), then read it from its node:
two round trips. Two ways skip the first, each proven at the node, never trusted from memory:

- Over shm (:class:`LocalReads`): where this client's shm transport holds a link to a node that
  keeps an index of its committed objects (net/shm_index.py), the get looks the stored key up
  there and copies with no master call. The stored key is the tenant's (common/tenants.py): the
  client learns its tenant from the master's first GetReplicas answer, and reads nothing
  locally before that.
- Over tcp (:class:`HeldReads`): an object this client put, or got before, is read again at the
  place the master named, under a READ_HELD grant the master minted with that answer
  (net/data_port.py): the node serves it only while it still holds that version there. The
  places are kept for at most ``MAX_HELD`` keys, the most recently used.

Anything either cannot prove (not there, changed during the read) goes to the master as
before. The master still orders eviction by use and counts hits: the keys read this way are
sent to it in batches (a GetReplicas of them, whose answer is not needed) by one background
thread (:class:`Hits`), never on a get's path, so such a get neither waits for the master nor
fails with it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvpool.common import capabilities, tenants
from kvpool.common.errors import InvalidArgument, KVPoolError
from kvpool.common.logging import get_logger
from kvpool.common.loops import RESTART, Supervisor
from kvpool.common.types import Replica

log = get_logger(__name__)

FLUSH_KEYS = 64          # hits sent to the master in one call
FLUSH_AFTER_S = 0.5      # or this long after the first of them
MAX_PENDING = 16_384     # past this, the oldest hits are not sent (counts only, never data)
MAX_HELD = 16_384        # places kept for READ_HELD (about 0.4 KiB each)
# A place is dropped this long before its grant expires (clocks may differ by less).
HELD_MARGIN_S = capabilities.READ_GRANT_MIN_S


class Hits:
    """The keys read with no master call, reported to ``master`` (a MasterClient:
    ``locate``) in the background."""

    def __init__(self, master, *, flush_keys: int = FLUSH_KEYS,
                 flush_after_s: float = FLUSH_AFTER_S) -> None:
        self._master = master
        self._flush_keys, self._flush_after_s = flush_keys, flush_after_s
        self._lock = threading.Condition()
        self._pending: list[str] = []
        self._first_at = 0.0
        self._sending = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, key: str) -> None:
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


class LocalReads:
    """Reads through ``transport.read_local`` (shm); each hit goes to ``hits``."""

    def __init__(self, transport, hits: Hits) -> None:
        self._transport, self._hits = transport, hits
        self.tenant: str | None = None   # learned from a GetReplicas answer
        self.served = 0   # gets served from an index

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
            self._hits.add(key)
        return size


class HeldReads:
    """The places of objects this client put or got (with their READ_HELD grants), read
    again through a transport's ``read_held`` (tcp); each hit goes to ``hits``."""

    def __init__(self, hits: Hits, capacity: int = MAX_HELD) -> None:
        self._hits, self._capacity = hits, capacity
        self._lock = threading.Lock()
        self._places: OrderedDict[str, tuple[Replica, int, float]] = OrderedDict()
        self.served = 0   # gets served at a held place
        self.refused = 0  # held places the node no longer held (the master was asked)

    def learn(self, key: str, replica: Replica, grant: bytes, size: int) -> None:
        """``key``'s object, of ``size`` bytes, is at the start of ``replica``'s extent, which
        ``grant`` (READ_HELD, of that extent) reads."""
        if len(grant) != capabilities.GRANT.size or not any(grant):
            return
        until = time.monotonic() + capabilities.HELD_GRANT_S - HELD_MARGIN_S
        with self._lock:
            self._places[key] = (dataclasses.replace(replica, grant=grant), size, until)
            self._places.move_to_end(key)
            if len(self._places) > self._capacity:
                self._places.popitem(last=False)

    def forget(self, key: str, refused: bool = False) -> None:
        """Drop ``key``'s place (``refused``: its node no longer held it there)."""
        with self._lock:
            self._places.pop(key, None)
            self.refused += refused

    def place(self, key: str) -> tuple[Replica, int] | None:
        """Where ``key`` was last seen and its size, while the grant lasts; None: ask the
        master."""
        with self._lock:
            got = self._places.get(key)
            if got is None:
                return None
            if got[2] < time.monotonic():
                del self._places[key]
                return None
            self._places.move_to_end(key)
            return got[0], got[1]

    def served_one(self, key: str) -> None:
        self.served += 1
        self._hits.add(key)

    def __len__(self) -> int:
        return len(self._places)
