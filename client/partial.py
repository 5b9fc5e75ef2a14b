"""Objects written and read in pieces: an engine's KV block of every layer as one object, stored
layer by layer as the forward pass writes each layer, and loaded layer by layer as it needs them.

    put = PartialPut(kv, keys, sizes)           # PutStart: space reserved, nothing readable
    for layer in layers:
        put.write(offset_of[layer], pieces)     # each key's bytes [offset, offset + n)
    put.commit()                                # PutEnd: readable, with the CRC-32C of it all

    got = PartialGet(kv, keys)                  # GetReplicas once: located and leased
    for layer in layers:
        got.read(offset_of[layer], buffers)     # a ranged read of each object
    got.finish()                                # checksums compared, the lease checked

The two-phase put already separates reserve from commit (DESIGN.md, Put): the master hands
out extents at PutStart and makes nothing readable before PutEnd, so the pieces are written
straight into the reserved extents, in any number of data-path writes, within the master's put
timeout. Byte ranges are for replicas reached through shm (``piecewise``): a node serves tcp
and RDMA only for the whole extent the master granted (a write once), so there the caller
writes and reads each object as one piece. Pieces must be written in order (each offset the end of the last) so the CRC-32C of
the whole object is chained piece by piece, as read does when it verifies. These use the
client's master connection and transports (a ``KVClient``'s internals, this package's own);
the lease, version and checksum rules are ``KVClient``'s, applied to pieces.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

from kvpool.client.buffers import byte_view
from kvpool.client.kv_client import KVClient
from kvpool.client.transport.base import IoOp, Transport
from kvpool.common.checksum import checksum
from kvpool.common.errors import (
    CorruptObject,
    InvalidArgument,
    KVPoolError,
    NodeUnavailable,
    NotPending,
    TransportError,
)
from kvpool.common.types import ObjectView, Replica

# No piece is written this close to the put deadline (the master reclaims PENDING objects).
_DEADLINE_MARGIN_S = 0.5


class PartialPut:
    """A batch of objects reserved now, written piece by piece, committed at the end.

    Per key, ``results[i]`` is None while the key is healthy, else its error (a refused
    PutStart, a failed write); a key that failed is revoked at :meth:`commit` and never
    becomes readable. Not thread-safe: one writer (a connector's save thread) drives it."""

    def __init__(self, kv: KVClient, keys: Sequence[str], sizes: Sequence[int], *,
                 parents: Sequence[str | None] | None = None, replicas: int | None = None):
        kv._check_open()
        self._kv, self.keys, self.sizes = kv, list(keys), list(sizes)
        self._started = time.perf_counter()
        sent = time.monotonic()
        placed, put_timeout_s, _ = kv._master.put_start_grant(
            self.keys, self.sizes, kv._replicas if replicas is None else replicas,
            list(parents) if parents is not None else None)
        self._deadline = sent + put_timeout_s - _DEADLINE_MARGIN_S
        self.results: list[KVPoolError | None] = [
            p if isinstance(p, KVPoolError) else None for p in placed]
        self._replicas: list[tuple[Replica, ...]] = [
            () if isinstance(p, KVPoolError) else p for p in placed]
        self._written = [0] * len(self.keys)   # bytes written so far, from offset 0
        self._crc = [0] * len(self.keys)
        self._done = False
        self.piecewise = _piecewise(kv, self._replicas)

    @property
    def expired(self) -> bool:
        """Whether the put's deadline has passed: no piece is written any more (the master
        reclaims the reservation at its put timeout)."""
        return time.monotonic() > self._deadline

    def write(self, offset: int, pieces: Sequence) -> None:
        """Write ``pieces[i]`` (a buffer; None to skip the key) at ``offset`` of key i's
        object, on every replica. ``offset`` must be where key i's last piece ended."""
        ops: list[tuple[int, Transport | None, IoOp]] = []
        for i, piece in enumerate(pieces):
            if piece is None or self.results[i] is not None:
                continue
            if offset != self._written[i]:
                raise InvalidArgument(f"{self.keys[i]!r}: piece at {offset}, expected at "
                                      f"{self._written[i]} (pieces are written in order)")
            view = byte_view(piece, writable=False)
            if offset + view.nbytes > self.sizes[i]:
                self.results[i] = InvalidArgument(f"{self.keys[i]!r}: piece ends past the "
                                                  f"object's {self.sizes[i]} bytes")
                continue
            self._crc[i] = checksum(view, self._crc[i])
            self._written[i] += view.nbytes
            for r in self._replicas[i]:
                ops.append((i, self._kv._transport_for(r), IoOp(_range(r, offset, view), view)))
        if self.expired:
            for i in {i for i, _, _ in ops}:
                self.results[i] = TransportError(f"{self.keys[i]!r}: put timed out")
            return
        for i, err in _run(ops, write=True, metrics=self._kv._metrics):
            if err is not None and self.results[i] is None:
                self.results[i] = err

    def commit(self) -> list[KVPoolError | None]:
        """PutEnd for every key written in full (with the CRC-32C of all its pieces), PutRevoke
        for the rest; the final per-key results."""
        if self._done:
            return self.results
        self._done = True
        for i, n in enumerate(self._written):
            if self.results[i] is None and n != self.sizes[i]:
                self.results[i] = InvalidArgument(f"{self.keys[i]!r}: {n} of {self.sizes[i]} "
                                                  "bytes written")
        if time.monotonic() > self._deadline + _DEADLINE_MARGIN_S:
            for i, r in enumerate(self.results):
                self.results[i] = r or TransportError(f"{self.keys[i]!r}: put timed out")
        self._end()
        return self.results

    def abort(self) -> None:
        """Revoke every key not yet committed (an engine that gave up on this step's save)."""
        if not self._done:
            self._done = True
            for i, r in enumerate(self.results):
                self.results[i] = r or TransportError(f"{self.keys[i]!r}: put abandoned")
            self._end()

    def _end(self) -> None:
        revoke = [k for k, r, reps in zip(self.keys, self.results, self._replicas)
                  if r is not None and reps]
        if revoke:
            self._kv._master.put_revoke(revoke)
        ok = [i for i, r in enumerate(self.results) if r is None]
        if ok:
            ends = self._kv._master.put_end([self.keys[i] for i in ok],
                                            [self._crc[i] for i in ok])
            for i, err in zip(ok, ends):
                self.results[i] = TransportError(f"{self.keys[i]!r}: put timed out") \
                    if isinstance(err, NotPending) else err
        if self._kv._metrics is not None:
            self._kv._metrics.done("put", self.results, self._started)


class PartialGet:
    """A batch of objects located once (leasing them) and read in byte ranges.

    ``results[i]``: None while key i is readable and every range read so far arrived, else
    its error (ObjectNotFound, NodeUnavailable, CorruptObject...). ``verify``: the ranges
    read, if they cover the object in order from offset 0, are checked against its checksum
    at :meth:`finish`."""

    def __init__(self, kv: KVClient, keys: Sequence[str], *, verify: bool = False):
        kv._check_open()
        self._kv, self.keys, self._verify = kv, list(keys), verify
        self._started = time.perf_counter()
        self._sent = time.monotonic()
        located = kv._master.locate(self.keys) if self.keys else None
        self._lease_ttl_s = located.lease_ttl_s if located is not None else 0.0
        self.objects: list[ObjectView | None] = []
        self.results: list[KVPoolError | None] = []
        for i in range(len(self.keys)):
            view = located.view(i)
            self.objects.append(None if isinstance(view, KVPoolError) else view)
            self.results.append(view if isinstance(view, KVPoolError) else None)
        self._read = [0] * len(self.keys)
        self._crc = [0] * len(self.keys)
        self.piecewise = _piecewise(kv, [o.replicas for o in self.objects if o is not None])

    def size(self, i: int) -> int:
        """Key i's size in bytes (0 if it was not found)."""
        obj = self.objects[i]
        return 0 if obj is None else obj.size

    def read(self, offset: int, buffers: Sequence) -> None:
        """Read ``[offset, offset + len(buffers[i]))`` of key i's object into ``buffers[i]``
        (None: skip the key), each from its first reachable replica, then the next."""
        pending: dict[int, tuple[memoryview, list[tuple[Transport, Replica]]]] = {}
        for i, buf in enumerate(buffers):
            obj = self.objects[i]
            if buf is None or obj is None or self.results[i] is not None:
                continue
            view = byte_view(buf, writable=True)
            if offset + view.nbytes > obj.size:
                self.results[i] = InvalidArgument(f"{self.keys[i]!r}: [{offset}, "
                                                  f"{offset + view.nbytes}) is past its "
                                                  f"{obj.size} bytes")
                continue
            ranges = [(t, _range(r, offset, view)) for r in obj.replicas
                      if (t := self._kv._transport_for(r)) is not None]
            pending[i] = (view, ranges)
            if self._verify and offset == self._read[i]:
                self._read[i] += view.nbytes
            else:
                self._read[i] = -1    # out of order: the checksum cannot be chained
        last: dict[int, KVPoolError] = {}
        while pending:
            ops = []
            for i, (view, ranges) in list(pending.items()):
                if not ranges:
                    self.results[i] = NodeUnavailable(
                        f"{self.keys[i]!r}: no replica could be read: "
                        f"{last.get(i, 'no reachable replica')}")
                    del pending[i]
                    continue
                t, r = ranges.pop(0)
                ops.append((i, t, IoOp(r, view)))
            for i, err in _run(ops, write=False, metrics=self._kv._metrics):
                if err is None:
                    view = pending.pop(i)[0]
                    if self._read[i] >= 0 and self._verify:
                        self._crc[i] = checksum(view, self._crc[i])
                else:
                    last[i] = err

    def finish(self) -> list[KVPoolError | None]:
        """The final per-key results: with ``verify``, a key read in full whose checksum
        differs is CorruptObject (its replica reported to the master); a read that outlived
        its lease is checked against the master, and an object that changed meanwhile is an
        error (the caller reads it again or recomputes)."""
        bad = []
        for i, obj in enumerate(self.objects):
            if self.results[i] is not None or obj is None or not self._verify:
                continue
            if self._read[i] == obj.size and obj.checksum is not None \
                    and self._crc[i] != obj.checksum:
                self.results[i] = CorruptObject(f"{self.keys[i]!r}: the bytes read fail the "
                                                "object's checksum")
                bad.append(i)
        if bad:
            try:
                self._kv._master.report_corrupt(
                    [self.keys[i] for i in bad], [self.objects[i].version for i in bad],
                    [self.objects[i].replicas[0].extent.segment_id for i in bad])
            except KVPoolError:
                pass   # the next reader reports it again; the bytes are refused either way
        ok = [i for i, r in enumerate(self.results) if r is None]
        if ok and time.monotonic() > self._sent + self._lease_ttl_s:
            again = self._kv._master.locate([self.keys[i] for i in ok])
            for j, i in enumerate(ok):
                view = again.view(j)
                if isinstance(view, KVPoolError) or view.version != self.objects[i].version:
                    self.results[i] = TransportError(
                        f"{self.keys[i]!r}: the object changed during the read")
        if self._kv._metrics is not None:
            self._kv._metrics.done("get", self.results, self._started)
        return self.results


def _range(r: Replica, offset: int, view: memoryview) -> Replica:
    """``r`` narrowed to ``view.nbytes`` bytes at ``offset`` of its extent; ``r`` itself for
    the whole extent, which keeps what the master attached to it (its grant)."""
    if offset == 0 and view.nbytes == r.extent.length:
        return r
    return r.at(r.extent.offset + offset, view.nbytes)


def _piecewise(kv: KVClient, replicas: Sequence[Sequence[Replica]]) -> bool:
    """Whether every replica is reached through a mapping of its segment (shm), where any
    byte range is a copy. Store nodes serve tcp (and RDMA) reads and writes of exactly the
    extents the master granted, a write once (common/capabilities.py): there the caller
    moves whole objects (one piece from offset 0)."""
    return all((t := kv._transport_for(r)) is not None and t.scheme == "shm"
               for reps in replicas for r in reps)


def _run(ops: list[tuple[int, Transport | None, IoOp]], *, write: bool, metrics=None
         ) -> list[tuple[int, KVPoolError | None]]:
    """Each op through its transport (grouped, one call per transport): (index, error);
    the bytes moved counted in ``metrics`` (client/metrics.py), if given."""
    groups: dict[Transport | None, list[tuple[int, IoOp]]] = defaultdict(list)
    for i, t, op in ops:
        groups[t].append((i, op))
    out: list[tuple[int, KVPoolError | None]] = []
    for t, group in groups.items():
        if t is None:
            out += [(i, NodeUnavailable(f"no transport reaches node {op.replica.node.node_id}"))
                    for i, op in group]
            continue
        batch = [op for _, op in group]
        try:
            errs = t.write(batch) if write else t.read(batch)
        except KVPoolError as e:
            errs = [e] * len(batch)
        out += [(i, e) for (i, _), e in zip(group, errs)]
        if metrics is not None:
            metrics.moved("put" if write else "get", t.scheme,
                          sum(op.buffer.nbytes for op, e in zip(batch, errs) if e is None))
    return out
