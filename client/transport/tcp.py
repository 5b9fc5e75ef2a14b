"""The tcp transport: the fallback every store node serves on its data port.

Ops are grouped by endpoint and pipelined on one pooled connection per group: a window of
requests goes out, responses are read in order, and more requests go out as responses come
back. Reads ``recv_into`` the caller's buffer; writes ``sendmsg`` the caller's buffer; no copy
in Python either way. Framing: :mod:`kvpool.net.data_port`.

Failures map to TransportError at one boundary (``_pipeline``'s caller): connection refused,
reset, timed out, or a malformed reply discard that connection and fail the op in progress and
every later op on that endpoint. A node refusing an op (OUT_OF_BOUNDS, UNKNOWN_SEGMENT) gives
SegmentBoundsError for that op only; after a refused WRITE the node closes the connection by
protocol, and the remaining ops (which it did not execute) continue on a fresh connection.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from kvpool.client.transport.base import (
    IoOp,
    Transport,
    byte_views,
    group_by,
)
from kvpool.common import capabilities
from kvpool.common.checksum import Checksums
from kvpool.common.errors import (
    ClientClosed,
    InvalidArgument,
    SegmentBoundsError,
    TransportError,
)
from kvpool.common.logging import get_logger
from kvpool.common.security import Credentials
from kvpool.common.types import NodeEndpoints, Replica
from kvpool.net import data_tls
from kvpool.net.data_port import (
    HELD_TRAILER,
    MAX_SEGMENT_ID_BYTES,
    RESPONSE,
    FrameStatus,
    Op,
    PutRecord,
    encode_record_request,
    encode_request,
    recv_refusal,
)
from kvpool.net.sockets import Spinner, recv_exact_into, send_all

log = get_logger(__name__)

_UNSET = object()
_U64 = 1 << 64
_STALE = select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransportError(f"malformed tcp endpoint {endpoint!r}; expected host:port")
    return host.strip("[]"), int(port)


class _WriteRefused(Exception):
    """The node refused a WRITE and, by protocol, is closing this connection."""


class TCPTransport(Transport):
    """Moves bytes over the store nodes' tcp data ports; thread-safe.

    ``timeout_s`` bounds every blocking socket call (a hung node fails the ops instead of
    hanging the client); ``connect_timeout_s`` defaults to it. At most ``max_idle_per_endpoint``
    idle connections are pooled per node; ``window`` requests are in flight per connection.
    Ops on different nodes run in parallel, ``max_parallel_endpoints`` nodes at a time.
    ``tls``: the cluster's credentials, for nodes whose data port speaks TLS; the TLS context
    (net/data_tls.py ``client_context``) is made at the first such node, not before.
    """

    scheme = "tcp"

    def __init__(self, timeout_s: float = 10.0, *, connect_timeout_s: float | None = None,
                 max_idle_per_endpoint: int = 4, window: int = 32,
                 max_parallel_endpoints: int = 8, tls: Credentials | None = None) -> None:
        if window < 1:
            raise InvalidArgument("window must be at least 1")
        self._timeout_s = timeout_s
        self._connect_timeout_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        self._max_idle = max_idle_per_endpoint
        self._window = window
        self._max_parallel = max_parallel_endpoints
        self._credentials = tls   # for nodes whose data port speaks TLS (net/data_tls.py)
        self._tls: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self._idle: dict[str, list[socket.socket]] = {}
        # Each connection's answer spinner (net/sockets.py), for as long as it lives.
        self._spinners: weakref.WeakKeyDictionary[socket.socket, Spinner] = \
            weakref.WeakKeyDictionary()
        self._executor: ThreadPoolExecutor | None = None
        self._no_held: set[str] = set()   # nodes that do not serve READ_HELD
        self._closed = False

    def can_reach(self, node: NodeEndpoints) -> bool:
        return bool(node.tcp_endpoint)

    def read(self, ops: Sequence[IoOp]) -> list[TransportError | None]:
        return self._run(ops, byte_views(ops, writable=True), Op.READ)

    def write(self, ops: Sequence[IoOp]) -> list[TransportError | None]:
        return self._run(ops, byte_views(ops, writable=False), Op.WRITE)

    reads_held = True

    def read_held(self, replica: Replica, buffer: memoryview) -> bool:
        """:meth:`Transport.read_held`: one READ_HELD on a pooled connection. A node that
        does not know the op (an older one: it closes the connection) is not asked again."""
        if self._closed:
            raise ClientClosed("transport is closed")
        node, extent = replica.node, replica.extent
        endpoint = node.tcp_endpoint
        if endpoint in self._no_held or _local_refusal(IoOp(replica, buffer)) is not None:
            return False
        sock = None
        try:
            sock = self._acquire(endpoint, node.tcp_tls)
            sock.sendall(encode_request(Op.READ_HELD, extent.segment_id, extent.offset,
                                        extent.length, replica.grant))
            self._spinner(sock).wait()
            header = bytearray(RESPONSE.size)
            recv_exact_into(sock, memoryview(header))
            status, length = RESPONSE.unpack(header)
            if status != FrameStatus.OK:
                recv_refusal(sock, status, length)
                if status == FrameStatus.BAD_REQUEST:   # it closes the connection
                    self._no_held.add(endpoint)
                    sock.close()
                else:
                    self._release(endpoint, sock)
                return False
            if length != buffer.nbytes + HELD_TRAILER.size:   # another object, or malformed
                raise TransportError(f"a {length - HELD_TRAILER.size}-byte READ_HELD answer "
                                     f"for {buffer.nbytes} bytes")
            recv_exact_into(sock, buffer)
            trailer = bytearray(HELD_TRAILER.size)
            recv_exact_into(sock, memoryview(trailer))
        except OSError as exc:   # the caller asks the master, which finds what is wrong
            if sock is not None:
                sock.close()
            log.debug("tcp_read_held_failed", endpoint=endpoint, error=str(exc))
            return False
        self._release(endpoint, sock)
        return HELD_TRAILER.unpack(trailer)[0] == 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
            executor, self._executor = self._executor, None
        for socks in idle.values():
            for sock in socks:
                sock.close()
        if executor is not None:
            executor.shutdown(wait=False)

    seals = True

    slots = True

    def reserve(self, ops: Sequence[IoOp], records: Sequence[PutRecord]
                ) -> list[TransportError | None]:
        """:meth:`Transport.reserve`: the RESERVEs pipelined on one connection per node.
        The node drops the connection after a refusal: the ops behind it fail too."""
        if self._closed:
            raise ClientClosed("transport is closed")
        results: list[TransportError | None] = [None] * len(ops)
        for endpoint, indexes in group_by(ops, lambda o: o.replica.node.tcp_endpoint).items():
            sock, answered = None, 0
            try:
                sock = self._acquire(endpoint, ops[indexes[0]].replica.node.tcp_tls)
                sock.sendall(b"".join(_record_request(Op.RESERVE, ops[k], records[k])
                                      for k in indexes))
                header = bytearray(RESPONSE.size)
                self._spinner(sock).wait()
                for k in indexes:
                    recv_exact_into(sock, memoryview(header))
                    status, length = RESPONSE.unpack(header)
                    if status != FrameStatus.OK or length:
                        message = recv_refusal(sock, status, length)
                        raise TransportError(f"tcp {endpoint}: RESERVE of {records[k].key!r} "
                                             f"refused ({FrameStatus(status).name}): {message}")
                    answered += 1
            except OSError as exc:
                if sock is not None:
                    sock.close()
                error = exc if isinstance(exc, TransportError) else self._describe(endpoint, exc)
                for k in indexes[answered:]:
                    results[k] = TransportError(str(error))
                continue
            self._release(endpoint, sock)
        return results

    def write_sealed_then(self, op: IoOp, record: PutRecord, then: Callable[[int], object],
                          *, reserved: bool = False
                          ) -> tuple[TransportError | None, int | None, bool]:
        """:meth:`Transport.write_sealed_then`: ``then`` runs once the node answered the
        WRITE, while it checks the SEAL pipelined behind it."""
        written: list[int] = []

        def after_write(crc: int) -> None:
            written.append(crc)
            then(crc)
        [error], _ = self.write_sealed([op], [record], after_write, reserved=reserved)
        return (error, written[0], True) if written else (error, None, False)

    def write_sealed(self, ops: Sequence[IoOp], records: Sequence[PutRecord],
                     after_write: Callable[[int], object] | None = None, *,
                     reserved: bool = False
                     ) -> tuple[list[TransportError | None], list[int | None]]:
        """:meth:`Transport.write_sealed` in one round trip per node: RESERVE, WRITE (the
        node reads no byte of it when the RESERVE was refused: it drops the connection) and,
        once the checksums are done (a helper thread takes them while the writes go out),
        SEAL of each op, pipelined; the replies come in that order. ``after_write`` (one op
        only): called with its CRC-32C once the node answered its WRITE, before the SEAL's
        answer is read. ``reserved``: the extents lie in slots reserved already (no
        RESERVE)."""
        if self._closed:
            raise ClientClosed("transport is closed")
        views = byte_views(ops, writable=False)
        results: list = [_UNSET] * len(ops)
        sums: list[int | None] = [None] * len(ops)
        first = {}   # each distinct buffer's first op: checksummed once
        for k, op in enumerate(ops):
            first.setdefault(id(op.buffer), k)
        with Checksums([views[k] for k in first.values()]) as checksums:
            crc_of: dict[int, int] = {}

            def crc(k: int) -> int:
                if not crc_of:
                    crc_of.update(zip(first, checksums.result()))
                return crc_of[id(ops[k].buffer)]

            for endpoint, indexes in group_by(ops, lambda o: o.replica.node.tcp_endpoint
                                              ).items():
                self._sealed_endpoint(endpoint, indexes, ops, views, records, crc, results,
                                      after_write, reserved)
        for k, e in enumerate(results):
            if e is None:
                sums[k] = crc(k)
        return results, sums

    def _sealed_endpoint(self, endpoint: str, indexes: list[int], ops: Sequence[IoOp],
                         views: list[memoryview], records: Sequence[PutRecord], crc,
                         results: list, after_write=None, reserved: bool = False) -> None:
        """One node's RESERVE/WRITE/SEAL exchange, filling ``results``; never raises a
        transport failure (``after_write`` may raise: the connection is then dropped)."""
        pending = []
        for k in indexes:
            refusal = _local_refusal(ops[k])
            if refusal is None:
                pending.append(k)
            else:
                results[k] = refusal
        if not pending:
            return
        sock = None
        try:
            sock = self._acquire(endpoint, ops[pending[0]].replica.node.tcp_tls)
            for k in pending:
                send_all(sock, [*(() if reserved else
                                  (_record_request(Op.RESERVE, ops[k], records[k]),)),
                                _request(Op.WRITE, ops[k]), views[k]])
            sock.sendall(b"".join(
                _record_request(Op.SEAL, ops[k], _with_checksum(records[k], crc(k)))
                for k in pending))
            header = bytearray(RESPONSE.size)
            self._spinner(sock).wait()
            for k in pending:
                for op in (Op.WRITE, Op.SEAL) if reserved else (Op.RESERVE, Op.WRITE, Op.SEAL):
                    recv_exact_into(sock, memoryview(header))
                    status, length = RESPONSE.unpack(header)
                    if status == FrameStatus.OK and length == 0:
                        if op is Op.WRITE and after_write is not None:
                            try:
                                after_write(crc(k))
                            except BaseException:
                                sock.close()   # the SEAL's answer is left unread
                                raise
                        continue
                    message = recv_refusal(sock, status, length)
                    error = TransportError(f"tcp {endpoint}: {op.name} of {records[k].key!r} "
                                           f"refused ({FrameStatus(status).name}): {message}")
                    if op is not Op.SEAL:   # the node dropped the connection after it
                        raise error
                    results[k] = error
                    break
                else:
                    results[k] = None
        except OSError as exc:   # the one boundary: every socket failure becomes this
            if sock is not None:
                sock.close()
            error = exc if isinstance(exc, TransportError) else self._describe(endpoint, exc)
            for k in pending:
                if results[k] is _UNSET:
                    results[k] = TransportError(str(error))
            return
        self._release(endpoint, sock)

    # ---------------------------------------------------------------- batching

    def _run(self, ops: Sequence[IoOp], views: list[memoryview], op: Op
             ) -> list[TransportError | None]:
        if self._closed:
            raise ClientClosed("transport is closed")
        results: list = [_UNSET] * len(ops)
        groups = group_by(ops, lambda o: o.replica.node.tcp_endpoint)
        if len(groups) == 1 or self._max_parallel <= 1:
            for endpoint, indexes in groups.items():
                self._run_endpoint(endpoint, indexes, ops, views, op, results)
        else:
            executor = self._get_executor()
            futures = [executor.submit(self._run_endpoint, endpoint, indexes, ops, views, op,
                                       results)
                       for endpoint, indexes in groups.items()]
            wait(futures)
            for f in futures:
                f.result()   # re-raise bugs; transport failures are already in results
        return results

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise ClientClosed("transport is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._max_parallel,
                                                    thread_name_prefix="kvpool-tcp")
            return self._executor

    def _run_endpoint(self, endpoint: str, indexes: list[int], ops: Sequence[IoOp],
                      views: list[memoryview], op: Op, results: list) -> None:
        """Run one node's ops, filling ``results``; never raises a transport failure."""
        pending: list[int] = []
        for i in indexes:
            refusal = _local_refusal(ops[i])
            if refusal is None:
                pending.append(i)
            else:
                results[i] = refusal
        while pending:
            sock = None
            try:
                sock = self._acquire(endpoint, ops[pending[0]].replica.node.tcp_tls)
                self._pipeline(sock, pending, ops, views, op, results)
            except _WriteRefused:
                sock.close()
                pending = [i for i in pending if results[i] is _UNSET]
                continue
            except OSError as exc:   # the one boundary: every socket failure becomes this
                if sock is not None:
                    sock.close()
                error = self._describe(endpoint, exc)
                log.debug("tcp_ops_failed", endpoint=endpoint, error=str(error))
                for i in pending:
                    if results[i] is _UNSET:
                        results[i] = TransportError(str(error))
                return
            self._release(endpoint, sock)
            return

    def _pipeline(self, sock: socket.socket, pending: list[int], ops: Sequence[IoOp],
                  views: list[memoryview], op: Op, results: list) -> None:
        """Send ``pending`` ops in order with up to ``window`` in flight; read replies in order."""
        n, window = len(pending), self._window
        sent = done = 0
        header = bytearray(RESPONSE.size)
        header_view = memoryview(header)
        while done < n:
            if sent < n and sent - done <= window // 2:
                end = min(n, done + window)
                if op is Op.READ:
                    sock.sendall(b"".join(_request(op, ops[pending[j]]) for j in range(sent, end)))
                else:
                    for j in range(sent, end):
                        i = pending[j]
                        send_all(sock, [_request(op, ops[i]), views[i]])
                sent = end
            i = pending[done]
            if done == 0:
                self._spinner(sock).wait()
            recv_exact_into(sock, header_view)
            status, length = RESPONSE.unpack(header)
            if status == FrameStatus.OK:
                expected = views[i].nbytes if op is Op.READ else 0
                if length != expected:
                    raise TransportError(f"malformed reply: {length} bytes for a "
                                         f"{expected}-byte {op.name}")
                if expected:
                    recv_exact_into(sock, views[i])
                results[i] = None
                done += 1
                continue
            message = recv_refusal(sock, status, length)
            if status == FrameStatus.BAD_REQUEST:
                raise TransportError(f"node rejected the request as malformed: {message}")
            results[i] = SegmentBoundsError(message)
            done += 1
            if op is Op.WRITE:
                raise _WriteRefused()

    @staticmethod
    def _describe(endpoint: str, exc: OSError) -> TransportError:
        if isinstance(exc, TransportError):
            return TransportError(f"tcp {endpoint}: {exc}")
        if isinstance(exc, TimeoutError):
            return TransportError(f"tcp {endpoint}: timed out")
        return TransportError(f"tcp {endpoint}: {exc.strerror or exc}")

    # ---------------------------------------------------------------- connection pool

    def _spinner(self, sock: socket.socket) -> Spinner:
        spinner = self._spinners.get(sock)
        if spinner is None:
            spinner = self._spinners[sock] = Spinner(sock)
        return spinner

    def _acquire(self, endpoint: str, tls: bool = False) -> socket.socket:
        """An idle connection to ``endpoint``, else a new one (over TLS where the node's data
        port speaks it: ``NodeEndpoints.tcp_tls``)."""
        with self._lock:
            if self._closed:
                raise ClientClosed("transport is closed")
            idle = self._idle.get(_pool_key(endpoint, tls))
            while idle:
                sock = idle.pop()
                if _usable(sock):
                    return sock
                sock.close()
        host, port = _parse_endpoint(endpoint)
        if tls and self._credentials is None:
            raise TransportError(f"tcp {endpoint}: the node serves its data port over TLS "
                                 "(--data-tls); this client has no credentials for it")
        if tls and self._tls is None:
            self._tls = data_tls.client_context(self._credentials)
        sock = socket.create_connection((host, port), timeout=self._connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self._timeout_s)
        return data_tls.wrap(sock, self._tls, endpoint) if tls else sock

    def _release(self, endpoint: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(_pool_key(endpoint, isinstance(sock, ssl.SSLSocket)),
                                         [])
            if not self._closed and len(idle) < self._max_idle:
                idle.append(sock)
                return
        sock.close()


def _pool_key(endpoint: str, tls: bool) -> str:
    return f"tls:{endpoint}" if tls else endpoint


def _usable(sock: socket.socket) -> bool:
    """An idle connection is usable while it has nothing to read: the node never writes
    unprompted, so readability means it closed (restart, stop) or broke."""
    poller = select.poll()
    poller.register(sock, _STALE)
    return not poller.poll(0)


def _request(op: Op, io: IoOp) -> bytes:
    extent = io.replica.extent
    return encode_request(op, extent.segment_id, extent.offset, extent.length,
                          capabilities.write_grant(io.replica.grant))


def _record_request(op: Op, io: IoOp, record: PutRecord) -> bytes:
    extent = io.replica.extent
    return encode_record_request(op, extent.segment_id, extent.offset, extent.length, record,
                                 capabilities.record_grant(io.replica.grant))


def _with_checksum(record: PutRecord, crc: int) -> PutRecord:
    return PutRecord(record.key, record.version, record.epoch, record.hold_s, crc,
                     record.parent)


def _local_refusal(io: IoOp) -> SegmentBoundsError | None:
    """Requests that cannot be encoded can address no segment: refuse without asking."""
    extent = io.replica.extent
    if not 0 <= extent.offset < _U64 or not 0 <= extent.length < _U64:
        return SegmentBoundsError(f"[{extent.offset}, {extent.end}) is not a valid extent")
    try:
        size = len(extent.segment_id.encode("utf-8"))
    except UnicodeEncodeError:
        return SegmentBoundsError(f"segment id {extent.segment_id[:64]!r} is not valid utf-8")
    if size > MAX_SEGMENT_ID_BYTES:
        return SegmentBoundsError(f"segment id {extent.segment_id[:64]!r}... is too long")
    return None
