"""Slots: space a writer holds ahead of its puts, so that a single put is one round trip.

A put is PutStart (where to write), a RESERVE at the node (the space is this master's to give),
the copy, then SEAL and PutEnd. For a single small value the two round trips before the copy
are most of its time (DESIGN.md, "Where a single put's time goes"). A slot takes them ahead:
this client's helper thread asks the master for a few placeholders of a size class (PutStart
``slots``: PENDING objects under keys of this client's own, each with a version of its own,
that the master tells no node of) and reserves each one at its node. A put that finds a slot
of its size copies into it and then, at once, seals its own key there at the node and asks the
master to commit the slot as that key (PutEnd ``as_keys``): one round trip each, overlapped.
The master frees the slot's unused tail; a slot it cannot commit (the key is stored already)
it releases into quarantine, whose reservation drops the seal at the node.

What a slot keeps of the put's guarantees: the RESERVE was answered under the master's epoch
before any byte is copied (a restarted master keeps the space out of reuse until the slot's
put would have timed out); the node keeps the seal's record until the master's word, so an
acknowledged put survives a master kill as a sealed one does. Over shm the seal is no message
at all: the put fills the cell of the link's seal board that the slot's RESERVE named
(net/seal_board.py), in the node's memory before PutEnd is sent.

Slots serve single puts, and batches of up to ``kv_client.SLOT_BATCH_MAX`` keys (a slot for
each, or none), of values of at most ``SLOT_MAX_BYTES`` through a transport that can reserve
(shm, tcp), with one replica. On tcp the slot's grants name its placeholder and its whole
extent: the node that holds the slot's reservation takes them for a shorter WRITE into it,
and for a SEAL of a key of the placeholder's tenant there. A put that finds no slot goes the
usual way and has some made for the next ones. Slots never used are revoked before their put
timeout (or at ``close``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.client.transport.base import IoOp, Transport
from kvpool.common import tenants
from kvpool.common.errors import KVPoolError
from kvpool.common.logging import get_logger
from kvpool.common.types import Replica
from kvpool.net.data_port import PutRecord
from kvpool.rpc.master_client import MasterClient

log = get_logger(__name__)

#: Values up to this size go through slots.
SLOT_MAX_BYTES = 4 << 20
#: What one size class holds in slots at most: their space counts as puts started.
SLOT_POOL_BYTES = 8 << 20
#: Slots of a class: up to 16, or more while they hold at most SLOT_MANY_BYTES (64 KiB slots:
#: 64, asked for 32 at a time). A batch has a fixed cost (DESIGN.md "Slots"), a slot a small
#: one. Larger classes keep 16: more of them held the DRAM a small cluster needed (32 slots of
#: 256 KiB left test_disk_tier's 4 MiB of DRAM no room for a promotion).
SLOT_MAX_COUNT = 64
SLOT_BASE_COUNT = 16
SLOT_MANY_BYTES = 4 << 20
SLOT_MIN_CLASS = 4096
#: Size classes kept at once (the least recently asked for goes).
MAX_CLASSES = 8
#: A slot is not written into this close to its put timeout (as a put's deadline), and is
#: revoked at twice that.
DEADLINE_MARGIN_S = 0.5
#: After a failed grant, that class is not asked again for this long.
BACKOFF_S = 2.0


def size_class(nbytes: int) -> int:
    """The slot size a value of ``nbytes`` goes in: the next power of two (the master frees
    the unused tail when the slot is filled)."""
    return max(SLOT_MIN_CLASS, 1 << (nbytes - 1).bit_length())


@dataclass(frozen=True, slots=True)
class Slot:
    key: str            # its placeholder, as this client names it
    replica: Replica    # where it lies (the whole slot)
    record: PutRecord   # the stored placeholder, its version, the master's epoch, hold_s
    tenant: str
    deadline: float     # monotonic: nothing is written into it after this
    held: bytes = b""   # its READ_HELD grant (tcp): the object put in it is read again there

    def op(self, buffer: memoryview) -> IoOp:
        """The write of ``buffer`` at the slot's start."""
        e = self.replica.extent
        # The slot's grant (tcp): a node takes it for a shorter write into the slot it
        # reserved (store_node/data_server.py).
        return IoOp(self.replica.at(e.offset, buffer.nbytes, self.replica.grant), buffer)

    def record_of(self, key: str, parent: str | None) -> PutRecord:
        """The record a put of ``key`` seals in this slot (stored keys, this slot's version)."""
        return PutRecord(tenants.scoped(self.tenant, key), self.record.version,
                         self.record.epoch, self.record.hold_s, None,
                         tenants.scoped(self.tenant, parent) if parent else None)


class SlotPool:
    """The slots of one client, by size class, and the helper thread that makes and revokes
    them. Thread-safe."""

    def __init__(self, master: MasterClient, transport_for: Callable[[Replica], Transport | None],
                 replicas: int, held: bool = False) -> None:
        """``held``: ask each slot's READ_HELD grant too (client/local_reads.py HeldReads)."""
        self._master = master
        self._held = held
        self._transport_for = transport_for
        self._replicas = replicas
        self._prefix = f"kvpool.slot.{uuid.uuid4().hex}."
        self._made = 0
        self._free: dict[int, list[Slot]] = {}     # size class -> slots, soonest deadline last
        self._wanted: dict[int, None] = {}          # classes to fill, in order asked
        self._backoff: dict[int, float] = {}        # class -> not asked again before
        self._stale: list[Slot] = []                # to revoke
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.granted = self.used = 0                # counters, for tests and the bench
        # A forked child shares its parent's slots (and has no helper): it takes none.
        self._pid = os.getpid()

    def take(self, nbytes: int) -> Slot | None:
        """A slot for a value of ``nbytes``, or None (more are asked for meanwhile)."""
        got = self.take_many([nbytes])
        return None if got is None else got[0]

    def take_many(self, sizes: list[int]) -> list[Slot] | None:
        """A slot for each value of ``sizes`` (bytes), or None if any has none free (none is
        taken then; more are asked for meanwhile)."""
        if max(sizes) > SLOT_MAX_BYTES or os.getpid() != self._pid:
            return None
        classes = [size_class(n) for n in sizes]
        wants = {size: classes.count(size) for size in classes}
        now = time.monotonic()
        with self._cond:
            if self._closed:
                return None
            for size in wants:
                free = self._free.get(size)
                while free and free[-1].deadline <= now:   # soonest deadline last
                    self._stale.append(free.pop())
            enough = all(len(self._free.get(size, ())) >= k for size, k in wants.items())
            taken = [self._free[size].pop() for size in classes] if enough else None
            for size in wants:
                self._ask_if_low(size, now)
            if taken is not None:
                self.used += len(taken)
            return taken

    def _ask_if_low(self, size: int, now: float) -> None:
        """Under the lock: the helper makes more of class ``size`` once half are used."""
        if len(self._free.get(size, ())) <= self._count(size) // 2 and size not in self._wanted \
                and self._backoff.get(size, 0.0) <= now:
            self._wanted[size] = None
            self._start()
            self._cond.notify()

    def reset(self) -> None:
        """Forget every slot (their master is gone, or refused one): made again on demand."""
        with self._cond:
            for free in self._free.values():
                self._stale.extend(free)
            self._free.clear()
            self._cond.notify()

    def discard(self, slot: Slot) -> None:
        """A slot taken and not filled: revoked by the helper."""
        with self._cond:
            self._stale.append(slot)
            self._cond.notify()

    def close(self) -> None:
        """Stop the helper and revoke the slots left."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)
        with self._cond:
            left = self._stale + [s for free in self._free.values() for s in free]
            self._stale, self._free = [], {}
        self._revoke(left)

    # -- the helper ------------------------------------------------------------------------

    @staticmethod
    def _count(size: int) -> int:
        return max(2, min(SLOT_MAX_COUNT, SLOT_POOL_BYTES // size,
                          max(SLOT_BASE_COUNT, SLOT_MANY_BYTES // size)))

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvpool-slots", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._wanted or self._stale):
                    soonest = min((s.deadline for f in self._free.values() for s in f),
                                  default=None)
                    wait = None if soonest is None else soonest - time.monotonic()
                    if wait is not None and wait <= 0:
                        self._expire(time.monotonic())
                        continue
                    self._cond.wait(wait)
                if self._closed:
                    return
                stale, self._stale = self._stale, []
                size = next(iter(self._wanted), None)
            self._revoke(stale)
            if size is not None:
                try:
                    self._fill(size)
                except Exception as e:   # never let the helper die: puts go the usual way
                    log.warning("slot_grant_failed", size=size, error=str(e))
                    with self._cond:
                        self._backoff[size] = time.monotonic() + BACKOFF_S
                with self._cond:
                    self._wanted.pop(size, None)

    def _expire(self, now: float) -> None:
        """Under the lock: slots past their deadline go to be revoked."""
        for free in self._free.values():
            keep = [s for s in free if s.deadline > now]
            self._stale.extend(s for s in free if s.deadline <= now)
            free[:] = keep

    def _fill(self, size: int) -> None:
        with self._cond:
            n = self._count(size) - len(self._free.get(size, ()))
            base, self._made = self._made, self._made + max(n, 0)
        if n <= 0:
            return
        keys = [f"{self._prefix}{base + i}" for i in range(n)]
        sent = time.monotonic()
        placed, put_timeout_s, grant = self._master.put_start_grant(
            keys, [size] * n, self._replicas, slots=True, held=self._held)
        deadline = sent + put_timeout_s - 2 * DEADLINE_MARGIN_S
        hold_s = max(grant.hold_s - (time.monotonic() - sent), 0.0)
        by_transport: dict[Transport, list[Slot]] = {}
        refused: list[str] = []
        for key, where, version, held in zip(keys, placed, grant.versions,
                                             grant.held or [b""] * n):
            if isinstance(where, KVPoolError):
                continue
            t = self._transport_for(where[0]) if len(where) == 1 else None
            if t is None or not t.slots or not grant.epoch:
                refused.append(key)
                continue
            by_transport.setdefault(t, []).append(Slot(
                key, where[0], PutRecord(tenants.scoped(grant.tenant, key), version,
                                         grant.epoch, hold_s), grant.tenant, deadline, held))
        ready: list[Slot] = []
        for t, slots in by_transport.items():
            errors = t.reserve([IoOp(s.replica, memoryview(b"")) for s in slots],
                               [s.record for s in slots])
            for s, err in zip(slots, errors):
                (refused.append(s.key) if err is not None else ready.append(s))
        self._revoke_keys(refused)
        with self._cond:
            if len(ready) < n:   # some not placed or not reserved: not asked again at once
                self._backoff[size] = time.monotonic() + BACKOFF_S
            if self._closed:
                self._stale.extend(ready)
                return
            self.granted += len(ready)
            # Soonest deadline last: take() pops the end.
            self._free[size] = sorted(ready + self._free.get(size, []),
                                      key=lambda s: -s.deadline)
            while len(self._free) > MAX_CLASSES:   # the oldest class asked for goes
                self._stale.extend(self._free.pop(next(iter(self._free))))

    def _revoke(self, slots: list[Slot]) -> None:
        self._revoke_keys([s.key for s in slots])

    def _revoke_keys(self, keys: list[str]) -> None:
        if keys:
            with contextlib.suppress(KVPoolError, OSError):
                self._master.put_revoke(keys)
