"""KVClient: put and get KV blocks by key, bytes moved one-sided (shm) or via tcp.

    with KVClient(master="127.0.0.1:50051") as kv:
        kv.put("block-hash", tensor)
        n = kv.get_into("block-hash", out_tensor)
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from kvpool.client.buffers import byte_view
from kvpool.client.master_client import MasterClient
from kvpool.client.transport.base import IoOp, Transport
from kvpool.client.transport.registry import TRANSPORT_PREFERENCE, create_transports
from kvpool.common.errors import (
    ClientClosed,
    InvalidArgument,
    KVPoolError,
    NodeUnavailable,
    NotPending,
    TransportError,
)
from kvpool.common.types import ObjectView, Replica, validate_key

# A read that outlived its lease is checked against the master; if the object changed under
# it, it is read again, at most this many times.
_MAX_READ_ATTEMPTS = 3
# Writes are not started this close to the put deadline, so a slow writer never races the
# master's reclaim of the PENDING object.
_PUT_DEADLINE_MARGIN_S = 0.5


class KVClient:
    """A thread-safe client of one kvpool cluster. Use as a context manager, or call close()."""

    def __init__(self, master: str, *, replicas: int = 0,
                 transports: Sequence[str | Transport] | None = None, timeout_s: float = 10.0):
        """``replicas``: copies per put (0 = the master's default). ``transports``: schemes
        (or Transport instances) to use; whatever the order given, the client prefers shm,
        then rdma, then tcp per replica (default: every transport available here)."""
        self._master = MasterClient(master, timeout_s=timeout_s)
        given = [t for t in transports or () if isinstance(t, Transport)]
        try:
            schemes = None if transports is None else [t for t in transports if isinstance(t, str)]
            made = create_transports(schemes) if schemes or not given else []
        except BaseException:
            self._master.close()
            raise
        self._transports: list[Transport] = sorted(
            given + made, key=lambda t: TRANSPORT_PREFERENCE.index(t.scheme))
        self._rank = {t: TRANSPORT_PREFERENCE.index(t.scheme) for t in self._transports}
        self._replicas = replicas
        self._closed = False
        self._lock = threading.Lock()

    @property
    def master_address(self) -> str:
        """The master's ``host:port``."""
        return self._master.address

    # -- lifecycle --
    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release connections and mappings. Idempotent; any later call raises ClientClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for t in self._transports:
            t.close()
        self._master.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("KVClient is closed")

    # -- single-key API: raises the per-key error --
    def put(self, key: str, value, *, replicas: int | None = None) -> None:
        """Store ``value`` under ``key``. Raises AlreadyExists if the key is stored: keys are
        immutable. Values: bytes, bytearray, memoryview, numpy array, contiguous CPU tensor."""
        _raise(self.batch_put([key], [value], replicas=replicas)[0])

    def get(self, key: str) -> bytes:
        """The value stored under ``key``; ObjectNotFound if there is none."""
        return _raise(self.batch_get([key])[0])

    def get_into(self, key: str, buffer) -> int:
        """Read ``key``'s value into ``buffer`` (bytearray, numpy array, CPU tensor, writable
        memoryview) without intermediate copies; return the number of bytes written."""
        return _raise(self.batch_get_into([key], [buffer])[0])

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

    def batch_remove(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        self._check_open()
        results, valid = _validate_keys(keys)
        if valid:
            for i, err in zip(valid, self._master.remove([keys[i] for i in valid])):
                results[i] = err
        return results

    def batch_put(self, keys: Sequence[str], values: Sequence, *, replicas: int | None = None
                  ) -> list[KVPoolError | None]:
        """Store each value under its key; per key None (stored) or the error (AlreadyExists,
        NoSpace, InvalidArgument, NodeUnavailable, ...). Keys that fail are never half-stored."""
        self._check_open()
        if len(keys) != len(values):
            raise InvalidArgument(f"{len(keys)} keys but {len(values)} values")
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
        sent = time.monotonic()
        placed, put_timeout_s = self._master.put_start(
            [keys[i] for i in idx], [views[i].nbytes for i in idx],
            self._replicas if replicas is None else replicas)
        deadline = sent + put_timeout_s - _PUT_DEADLINE_MARGIN_S
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
        else:
            for i, err in self._run(ops, write=True):
                if results[i] is None:
                    results[i] = err
            if time.monotonic() > deadline:
                for i in written:
                    results[i] = results[i] or TransportError(
                        f"{keys[i]!r}: writing took longer than the put timeout")
        failed = [keys[i] for i in written if results[i] is not None]
        if failed:
            self._master.put_revoke(failed)
        ok = [i for i in written if results[i] is None]
        if ok:
            for i, err in zip(ok, self._master.put_end([keys[i] for i in ok])):
                results[i] = TransportError(f"{keys[i]!r}: put timed out") \
                    if isinstance(err, NotPending) else err
        return results

    def batch_get(self, keys: Sequence[str]) -> list[bytes | KVPoolError]:
        """Each key's value as bytes (one copy more than batch_get_into)."""
        bufs: dict[int, bytearray] = {}

        def alloc(i: int, size: int) -> memoryview:
            bufs[i] = bytearray(size)
            return memoryview(bufs[i])

        got = self._get(keys, alloc)
        return [r if isinstance(r, KVPoolError) else bytes(bufs[i]) for i, r in enumerate(got)]

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence) -> list[int | KVPoolError]:
        """Read each key into its buffer; per key the byte count or the error (ObjectNotFound,
        InvalidArgument for a buffer too small, NodeUnavailable when no replica answers)."""
        if len(keys) != len(buffers):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        views: dict[int, memoryview | InvalidArgument] = {}
        for i, b in enumerate(buffers):
            try:
                views[i] = byte_view(b, writable=True)
            except InvalidArgument as e:
                views[i] = e

        def into(i: int, size: int) -> memoryview:
            v = views[i]
            if isinstance(v, InvalidArgument):
                raise v
            if size == v.nbytes:
                return v
            if size > v.nbytes:
                raise InvalidArgument(f"{keys[i]!r}: buffer of {v.nbytes} bytes is smaller "
                                      f"than the value ({size} bytes)")
            return v[:size]

        return self._get(keys, into)

    def _get(self, keys: Sequence[str], buffer_for: Callable[[int, int], memoryview]
             ) -> list[int | KVPoolError]:
        """Locate, read and (if a read outlived its lease) verify each key."""
        self._check_open()
        out, todo = _validate_keys(keys)
        bufs: dict[int, memoryview] = {}
        seen_version: dict[int, int] = {}
        for _ in range(_MAX_READ_ATTEMPTS):
            if not todo:
                break
            sent = time.monotonic()
            located, lease_ttl_s = self._master.get_replicas([keys[i] for i in todo])
            reads = []
            for i, obj in zip(todo, located):
                seen = seen_version.get(i)
                if isinstance(obj, KVPoolError):
                    out[i] = obj
                elif seen == obj.version:
                    out[i] = obj.size   # still the object we read: the bytes are its own
                elif seen is not None and obj.size != bufs[i].nbytes:
                    out[i] = TransportError(f"{keys[i]!r}: the object changed during the read")
                else:
                    try:
                        bufs[i] = bufs[i] if i in bufs else buffer_for(i, obj.size)
                    except InvalidArgument as e:
                        out[i] = e
                        continue
                    seen_version[i] = obj.version
                    reads.append((i, obj, bufs[i]))
            read = self._read(reads)
            lease_over = time.monotonic() > sent + lease_ttl_s
            todo = []
            for i, obj, _ in reads:
                if read[i] is not None:
                    out[i] = read[i]
                elif lease_over:
                    todo.append(i)      # verify the version before trusting these bytes
                else:
                    out[i] = obj.size
        for i in todo:
            out[i] = TransportError(f"{keys[i]!r}: the object kept changing during the read")
        return out

    def stats(self):
        """The master's cluster statistics (protobuf StatsResponse)."""
        self._check_open()
        return self._master.stats()

    def register_buffer(self, buffer) -> None:
        """Register ``buffer`` (bytearray, numpy array, CPU tensor) with the transports that
        can use it in place (rdma: a memory region), so that put / get_into / batch_get_into
        on it or on slices of it move bytes with zero copies; other buffers are staged.
        Pins the memory until ``unregister_buffer`` or ``close``; keep the buffer alive."""
        self._check_open()
        for t in self._transports:
            if hasattr(t, "register_buffer"):
                t.register_buffer(buffer)

    def unregister_buffer(self, buffer) -> None:
        """Undo ``register_buffer``; a no-op for memory that is not registered."""
        self._check_open()
        for t in self._transports:
            if hasattr(t, "unregister_buffer"):
                t.unregister_buffer(buffer)

    @property
    def transports(self) -> list[str]:
        """The schemes this client uses, in preference order (e.g. ["shm", "rdma", "tcp"])."""
        return [t.scheme for t in self._transports]

    # -- internals --
    def _transport_for(self, replica: Replica) -> Transport | None:
        for t in self._transports:   # in preference order
            if t.can_reach(replica.node):
                return t
        return None

    def _read(self, items: list[tuple[int, ObjectView, memoryview]]) -> dict[int, KVPoolError | None]:
        """Read each object from its best reachable replica, falling back replica by replica."""
        candidates: dict[int, list[tuple[Transport, Replica]]] = {}
        for i, obj, _ in items:
            if len(obj.replicas) == 1:   # the common case: no ranking to do
                t = self._transport_for(obj.replicas[0])
                candidates[i] = [] if t is None else [(t, obj.replicas[0])]
            else:
                candidates[i] = sorted(((t, r) for r in obj.replicas
                                        if (t := self._transport_for(r)) is not None),
                                       key=lambda tr: self._rank[tr[0]])
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
                else:
                    results[i] = NodeUnavailable(
                        f"no replica could be read: {last_error.get(i, 'no reachable replica')}")
            pending = []
            for i, err in self._run(ops, write=False):
                if err is None:
                    results[i] = None
                else:
                    last_error[i] = err
                    pending.append(i)
        return results

    def _run(self, ops: list[tuple[int, Transport | None, IoOp]], *, write: bool
             ) -> list[tuple[int, KVPoolError | None]]:
        """Run ops grouped by transport; one (index, error or None) per op."""
        groups: dict[Transport | None, list[tuple[int, IoOp]]] = defaultdict(list)
        for i, t, op in ops:
            groups[t].append((i, op))
        out: list[tuple[int, KVPoolError | None]] = []
        for t, group in groups.items():
            if t is None:
                out += [(i, NodeUnavailable(f"no transport reaches node {op.replica.node.node_id}"))
                        for i, op in group]
                continue
            errs = (t.write if write else t.read)([op for _, op in group])
            out += [(i, e) for (i, _), e in zip(group, errs)]
        return out


def _validate_keys(keys: Sequence[str]) -> tuple[list, list[int]]:
    """Per-key results pre-filled with InvalidArgument for bad keys, and the good indexes."""
    results: list = [None] * len(keys)
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
