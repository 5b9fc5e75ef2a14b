"""KVClient: put and get KV blocks by key, bytes moved one-sided (shm) or via tcp.

    with KVClient(master="127.0.0.1:50051") as kv:
        kv.put("block-hash", tensor)
        n = kv.get_into("block-hash", out_tensor)
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np
from kvpool.client.buffers import address_of, byte_view, unfilled_bytes, writable_rows
from kvpool.client.local_reads import HeldReads, Hits, LocalReads
from kvpool.client.metrics import client_metrics
from kvpool.client.slots import Slot, SlotPool
from kvpool.client.transport.base import IoOp, Transport
from kvpool.client.transport.registry import TRANSPORT_PREFERENCE, create_transports
from kvpool.common import tenants
from kvpool.common.checksum import checksum
from kvpool.common.errors import (
    AlreadyExists,
    ClientClosed,
    CorruptObject,
    InvalidArgument,
    KVPoolError,
    MasterUnavailable,
    NodeRefused,
    NodeUnavailable,
    NotPending,
    QuotaExceeded,
    TransportError,
)
from kvpool.common.types import MAX_KEY_BYTES, ObjectView, Replica, validate_key
from kvpool.net.data_port import PutRecord
from kvpool.rpc.located import Located, only_replica
from kvpool.rpc.master_client import MasterClient
from kvpool.rpc.master_client import located as _located_columns
from prometheus_client import CollectorRegistry

# A read that outlived its lease is checked against the master; if the object changed under
# it, it is read again, at most this many times.
_MAX_READ_ATTEMPTS = 3
# A node whose read just failed at the transport level (down, partitioned, timing out) is
# tried after the other replicas for this long: one call pays its timeout, not every call
# until the master declares it dead.
_UNREACHABLE_S = 5.0
# Writes are not started this close to the put deadline, so a slow writer never races the
# master's reclaim of the PENDING object.
_PUT_DEADLINE_MARGIN_S = 0.5
# Puts of at most this many keys are fenced and sealed at their nodes (the master answers
# without waiting for them); larger batches take the master's waits, paid once per call, since
# a seal costs each key a round trip to its node (shm) or the node's own check (tcp).
# Measured (64 KiB values, one node): sealed / waiting 0.75-0.87 up to 4 keys on shm and tcp,
# 1.1-1.3 at 8-16 keys, 1.9 at 64 on shm. (Off for a session: a fresh-container run lost
# "acknowledged" puts in test_master_restart; they had been evicted, the faster puts having
# filled that test's cluster past its watermark. The test now writes within a budget.)
SEAL_MAX_KEYS = 4
# Puts of at most this many keys (each value of at most 4 MiB) go into slots when the client
# holds one free for each (client/slots.py): copies, seals, one PutEnd.
SLOT_BATCH_MAX = 8
# A single put of at least this many bytes asks the master to keep polling while it copies
# (MasterClient.spin): the copy outlasts the master's own polling after its last answer
# ($KVPOOL_SPIN_US, 200 us), and its PutEnd would meet a core gone to sleep (~0.1 ms to wake
# here: a 1 MiB put over shm 0.48 -> 0.35 ms when the master polled 1 ms after each answer).
SPIN_MIN_BYTES = 512 << 10
SPIN_BASE_S = 100e-6
# A copy's speed over shm. Not over tcp: the master polling through a 1 MiB WRITE took the
# node's CPU (master 370 -> 670-830 us a put): PutEnd 0.33 -> 0.20 ms, the put no faster.
# Through a 64 KiB WRITE (250 us + 1 us/KiB): faster alone (scripts/put_phases.py, three
# alternated pairs, 0.36-0.44 -> 0.36-0.38 ms) but slower in `kvpool bench --peers mooncake`,
# Mooncake's servers beside it on the two cores: against Mooncake's tcp put 1.15-1.32
# (median 1.19) -> 1.24-1.46 (median 1.34), seven alternated pairs.
SPIN_BYTES_PER_S = 4e9
@dataclass(frozen=True, slots=True)
class _Unsure:
    """A slot filled and sealed whose commit the master never answered: the put goes the
    usual way, and an AlreadyExists there is this put's own if the key is stored at the
    slot's version and size."""

    version: int
    size: int


# Keys of at most this many characters are valid whatever they hold (4 bytes a character).
_SHORT_KEY_CHARS = MAX_KEY_BYTES // 4


class KVClient:
    """A thread-safe client of one kvpool cluster. Use as a context manager, or call close()."""

    def __init__(self, master: str, *, replicas: int = 0,
                 transports: Sequence[str | Transport] | None = None, timeout_s: float = 10.0,
                 metrics: CollectorRegistry | None = None, credentials: str | None = None,
                 put_slots: bool = True, local_reads: bool = True):
        """``replicas``: copies per put (0 = the master's default). ``transports``: schemes
        (or Transport instances) to use; whatever the order given, the client prefers shm,
        then rdma, then tcp per replica (default: every transport available here).
        ``metrics``: a Prometheus registry (e.g. ``prometheus_client.REGISTRY``) to count
        this client's keys, bytes and call times in (client/metrics.py); None: not counted.
        ``credentials``: a credentials file (SECURITY.md); by default ``KVPOOL_CREDENTIALS``,
        else those a local cluster of this user registered for ``master``, else none.
        ``put_slots``: single puts of up to 4 MiB over shm fill space reserved ahead
        (client/slots.py: one round trip a put; a few slots of each size held as puts
        started); False: every put asks the master first. ``local_reads``: a single get
        with no master call where the node can prove the bytes (client/local_reads.py: a
        same-host node's shm index; over tcp, a key this client put or got before, at its
        place); False: every get asks the master."""
        self._metrics = None if metrics is None else client_metrics(metrics)
        self._master = MasterClient(master, timeout_s=timeout_s, credentials=credentials)
        given = [t for t in transports or () if isinstance(t, Transport)]
        try:
            schemes = None if transports is None else [t for t in transports if isinstance(t, str)]
            # Nodes may serve their tcp data port over TLS (store-node --data-tls).
            creds = self._master.credentials
            tls = {"tcp": {"tls": creds}} \
                if creds is not None and (schemes is None or "tcp" in schemes) else None
            made = create_transports(schemes, options=tls) if schemes or not given else []
        except BaseException:
            self._master.close()
            raise
        self._transports: list[Transport] = sorted(
            given + made, key=lambda t: TRANSPORT_PREFERENCE.index(t.scheme))
        self._rank = {t: TRANSPORT_PREFERENCE.index(t.scheme) for t in self._transports}
        # Every transport hands its nodes the put itself (RESERVE, SEAL): the master then
        # answers PutStart and PutEnd without waiting for the nodes (DESIGN.md, Put).
        self._fenced = all(t.seals for t in self._transports)
        # Single gets with no master call (client/local_reads.py): from a same-host node's
        # shm index, or at a place this client put or got before, over tcp (READ_HELD).
        shm = [t for t in self._transports if t.scheme == "shm"]
        self._hits = Hits(self._master) if local_reads else None
        self._local = LocalReads(shm[0], self._hits) if local_reads and shm else None
        self._held = HeldReads(self._hits) \
            if local_reads and any(t.reads_held for t in self._transports) else None
        # Single small puts fill slots reserved ahead (client/slots.py): one round trip.
        self._slots = SlotPool(self._master, self._transport_for, replicas,
                               held=self._held is not None) \
            if put_slots and self._fenced and any(t.slots for t in self._transports) else None
        self._unreachable: dict[str, float] = {}   # node id -> until when it is tried last
        self._replicas = replicas
        self._closed = False
        self._lock = threading.Lock()

    @property
    def master_address(self) -> str:
        """The master's ``host:port``."""
        return self._master.address

    # -- lifecycle --
    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release connections and mappings. Idempotent; any later call raises ClientClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._slots is not None:
            self._slots.close()
        if self._hits is not None:
            self._hits.close()
        for t in self._transports:
            t.close()
        self._master.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("KVClient is closed")

    # -- single-key API: raises the per-key error --
    def put(self, key: str, value, *, replicas: int | None = None,
            parent: str | None = None, pin: bool | float = False) -> None:
        """Store ``value`` under ``key``. Raises AlreadyExists if the key is stored: keys are
        immutable. Values: bytes, bytearray, memoryview, numpy array, contiguous CPU tensor.
        ``parent``: the key of the block this one extends (a KV prefix chain), so eviction
        takes the chain from its tail; None for none. ``pin``: True for a hard pin, a number
        of seconds for a soft pin (see :meth:`pin`), once stored."""
        _raise(self.batch_put([key], [value], replicas=replicas,
                              parents=None if parent is None else [parent])[0])
        if pin is not False:
            _raise(self.batch_pin([key], ttl_s=None if pin is True else float(pin))[0])

    def pin(self, key: str, ttl_s: float | None = None) -> None:
        """Pin ``key``: ``ttl_s=None`` is a hard pin (never evicted nor demoted until
        :meth:`unpin`; all hard pins share a quota: NoSpace past it), ``ttl_s`` seconds a soft
        pin (evicted only after every unpinned object; pinning again extends it)."""
        _raise(self.batch_pin([key], ttl_s=ttl_s)[0])

    def unpin(self, key: str) -> None:
        """Drop ``key``'s hard and soft pins."""
        _raise(self.batch_unpin([key])[0])

    def get(self, key: str, *, verify: bool = False) -> bytes:
        """The value stored under ``key``; ObjectNotFound if there is none. ``verify``: check
        the bytes against the checksum taken at put; a replica that fails is reported (its
        node re-checks it and drops it if damaged) and the next one read; CorruptObject when
        none is intact."""
        return _raise(self.batch_get([key], verify=verify)[0])

    def get_into(self, key: str, buffer, *, verify: bool = False) -> int:
        """Read ``key``'s value into ``buffer`` (bytearray, numpy array, CPU tensor, writable
        memoryview) without intermediate copies; return the number of bytes written.
        ``verify``: as for :meth:`get` (after CorruptObject the buffer holds damaged bytes)."""
        return _raise(self.batch_get_into([key], [buffer], verify=verify)[0])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def remove(self, key: str) -> None:
        """Remove ``key``; ObjectNotFound if it is not stored. Readers holding a lease finish."""
        _raise(self.batch_remove([key])[0])

    # -- batch API: one result per key, errors as values --
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        for k in keys:
            validate_key(k)
        return self._master.exists(list(keys)) if keys else []

    def batch_pin(self, keys: Sequence[str], ttl_s: float | None = None
                  ) -> list[KVPoolError | None]:
        """:meth:`pin` for each key; per key None or the error."""
        self._check_open()
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidArgument(f"ttl_s must be > 0 (None: a hard pin), not {ttl_s!r}")
        results, valid = _validate_keys(keys)
        if valid:
            for i, err in zip(valid, self._master.pin([keys[i] for i in valid], ttl_s)):
                results[i] = err
        return results

    def batch_unpin(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        self._check_open()
        results, valid = _validate_keys(keys)
        if valid:
            for i, err in zip(valid, self._master.unpin([keys[i] for i in valid])):
                results[i] = err
        return results

    def batch_remove(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        self._check_open()
        results, valid = _validate_keys(keys)
        if self._held is not None:
            for i in valid:
                self._held.forget(keys[i])
        if valid:
            for i, err in zip(valid, self._master.remove([keys[i] for i in valid])):
                results[i] = err
        return results

    def batch_put(self, keys: Sequence[str], values: Sequence, *, replicas: int | None = None,
                  parents: Sequence[str | None] | None = None) -> list[KVPoolError | None]:
        """Store each value under its key; per key None (stored) or the error (AlreadyExists,
        NoSpace, InvalidArgument, NodeUnavailable, ...). Keys that fail are never half-stored.
        ``parents``: parallel to ``keys``, the key each block extends (None: none); a parent
        may be earlier in the same batch."""
        if self._metrics is None:
            return self._put(keys, values, replicas, parents)
        started = time.perf_counter()
        results = self._put(keys, values, replicas, parents)
        self._metrics.done("put", results, started)
        return results

    def _put(self, keys: Sequence[str], values: Sequence, replicas: int | None,
             parents: Sequence[str | None] | None, *, slots: bool = True
             ) -> list[KVPoolError | None]:
        self._check_open()
        if len(keys) != len(values):
            raise InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        if parents is not None and len(parents) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(parents)} parents")
        results, valid = _validate_keys(keys)
        views: dict[int, memoryview] = {}
        for i in valid:
            try:
                view = byte_view(values[i], writable=False)
            except InvalidArgument as e:
                results[i] = e
                continue
            if view.nbytes == 0:
                results[i] = InvalidArgument(f"{keys[i]!r}: empty value; kvpool stores no "
                                             "0-byte objects")
            else:
                views[i] = view
        if not views:
            return results
        idx = list(views)
        if len(idx) == 1 and slots and self._slots is not None \
                and replicas in (None, self._replicas):
            i = idx[0]
            slot = self._slots.take(views[i].nbytes)
            if slot is not None:
                result = self._put_in_slot(keys[i], views[i], parents[i] if parents else None,
                                           slot)
                results[i] = self._put_after_unsure(keys[i], views[i], parents, replicas,
                                                    result) \
                    if isinstance(result, _Unsure) else result   # our seal may be indexed
                return results
        if 1 < len(idx) <= SLOT_BATCH_MAX and slots and self._slots is not None \
                and replicas in (None, self._replicas) and len({keys[i] for i in idx}) == len(idx):
            taken = self._slots.take_many([views[i].nbytes for i in idx])
            out = None if taken is None else self._put_in_slots(keys, idx, views, parents, taken)
            if out is not None:
                for i, result in zip(idx, out):
                    results[i] = self._put_after_unsure(
                        keys[i], views[i], [parents[i]] if parents else None, replicas, result) \
                        if isinstance(result, _Unsure) else result
                return results
        fenced = self._fenced and len(idx) <= SEAL_MAX_KEYS
        sent = time.monotonic()
        placed, put_timeout_s, grant = self._master.put_start_grant(
            [keys[i] for i in idx], [views[i].nbytes for i in idx],
            self._replicas if replicas is None else replicas,
            [parents[i] for i in idx] if parents is not None else None, fenced=fenced,
            held=self._held is not None and len(idx) == 1)
        records = None
        if fenced and grant.epoch:
            hold_s = grant.hold_s - (time.monotonic() - sent)
            # The nodes keep stored keys: the master's, in the tenant's namespace.
            stored = functools.partial(tenants.scoped, grant.tenant)
            records = {i: PutRecord(stored(keys[i]), version, grant.epoch, max(hold_s, 0.0),
                                    None, stored(parents[i]) if parents is not None
                                    and parents[i] else None)
                       for i, version in zip(idx, grant.versions)}
        deadline = sent + put_timeout_s - _PUT_DEADLINE_MARGIN_S
        if records is not None and len(idx) == 1 and not isinstance(placed[0], KVPoolError) \
                and len(placed[0]) == 1:
            i = idx[0]
            results[i] = self._put_one_sealed(keys[i], IoOp(placed[0][0], views[i]),
                                              records[i], deadline, grant.held[0])
            return results
        written, sums = self._write_placed(keys, idx, views, placed, results, deadline,
                                           records)
        failed = [keys[i] for i in written if results[i] is not None]
        if failed:
            self._master.put_revoke(failed)
        # In request order: a parent committed before its children is linked to them.
        ok = sorted(i for i in written if results[i] is None)
        if ok:
            for i, err in zip(ok, self._master.put_end([keys[i] for i in ok],
                                                        [sums[i] for i in ok],
                                                        sealed=records is not None)):
                results[i] = TransportError(f"{keys[i]!r}: put timed out") \
                    if isinstance(err, NotPending) else err
        return results

    def _put_one_sealed(self, key: str, op: IoOp, record: PutRecord, deadline: float,
                        held: bytes = b"") -> KVPoolError | None:
        """A single put of one replica, sealed: PutEnd is sent as soon as the bytes are
        written, while the node checks the seal (shm overlaps the two round trips). The put
        is done only when both hold: a commit whose seal the node refused is removed again,
        and reported as the seal's error."""
        t = self._transport_for(op.replica)
        if t is None:
            self._master.put_revoke([key])
            return NodeUnavailable(f"no transport reaches node {op.replica.node.node_id}")
        if time.monotonic() > deadline:
            self._master.put_revoke([key])
            return TransportError(f"{key!r}: put timed out before writing")
        late = TransportError(f"{key!r}: writing took longer than the put timeout")
        ended: list[KVPoolError | None] = []   # PutEnd's answer, once it was asked

        def commit(crc: int) -> None:
            if time.monotonic() <= deadline:   # else the master may be reclaiming it
                [err] = self._master.put_end([key], [crc], sealed=True)
                ended.append(TransportError(f"{key!r}: put timed out")
                             if isinstance(err, NotPending) else err)

        error, _, wrote = t.write_sealed_then(op, record, commit)
        if not ended:   # not committed: the reservation or the copy failed, or was too late
            self._master.put_revoke([key])
            return (error or late) if wrote else error   # wrote, not committed: too late
        if ended[0] is not None:
            return ended[0]
        if error is not None:   # committed, but the node did not take the record
            with contextlib.suppress(KVPoolError):
                self._master.remove([key])
            return error
        self._put_held(t, key, op.replica, held, op.buffer.nbytes)
        if self._metrics is not None:
            self._metrics.moved("put", t.scheme, op.buffer.nbytes)
        return None

    def _put_held(self, t: Transport, key: str, replica, grant: bytes, size: int) -> None:
        """A single put done: where ``t`` reads held places (tcp), ``key`` is read there next
        (client/local_reads.py HeldReads), under ``grant`` (PutStart's READ_HELD grant)."""
        if self._held is not None and t.reads_held:
            self._held.learn(key, replica, grant, size)

    def _put_in_slot(self, key: str, view: memoryview, parent: str | None, slot: Slot):
        """A single put into a slot (client/slots.py): the copy, then the SEAL at the node and
        the master's commit of the slot as ``key``, overlapped. Its error, None, or
        ``_Unsure``: the slot could not be filled (no transport reaches it, its master is gone
        or did not answer, the slot expired, the node refused the seal); the put goes the
        usual way, and our seal may be what a master indexes meanwhile (a restarted one
        indexes what nodes announce)."""
        op = slot.op(view)
        t = self._transport_for(op.replica)
        unsure = _Unsure(slot.record.version, view.nbytes)
        if t is None or not t.slots:
            self._slots.discard(slot)
            return unsure
        ended: list[KVPoolError | None] = []

        def commit(crc: int) -> None:
            if time.monotonic() <= slot.deadline:   # else the master may be reclaiming it
                ended.extend(self._master.put_end(
                    [slot.key], [crc], sealed=True, as_keys=[key], sizes=[view.nbytes],
                    parents=[parent] if parent else None))

        if view.nbytes >= SPIN_MIN_BYTES and t.scheme == "shm":
            # the copy outlasts the master's own polling
            self._master.spin(SPIN_BASE_S + view.nbytes / SPIN_BYTES_PER_S)
        try:
            error, _, _ = t.write_sealed_then(op, slot.record_of(key, parent), commit,
                                              reserved=True)
        except MasterUnavailable:
            self._slots.reset()
            return unsure
        if not ended:   # not committed: the copy failed, or came too late
            self._slots.discard(slot)
            return unsure
        if isinstance(ended[0], (AlreadyExists, InvalidArgument, QuotaExceeded)):
            return ended[0]   # the key's own answer (the master released the slot)
        if ended[0] is not None:   # the slot was reclaimed, or its master is gone
            self._slots.reset()
            return unsure
        if error is not None:   # committed, but the node did not take the record
            with contextlib.suppress(KVPoolError):
                self._master.remove([key])
            self._slots.reset()
            return unsure
        self._put_held(t, key, slot.replica, slot.held, view.nbytes)
        if self._metrics is not None:
            self._metrics.moved("put", t.scheme, view.nbytes)
        return None

    def _put_in_slots(self, keys: Sequence[str], idx: list[int], views: dict[int, memoryview],
                      parents: Sequence[str | None] | None, taken: list[Slot]) -> list | None:
        """The values at ``idx`` put into the slots ``taken`` (one each), as
        :meth:`_put_in_slot` puts one: the copies and their seals (over shm in the slots'
        seal board cells: no round trip; over tcp WRITE and SEAL pipelined, one round trip),
        then one PutEnd committing every slot sealed as its key. Each one's error, None, or
        ``_Unsure``; None if no one transport reaches every slot (none was written)."""
        ops = [slot.op(views[i]) for i, slot in zip(idx, taken)]
        t = self._transport_for(ops[0].replica)
        if t is None or not t.slots or any(self._transport_for(op.replica) is not t
                                           for op in ops[1:]):
            for slot in taken:
                self._slots.discard(slot)
            return None
        parent = [parents[i] if parents else None for i in idx]
        errors, sums = t.write_sealed(ops, [slot.record_of(keys[i], p) for i, slot, p in
                                            zip(idx, taken, parent)], reserved=True)
        out: list = [_Unsure(slot.record.version, views[i].nbytes) for i, slot in zip(idx, taken)]
        now = time.monotonic()   # past a slot's deadline the master may be reclaiming it
        ready = [k for k, e in enumerate(errors) if e is None and now <= taken[k].deadline]
        for k in sorted(set(range(len(taken))) - set(ready)):
            self._slots.discard(taken[k])   # not committed: revoked (its seal dropped)
        if not ready:
            return out
        try:
            ended = self._master.put_end(
                [taken[k].key for k in ready], [sums[k] for k in ready], sealed=True,
                as_keys=[keys[idx[k]] for k in ready], sizes=[ops[k].buffer.nbytes for k in ready],
                parents=[parent[k] for k in ready])
        except MasterUnavailable:
            self._slots.reset()
            return out
        for k, error in zip(ready, ended):
            if isinstance(error, (AlreadyExists, InvalidArgument, QuotaExceeded)):
                out[k] = error   # the key's own answer (the master released the slot)
            elif error is not None:   # the slot was reclaimed, or its master is gone
                self._slots.reset()
            else:
                out[k] = None
                self._put_held(t, keys[idx[k]], taken[k].replica, taken[k].held,
                               ops[k].buffer.nbytes)
                if self._metrics is not None:
                    self._metrics.moved("put", t.scheme, ops[k].buffer.nbytes)
        return out

    def _put_after_unsure(self, key: str, view: memoryview, parents, replicas: int | None,
                          unsure: _Unsure) -> KVPoolError | None:
        """The usual put of ``key`` after its slot could not be filled: if it finds the key
        stored at the slot's version and size, the slot's seal was indexed, and the put is
        done."""
        [result] = self._put([key], [view], replicas, parents, slots=False)
        if isinstance(result, AlreadyExists):
            with contextlib.suppress(KVPoolError):
                [found] = self._master.locate([key]).views()
                if not isinstance(found, KVPoolError) and \
                        (found.version, found.size) == (unsure.version, unsure.size):
                    return None
        return result

    def _write_placed(self, keys: Sequence[str], idx: list[int], views: dict[int, memoryview],
                      placed: list, results: list, deadline: float,
                      records: dict[int, PutRecord] | None = None
                      ) -> tuple[set[int], dict[int, int]]:
        """Write each placed value (``placed`` parallel to ``idx``) to its replicas, unless
        ``deadline`` (monotonic) passes first; errors go to ``results``. Returns the positions
        written to (successfully or not) and the CRC-32C of each value written, taken from the
        caller's bytes as they leave (``Transport.write_summed``), so that damage anywhere
        after is caught on read. ``records``: each position's put record, when the writes
        are fenced and sealed at the nodes (``Transport.write_sealed``)."""
        ops: list[tuple[int, Transport | None, IoOp]] = []
        for i, where in zip(idx, placed):
            if isinstance(where, KVPoolError):
                results[i] = where
                continue
            for replica in where:
                ops.append((i, self._transport_for(replica), IoOp(replica, views[i])))
        written = {i for i, _, _ in ops}
        if time.monotonic() > deadline:
            for i in written:
                results[i] = TransportError(f"{keys[i]!r}: put timed out before writing")
            return written, {}
        done, sums = self._run(ops, write=True, records=records)
        for i, err in done:
            if results[i] is None:
                results[i] = err
        if time.monotonic() > deadline:
            for i in written:
                results[i] = results[i] or TransportError(
                    f"{keys[i]!r}: writing took longer than the put timeout")
        return written, sums

    def batch_get(self, keys: Sequence[str], *, verify: bool = False
                  ) -> list[bytes | KVPoolError]:
        """Each key's value as a new bytes object, read into it in place (as batch_get_into
        reads into a buffer of yours); ``verify`` as for :meth:`get`."""
        bufs: dict[int, bytes] = {}

        def alloc(i: int, size: int) -> memoryview:
            bufs[i], view = unfilled_bytes(size)
            return view

        got = self._get(keys, alloc, verify=verify)
        return [r if isinstance(r, KVPoolError) else bufs[i] for i, r in enumerate(got)]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence, *, verify: bool = False
                       ) -> list[int | KVPoolError]:
        """Read each key into its buffer; per key the byte count or the error (ObjectNotFound,
        InvalidArgument for a buffer too small, NodeUnavailable when no replica answers,
        CorruptObject when ``verify`` finds no intact replica)."""
        if len(keys) != len(buffers):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")

        def into(i: int, size: int) -> memoryview:   # asked once per key found
            v = byte_view(buffers[i], writable=True)
            if size == v.nbytes:
                return v
            if size > v.nbytes:
                raise InvalidArgument(f"{keys[i]!r}: buffer of {v.nbytes} bytes is smaller "
                                      f"than the value ({size} bytes)")
            return v[:size]

        return self._get(keys, into, writable_rows(buffers), verify=verify)

    def _get(self, keys: Sequence[str], buffer_for: Callable[[int, int], memoryview],
             rows: tuple[int, int] | None = None, *, verify: bool = False
             ) -> list[int | KVPoolError]:
        if self._metrics is None:
            return self._locate_and_read(keys, buffer_for, rows, verify=verify)
        started = time.perf_counter()
        results = self._locate_and_read(keys, buffer_for, rows, verify=verify)
        self._metrics.done("get", results, started)
        return results

    def _locate_and_read(self, keys: Sequence[str],
                         buffer_for: Callable[[int, int], memoryview],
                         rows: tuple[int, int] | None = None, *, verify: bool = False
                         ) -> list[int | KVPoolError]:
        """Locate and read each key; a read that outlived its lease is checked against the
        master, and read again if the object changed under it. ``verify``: each key's bytes
        are checked against its checksum, replica after replica (see :meth:`_read`); a
        matching checksum also proves the bytes are the object's own, so such a read needs
        no version check (a key put without a checksum still gets it). ``rows``: the buffers
        are the rows of one array, ``(address of row 0, bytes per row)``."""
        self._check_open()
        out, todo = _validate_keys(keys)
        bufs: dict[int, memoryview] = {}
        seen: dict[int, tuple[int, int]] = {}   # key index -> version and size of what was read
        for attempt in range(_MAX_READ_ATTEMPTS):
            if not todo:
                return out
            sent = time.monotonic()
            if attempt or verify or len(todo) > 1:
                located = self._master.locate([keys[i] for i in todo])
                fast = [] if attempt or verify else \
                    self._read_fast(todo, located, buffer_for, bufs, rows)
            else:   # a single get: its one replica read without the columns' arrays
                if self._local is not None:
                    if (size := self._read_local(todo[0], keys, buffer_for, bufs)) is not None:
                        out[todo[0]] = size
                        return out
                if self._held is not None:
                    if (size := self._read_held(todo[0], keys, buffer_for, bufs)) is not None:
                        out[todo[0]] = size
                        return out
                answer = self._master.locate_answer([keys[todo[0]]],
                                                    held=self._held is not None)
                if self._local is not None:
                    self._local.tenant = answer.tenant
                size = self._read_one(todo[0], answer, buffer_for, bufs, keys[todo[0]])
                if size is not None and time.monotonic() <= sent + answer.lease_ttl_s:
                    out[todo[0]] = size
                    return out
                located = _located_columns([keys[todo[0]]], answer)
                fast = [] if size is None else [0]
            if len(fast) == len(todo) and time.monotonic() <= sent + located.lease_ttl_s:
                # The common case: every key read in place, within its lease.
                for i, size in zip(todo, located.sizes.tolist()):
                    out[i] = size
                return out
            versions, sizes = located.versions.tolist(), located.sizes.tolist()
            read: dict[int, KVPoolError | None] = {}   # key index -> how its read went
            for j in fast:
                seen[todo[j]], read[todo[j]] = (versions[j], sizes[j]), None
            reads = []
            for j, i in enumerate(todo):
                if i in read:
                    continue
                obj, before = located.view(j), seen.get(i)
                if isinstance(obj, KVPoolError):
                    out[i] = obj
                elif before is not None and before[0] == obj.version:
                    out[i] = obj.size   # still the object we read: the bytes are its own
                elif before is not None and before[1] != obj.size:
                    out[i] = TransportError(f"{keys[i]!r}: the object changed during the read")
                else:
                    try:
                        bufs[i] = bufs[i] if i in bufs else buffer_for(i, obj.size)
                    except InvalidArgument as e:
                        out[i] = e
                        continue
                    seen[i] = obj.version, obj.size
                    reads.append((i, obj, bufs[i]))
            read.update(self._read(reads, verify))
            lease_over = time.monotonic() > sent + located.lease_ttl_s
            summed = {i for i, obj, _ in reads if verify and obj.checksum is not None}
            todo = []
            for i, err in read.items():
                if err is None and lease_over and i not in summed:
                    todo.append(i)      # verify the version before trusting these bytes
                else:
                    out[i] = seen[i][1] if err is None else err
        for i in todo:
            out[i] = TransportError(f"{keys[i]!r}: the object kept changing during the read")
        return out

    def _read_local(self, i: int, keys: Sequence[str],
                    buffer_for: Callable[[int, int], memoryview], bufs: dict[int, memoryview]
                    ) -> int | None:
        """Key ``i`` read from a same-host node's shm index (client/local_reads.py): its
        size, or None (the master is asked)."""
        def alloc(size: int) -> memoryview:
            bufs[i] = buffer_for(i, size)
            return bufs[i]

        size = self._local.read(keys[i], alloc)
        if size is None:
            bufs.pop(i, None)   # sized for what the index said: the master's may differ
        elif self._metrics is not None:
            self._metrics.moved("get", "shm", size)
        return size

    def _read_held(self, i: int, keys: Sequence[str],
                   buffer_for: Callable[[int, int], memoryview], bufs: dict[int, memoryview]
                   ) -> int | None:
        """Key ``i`` read at the place this client last put or got it, if the node still
        holds it there (client/local_reads.py): its size, or None (the master is asked)."""
        place = self._held.place(keys[i])
        t = None if place is None else self._transport_for(place[0])
        if t is None or not t.reads_held:
            return None
        replica, size = place
        try:
            bufs[i] = buffer_for(i, size)
        except InvalidArgument:
            return None
        if not t.read_held(replica, bufs[i]):
            self._held.forget(keys[i], refused=True)
            bufs.pop(i, None)   # sized for the place held: the master's answer may differ
            return None
        self._held.served_one(keys[i])
        if self._metrics is not None:
            self._metrics.moved("get", t.scheme, size)
        return size

    def _read_one(self, i: int, answer, buffer_for: Callable[[int, int], memoryview],
                  bufs: dict[int, memoryview], key: str = "") -> int | None:
        """Key ``i``'s read when ``answer`` (GetReplicas of that key alone) found it with one
        replica on a node a transport reaches and not just failed: its size once read, else
        None (the generic path finds the error, or falls back). ``key``: kept at its place
        for READ_HELD where the answer carries a grant for it."""
        replica = only_replica(answer)
        if replica is None:
            return None
        t = self._transport_for(replica)
        node_id = replica.node.node_id
        if t is None or (self._unreachable and self._unreachable.get(node_id, 0.0)
                         > time.monotonic()):
            return None
        size = replica.extent.length
        try:
            bufs[i] = buffer_for(i, size)
        except InvalidArgument:
            return None
        error = t.read([IoOp(replica, bufs[i])])[0]
        if error is not None:
            self._read_failed(node_id, error)
            return None
        if self._held is not None and t.reads_held and answer.held_grants:
            self._held.learn(key, replica, answer.held_grants, size)
        if self._metrics is not None:
            self._metrics.moved("get", t.scheme, size)
        return size

    def _read_fast(self, todo: list[int], located: Located,
                   buffer_for: Callable[[int, int], memoryview], bufs: dict[int, memoryview],
                   rows: tuple[int, int] | None) -> list[int]:
        """The common case of a large read, without an object per key: keys with one replica
        are read with one ``read_at`` per transport (shm: in place, a memcpy per run).
        Returns the positions in ``todo`` read; every other key (not found, several
        replicas, a bad buffer, a failed read, on a node that just failed) takes the
        generic path, which finds its error or falls back replica by replica. ``rows`` (see
        ``_get``): each key's buffer address is computed, not asked for."""
        where = located.single_location()
        segments, now = located.replicas.locations, time.monotonic()
        readers: dict[Transport, list[int]] = defaultdict(list)   # the locations each reads
        for loc in np.flatnonzero(np.bincount(where[where >= 0])).tolist():
            t = self._transport_for(segments[loc])
            if t is not None and self._unreachable.get(segments[loc].node.node_id, 0.0) <= now:
                readers[t].append(loc)
        done: list[int] = []
        for t, locs in readers.items():
            chosen = np.zeros(len(segments) + 1, dtype=bool)   # by location; [-1]: none
            chosen[locs] = True
            positions = np.flatnonzero(chosen[where])
            if rows is not None:   # a value longer than a row: the generic path refuses it
                positions = positions[located.sizes[positions] <= rows[1]]
                addresses = np.uint64(rows[0]) + np.asarray(todo, dtype=np.uint64)[
                    positions] * np.uint64(rows[1])
            else:
                views, ready = [], []
                for j, size in zip(positions.tolist(), located.sizes[positions].tolist()):
                    try:
                        bufs[todo[j]] = buffer_for(todo[j], size)
                    except InvalidArgument:
                        continue
                    views.append(bufs[todo[j]])
                    ready.append(j)
                positions = np.array(ready, dtype=np.int64)
                addresses = np.fromiter(map(address_of, views), np.uint64, len(views))
            first = located.replicas.first[positions]
            grants = located.replicas.grants
            failed = t.read_at(segments, where[positions], located.replicas.offsets[first],
                               located.sizes[positions], addresses,
                               [grants[j] for j in first.tolist()] if grants else ())
            for k, error in failed.items():
                self._read_failed(segments[int(where[positions[k]])].node.node_id, error)
            read = np.delete(positions, list(failed)) if failed else positions
            if self._metrics is not None:
                self._metrics.moved("get", t.scheme, int(located.sizes[read].sum()))
            done += read.tolist()
        return done

    def stats(self):
        """The master's cluster statistics (protobuf StatsResponse)."""
        self._check_open()
        if self._hits is not None:   # the hits read with no master call are counted first
            self._hits.flush()
        return self._master.stats()

    def register_buffer(self, buffer) -> None:
        """Register ``buffer`` (bytearray, numpy array, CPU tensor) with the transports that
        can use it in place (rdma: a memory region), so that put / get_into / batch_get_into
        on it or on slices of it move bytes with zero copies; other buffers are staged.
        Pins the memory until ``unregister_buffer`` or ``close``; keep the buffer alive."""
        self._check_open()
        for t in self._transports:
            t.register_buffer(buffer)

    def unregister_buffer(self, buffer) -> None:
        """Undo ``register_buffer``; a no-op for memory that is not registered."""
        self._check_open()
        for t in self._transports:
            t.unregister_buffer(buffer)

    @property
    def transports(self) -> list[str]:
        """The schemes this client uses, in preference order (e.g. ["shm", "rdma", "tcp"])."""
        return [t.scheme for t in self._transports]

    # -- internals --
    def _transport_for(self, replica: Replica) -> Transport | None:
        for t in self._transports:   # in preference order
            if t.can_reach(replica.node) and _serves(t.scheme, replica):
                return t
        return None

    def _read(self, items: list[tuple[int, ObjectView, memoryview]], verify: bool = False
              ) -> dict[int, KVPoolError | None]:
        """Read each object from its best reachable replica, falling back replica by replica
        (and, with ``verify``, past replicas whose bytes fail the object's checksum)."""
        candidates: dict[int, list[tuple[Transport, Replica]]] = {}
        for i, obj, _ in items:
            if len(obj.replicas) == 1:   # the common case: no ranking to do
                t = self._transport_for(obj.replicas[0])
                candidates[i] = [] if t is None else [(t, obj.replicas[0])]
            else:
                now = time.monotonic()
                candidates[i] = sorted(((t, r) for r in obj.replicas
                                        if (t := self._transport_for(r)) is not None),
                                       key=lambda tr: (self._unreachable.get(
                                           tr[1].node.node_id, 0.0) > now, self._rank[tr[0]]))
        bufs = {i: buf for i, _, buf in items}
        results: dict[int, KVPoolError | None] = {}
        last_error: dict[int, KVPoolError] = {}
        pending = list(bufs)
        while pending:
            ops = []
            for i in pending:
                if candidates[i]:
                    t, r = candidates[i].pop(0)
                    ops.append((i, t, IoOp(r, bufs[i])))
                elif isinstance(last_error.get(i), CorruptObject):
                    results[i] = last_error[i]   # every replica reachable was damaged
                else:
                    results[i] = NodeUnavailable(
                        f"no replica could be read: {last_error.get(i, 'no reachable replica')}")
            pending = []
            node_of = {i: op.replica.node.node_id for i, _, op in ops}   # one op per key
            for i, err in self._run(ops, write=False)[0]:
                if err is None:
                    results[i] = None
                else:
                    last_error[i] = err
                    pending.append(i)
                    self._read_failed(node_of[i], err)
            if verify:
                pending += self._check_sums(items, ops, results, last_error)
        return results

    def _read_failed(self, node_id: str, error: KVPoolError) -> None:
        """A read from ``node_id`` failed: a node that did not answer is tried after the other
        replicas for ``_UNREACHABLE_S``; one that answered and refused (NodeRefused: no
        grant, outside its segments, an untrusted peer) is not."""
        if isinstance(error, TransportError) and not isinstance(error, NodeRefused):
            self._unreachable[node_id] = time.monotonic() + _UNREACHABLE_S

    def _check_sums(self, items, ops, results, last_error) -> list[int]:
        """Checksum what ``ops`` just read; a mismatch drops that replica on the master and
        sends the object back to be read from its next replica. Returns those indexes."""
        objs = {i: obj for i, obj, _ in items}
        bad: list[tuple[int, Replica]] = []
        for i, _, op in ops:
            if results.get(i, 1) is None and objs[i].checksum is not None \
                    and checksum(op.buffer) != objs[i].checksum:
                bad.append((i, op.replica))
        for i, replica in bad:
            del results[i]
            last_error[i] = CorruptObject(f"{objs[i].key!r}: the replica in segment "
                                          f"{replica.extent.segment_id!r} failed its checksum")
        if bad:
            try:
                self._master.report_corrupt([objs[i].key for i, _ in bad],
                                            [objs[i].version for i, _ in bad],
                                            [r.extent.segment_id for _, r in bad])
            except KVPoolError:
                pass   # the next reader reports it again; the bytes are refused either way
        return [i for i, _ in bad]

    def _run(self, ops: list[tuple[int, Transport | None, IoOp]], *, write: bool,
             records: dict[int, PutRecord] | None = None
             ) -> tuple[list[tuple[int, KVPoolError | None]], dict[int, int]]:
        """Run ops grouped by transport; one (index, error or None) per op, and for a write
        the CRC-32C of each index written (sealed at the nodes with ``records``)."""
        groups: dict[Transport | None, list[tuple[int, IoOp]]] = defaultdict(list)
        for i, t, op in ops:
            groups[t].append((i, op))
        out: list[tuple[int, KVPoolError | None]] = []
        sums: dict[int, int] = {}
        for t, group in groups.items():
            if t is None:
                out += [(i, NodeUnavailable(f"no transport reaches node {op.replica.node.node_id}"))
                        for i, op in group]
                continue
            if write and records is not None:
                errs, crcs = t.write_sealed([op for _, op in group],
                                            [records[i] for i, _ in group])
                sums.update((i, c) for (i, _), c in zip(group, crcs) if c is not None)
            elif write:
                errs, crcs = t.write_summed([op for _, op in group])
                sums.update((i, c) for (i, _), c in zip(group, crcs) if c is not None)
            else:
                errs = t.read([op for _, op in group])
            out += [(i, e) for (i, _), e in zip(group, errs)]
            if self._metrics is not None:
                self._metrics.moved("put" if write else "get", t.scheme,
                                    sum(op.buffer.nbytes for (_, op), e in zip(group, errs)
                                        if e is None))
        return out, sums


def _serves(scheme: str, replica: Replica) -> bool:
    """Whether a transport of ``scheme`` can move ``replica``'s bytes: shm maps DRAM only;
    rdma reaches what the node registered (DRAM, and HBM through a dma-buf); tcp reaches
    every tier, the node copying through staging (HBM) or doing the file I/O (disk)."""
    if scheme == "shm":
        return replica.tier == "dram"
    if scheme == "rdma":
        return bool(replica.rdma_rkey)
    return True


def _validate_keys(keys: Sequence[str]) -> tuple[list, list[int]]:
    """Per-key results pre-filled with InvalidArgument for bad keys, and the good indexes."""
    results: list = [None] * len(keys)
    # The common case without a Python step per key: every key a non-empty ASCII str short
    # enough not to need encoding (a lone surrogate would fail the whole batch in protobuf).
    if keys and set(map(type, keys)) == {str} and 0 < min(map(len, keys)) \
            and max(map(len, keys)) <= _SHORT_KEY_CHARS and all(map(str.isascii, keys)):
        return results, list(range(len(keys)))
    valid = []
    for i, k in enumerate(keys):
        try:
            validate_key(k)
            valid.append(i)
        except InvalidArgument as e:
            results[i] = e
    return results, valid


def _raise(result):
    if isinstance(result, KVPoolError):
        raise result
    return result
