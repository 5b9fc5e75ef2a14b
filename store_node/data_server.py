"""The store node's two-sided data plane: the tcp data port and the shm fd hand-off.

tcp: one thread per connection, blocking sockets (the GIL is released in recv/send). READ sends
the response header and then the segment slice straight from the mapping; WRITE receives
straight into the segment slice. Framing: :mod:`kvpool.net.data_port`.

shm hand-off: a listening unix stream socket in the Linux abstract namespace. A same-host client
sends a segment id (``!H`` length + utf-8, :data:`kvpool.net.data_port.HANDOFF_REQUEST`);
the reply is a ``frames.RESPONSE`` header: status OK with the segment size as its length field and
the segment's memfd attached (SCM_RIGHTS), or an error status followed by a utf-8 message. The
client keeps the connection open: it may ask for more segments on it, and its EOF tells the
client that this node died. The server never sends anything unsolicited.

Client misbehaviour (bounds, malformed frames, disconnects) is logged as a fact, never as a
traceback, and only costs that client its connection.
"""

from __future__ import annotations

import errno
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Self

from kvpool.common.checksum import checksum
from kvpool.common.logging import RateLimited, get_logger
from kvpool.common.loops import OnCrash, Supervisor
from kvpool.common.types import ObjectRecord, Reservation
from kvpool.net.data_port import (
    HANDOFF_RECORD,
    HANDOFF_REQUEST,
    HANDOFF_RESERVE,
    HANDOFF_SEAL,
    MAX_SEGMENT_ID_BYTES,
    QP_INFO,
    REQUEST,
    FrameStatus,
    Op,
    PutRecord,
    check_segment_id_length,
    encode_response,
    malformed_request,
    recv_record,
    send_refusal,
    send_reply,
)
from kvpool.net.sockets import PeerClosed, recv_exact_into
from kvpool.store_node.manifest import Manifest, StaleEpoch
from kvpool.store_node.memory import Segment

log = get_logger(__name__)
# What clients get wrong, once per request: a few lines a minute per kind, then counts.
client_errors = RateLimited(log)

_LINGER_S = 2.0          # how long to drain a refused client before closing (see _linger_close)
_JOIN_TIMEOUT_S = 5.0
_UCRED = struct.Struct("3i")   # struct ucred: pid, uid, gid
# The acceptor keeps nothing between runs (its poller is rebuilt), so a crash is retried; one
# that keeps coming stops the node: the master would go on sending clients to a port that
# no longer accepts them.
_ACCEPT_ON_CRASH = OnCrash(restarts=5, why="a store node whose data port accepts no "
                                           "connections must not stay in the cluster")


class _Disconnected(Exception):
    """The peer closed (or reset) the connection; ``mid_frame`` if it left a frame unfinished."""

    def __init__(self, mid_frame: bool) -> None:
        super().__init__("mid frame" if mid_frame else "between frames")
        self.mid_frame = mid_frame


def _recv_exact(sock: socket.socket, view: memoryview, *, frame_started: bool) -> None:
    """Fill ``view`` from ``sock``; raise _Disconnected on EOF."""
    try:
        recv_exact_into(sock, view, "client")
    except PeerClosed as exc:
        raise _Disconnected(mid_frame=frame_started or exc.received > 0) from None


class DataServer:
    """Serves a node's segments over tcp and, for same-host clients, by shm fd hand-off.

    ``segments`` is a live mapping (segment id -> Segment) that the node mutates as it mounts
    and unmounts segments; every request looks its segment up afresh.

    After :meth:`start`, ``tcp_endpoint`` is ``"host:port"`` with the real bound port, and
    ``shm_endpoint`` is the abstract unix socket name WITHOUT its leading NUL byte (e.g.
    ``"kvpool-3f2a..."``; connect to ``"\\0" + shm_endpoint``), or ``""`` when ``shm=False``.

    ``rdma`` (a :class:`kvpool.store_node.rdma.NodeRDMA`, or None) answers CONNECT_QP
    handshakes; each client's queue pair lives as long as its handshake connection.
    ``request_counts()`` tells how many requests of each op were served (the rdma path's
    one-sidedness is asserted with it), ``byte_counts()`` how many bytes READ and WRITE moved,
    ``connections()`` how many clients are connected by tcp and by the shm socket (the node's
    metrics). ``supervisor`` runs the accepting thread (common/loops.py). ``manifest``: the
    node's, which records writers' reservations and seals (RESERVE, SEAL; refused UNSUPPORTED
    without one).
    """

    def __init__(self, segments: Mapping[str, Segment], host: str = "127.0.0.1", port: int = 0,
                 shm: bool = True, rdma=None, supervisor: Supervisor | None = None,
                 manifest: Manifest | None = None) -> None:
        self._segments = segments
        self._manifest = manifest   # takes writers' RESERVE and SEAL; None: refused
        self._rdma = rdma
        self._counts: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self._host = host
        self._port = port
        self._shm = shm
        self.tcp_endpoint = ""
        self.shm_endpoint = ""
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self._started = False
        self._tcp_listener: socket.socket | None = None
        self._shm_listener: socket.socket | None = None
        self._wake_r = self._wake_w = -1
        self._acceptor: threading.Thread | None = None
        self._supervisor = supervisor or Supervisor()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Bind and listen on the tcp port (and the shm socket); serve from background threads."""
        if self._started:
            raise RuntimeError("DataServer already started")
        self._started = True
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        tcp = socket.socket(family, socket.SOCK_STREAM)
        shm_sock = None
        try:
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((self._host, self._port))
            tcp.listen(128)
            if self._shm:
                name = f"kvpool-{secrets.token_hex(8)}"
                shm_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                shm_sock.bind("\0" + name)
                shm_sock.listen(128)
                self.shm_endpoint = name
        except BaseException:
            tcp.close()
            if shm_sock is not None:
                shm_sock.close()
            self._started = False
            raise
        port = tcp.getsockname()[1]
        host = f"[{self._host}]" if family == socket.AF_INET6 else self._host
        self.tcp_endpoint = f"{host}:{port}"
        self._tcp_listener, self._shm_listener = tcp, shm_sock
        self._wake_r, self._wake_w = _pipe()
        self._acceptor = self._supervisor.start_thread("data-accept", self._accept_loop,
                                                       _ACCEPT_ON_CRASH, self._stopping)
        log.info("data_server_started", tcp_endpoint=self.tcp_endpoint,
                 shm_endpoint=self.shm_endpoint or None)

    def stop(self) -> None:
        """Close the listeners and every client connection, and join the threads. Idempotent."""
        if not self._started or self._stopping.is_set():
            return
        self._stopping.set()
        _write_wake(self._wake_w)
        if self._acceptor is not None:
            self._acceptor.join(_JOIN_TIMEOUT_S)
        for listener in (self._tcp_listener, self._shm_listener):
            if listener is not None:
                listener.close()
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            # shutdown (not close) wakes a thread blocked in recv/send on it without racing
            # against fd reuse; the thread closes its own socket.
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in conns.values():
            thread.join(_JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning("connection_thread_not_stopped", thread=thread.name)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        log.info("data_server_stopped", tcp_endpoint=self.tcp_endpoint)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def request_counts(self) -> dict[str, int]:
        """Requests served since start, by op name (READ, WRITE, CONNECT_QP, HANDOFF)."""
        with self._lock:
            return dict(self._counts)

    def byte_counts(self) -> dict[str, int]:
        """Payload bytes moved since start by READ and WRITE requests served."""
        with self._lock:
            return dict(self._bytes)

    def connections(self) -> dict[str, int]:
        """Clients connected now: ``tcp`` (the data port) and ``shm`` (the hand-off socket)."""
        with self._lock:
            shm = sum(c.family == socket.AF_UNIX for c in self._conns)
            return {"tcp": len(self._conns) - shm, "shm": shm}

    def _count(self, op: str, nbytes: int = 0) -> None:
        with self._lock:
            self._counts[op] += 1
            if nbytes:
                self._bytes[op] += nbytes

    # ---------------------------------------------------------------- accepting

    def _accept_loop(self) -> None:
        poller = select.poll()
        listeners = {self._tcp_listener.fileno(): (self._tcp_listener, self._serve_tcp)}
        if self._shm_listener is not None:
            listeners[self._shm_listener.fileno()] = (self._shm_listener, self._serve_shm)
        for fd in listeners:
            poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stopping.is_set():
            try:
                events = poller.poll()
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd not in listeners:
                    continue
                listener, handler = listeners[fd]
                try:
                    conn, addr = listener.accept()
                except OSError as exc:  # e.g. ECONNABORTED, EMFILE: keep serving the others
                    log.warning("accept_failed", error=str(exc))
                    if exc.errno in (errno.EMFILE, errno.ENFILE):
                        time.sleep(0.1)
                    continue
                self._spawn(conn, addr, handler)

    def _spawn(self, conn: socket.socket, addr: object, handler) -> None:
        peer = _peer_name(conn, addr)
        thread = threading.Thread(target=self._run_connection, args=(conn, peer, handler),
                                  name=f"kvpool-data-{peer}", daemon=True)
        with self._lock:
            if self._stopping.is_set():
                conn.close()
                return
            self._conns[conn] = thread
        thread.start()

    def _run_connection(self, conn: socket.socket, peer: str, handler) -> None:
        try:
            handler(conn, peer)
        except _Disconnected as exc:
            if not self._stopping.is_set():
                log.debug("client_disconnected", peer=peer, mid_frame=exc.mid_frame)
        except OSError as exc:
            if not self._stopping.is_set():
                log.debug("client_connection_lost", peer=peer, error=str(exc))
        except Exception:  # a bug here, not client misbehaviour: say so loudly, keep serving
            log.exception("connection_handler_failed", peer=peer)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    # ---------------------------------------------------------------- tcp data port

    def _serve_tcp(self, conn: socket.socket, peer: str) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = bytearray(REQUEST.size)
        header_view = memoryview(header)
        sid_buf = bytearray(MAX_SEGMENT_ID_BYTES)
        queue_pairs: list = []     # RDMA queue pairs set up on this connection: die with it
        try:
            self._serve_frames(conn, peer, header, header_view, sid_buf, queue_pairs)
        finally:
            for qp in queue_pairs:
                qp.close()

    def _serve_frames(self, conn: socket.socket, peer: str, header: bytearray,
                      header_view: memoryview, sid_buf: bytearray, queue_pairs: list) -> None:
        while not self._stopping.is_set():
            _recv_exact(conn, header_view, frame_started=False)
            magic, op, sid_len, offset, length = REQUEST.unpack(header)
            if reason := malformed_request(magic, op, sid_len, offset, length):
                return self._refuse_malformed(conn, peer, reason)
            if op == Op.CONNECT_QP:
                self._count(Op.CONNECT_QP.name)
                if not self._connect_qp(conn, peer, queue_pairs):
                    return
                continue
            sid_view = memoryview(sid_buf)[:sid_len]
            _recv_exact(conn, sid_view, frame_started=True)
            try:
                segment_id = sid_view.tobytes().decode("utf-8")
            except UnicodeDecodeError:
                return self._refuse_malformed(conn, peer, "segment id is not utf-8")
            op = Op(op)
            if op in (Op.RESERVE, Op.SEAL):
                got = recv_record(lambda n: _recv_bytes(conn, n))
                if isinstance(got, str):
                    return self._refuse_malformed(conn, peer, got)
                self._count(op.name)
                status, message = self._take_record(op, segment_id, offset, length, got[1])
                if status is FrameStatus.OK:
                    conn.sendall(encode_response(FrameStatus.OK, 0))
                else:
                    client_errors.warning("put_record_refused", kind=status.name, peer=peer,
                                          op=op.name, key=got[1].key, reason=message)
                    send_refusal(conn, status, message)
                    if op is Op.RESERVE:
                        # Its WRITE may follow on the stream: no byte of it may land.
                        return _linger_close(conn)
                continue
            if self._serve_by_segment(conn, op, segment_id, offset, length):
                self._count(op.name, length)
                continue
            self._count(op.name)
            status, message = self._refusal(segment_id, offset, length)
            client_errors.warning("request_refused", kind=status.name, peer=peer, op=op.name,
                                  segment=segment_id, offset=offset, length=length,
                                  status=status.name)
            send_refusal(conn, status, message)
            if op is Op.WRITE:
                # The payload follows on the stream; we will not consume it frame by frame.
                return _linger_close(conn)

    def _connect_qp(self, conn: socket.socket, peer: str, queue_pairs: list) -> bool:
        """Answer a CONNECT_QP; False if the connection was refused and must end."""
        payload = bytearray(QP_INFO.size)
        _recv_exact(conn, memoryview(payload), frame_started=True)
        if self._rdma is None:
            reply, status = b"this node has no RDMA device", FrameStatus.UNSUPPORTED
        else:
            try:
                reply, qp = self._rdma.accept(bytes(payload))
                queue_pairs.append(qp)
                status = FrameStatus.OK
            except ValueError as exc:
                self._refuse_malformed(conn, peer, str(exc))
                return False
            except Exception as exc:  # noqa: BLE001 - pyverbs errors: refuse, keep serving
                log.warning("queue_pair_refused", peer=peer, error=str(exc))
                reply = f"queue pair setup failed: {exc}".encode()
                status = FrameStatus.UNSUPPORTED
        send_reply(conn, status, reply)
        if status == FrameStatus.OK:
            log.debug("queue_pair_connected", peer=peer)
        return True

    def _serve_by_segment(self, conn: socket.socket, op: Op, segment_id: str, offset: int,
                          length: int) -> bool:
        """Serve a request with the segment's I/O (Segment.send_to / recv_from: a slice of
        the mapping, sendfile(2) on disk, staging for HBM). False, with nothing moved, if
        the segment is not mounted (or an unmount closed it meanwhile) or the range is
        outside it: the caller refuses the request."""
        segment = self._segments.get(segment_id)
        if segment is None or offset + length > segment.info.size_bytes:
            return False
        try:
            if op is Op.READ:
                segment.send_to(conn, offset, length, encode_response(FrameStatus.OK, length))
            else:
                segment.recv_from(lambda v: _recv_exact(conn, v, frame_started=True),
                                  offset, length)
                conn.sendall(encode_response(FrameStatus.OK, 0))
        except ValueError:   # closed by an unmount since the lookup
            return False
        return True

    def _take_record(self, op: Op, segment_id: str, offset: int, length: int,
                     record: PutRecord) -> tuple[FrameStatus, str]:
        """A writer's RESERVE (before it writes) or SEAL (after: the bytes are checked against
        the record's CRC-32C first) into the manifest (store_node/manifest.py); the status
        and message to answer."""
        if self._manifest is None:
            return FrameStatus.UNSUPPORTED, "this node keeps no manifest"
        segment = self._segments.get(segment_id)
        if length <= 0:
            return FrameStatus.OUT_OF_BOUNDS, "a put's extent cannot be empty"
        if segment is None or offset + length > segment.info.size_bytes:
            return self._refusal(segment_id, offset, length)
        try:
            if op is Op.RESERVE:
                until = time.monotonic() + record.hold_s
                self._manifest.reserve(record.epoch, Reservation(record.key, segment_id, offset,
                                                                 length, until))
                return FrameStatus.OK, ""
            if record.checksum is None:
                return FrameStatus.BAD_REQUEST, "a seal needs the bytes' CRC-32C"
            try:
                found = _checksum_of(segment, offset, length)
            except ValueError:   # closed by an unmount since the lookup
                return FrameStatus.UNKNOWN_SEGMENT, f"segment {segment_id!r} is not mounted here"
            if found != record.checksum:
                return FrameStatus.CHECKSUM_MISMATCH, (
                    f"{record.key!r}: the bytes at [{offset}, {offset + length}) of "
                    f"{segment_id!r} have CRC-32C {found:#010x}, the seal says "
                    f"{record.checksum:#010x}")
            self._manifest.seal(record.epoch, ObjectRecord(
                record.key, segment_id, offset, length, record.checksum, record.version,
                record.parent))
        except StaleEpoch as e:
            return FrameStatus.STALE_EPOCH, f"{record.key!r}: {e}"
        return FrameStatus.OK, ""

    def _refusal(self, segment_id: str, offset: int, length: int) -> tuple[FrameStatus, str]:
        """Why a request that :meth:`_serve_by_segment` did not serve is refused."""
        segment = self._segments.get(segment_id)
        if segment is None or offset + length <= segment.info.size_bytes:
            return FrameStatus.UNKNOWN_SEGMENT, f"segment {segment_id!r} is not mounted here"
        return FrameStatus.OUT_OF_BOUNDS, (f"[{offset}, {offset + length}) is outside segment "
                                           f"{segment_id!r} of {segment.info.size_bytes} bytes")

    def _refuse_malformed(self, conn: socket.socket, peer: str, reason: str) -> None:
        client_errors.warning("malformed_frame", peer=peer, reason=reason)
        send_refusal(conn, FrameStatus.BAD_REQUEST, reason)
        _linger_close(conn)

    # ---------------------------------------------------------------- shm hand-off

    def _serve_shm(self, conn: socket.socket, peer: str) -> None:
        length_buf = bytearray(HANDOFF_REQUEST.size)
        while not self._stopping.is_set():
            _recv_exact(conn, memoryview(length_buf), frame_started=False)
            (sid_len,) = HANDOFF_REQUEST.unpack(length_buf)
            if sid_len in (HANDOFF_RESERVE, HANDOFF_SEAL):
                if not self._serve_shm_record(conn, peer, sid_len):
                    return
                continue
            if reason := check_segment_id_length(sid_len):
                return self._refuse_handoff(conn, peer, FrameStatus.BAD_REQUEST, reason,
                                            close=True)
            sid_buf = bytearray(sid_len)
            _recv_exact(conn, memoryview(sid_buf), frame_started=True)
            try:
                segment_id = sid_buf.decode("utf-8")
            except UnicodeDecodeError:
                return self._refuse_handoff(conn, peer, FrameStatus.BAD_REQUEST,
                                            "segment id is not utf-8", close=True)
            segment = self._segments.get(segment_id)
            fd = -1
            if segment is not None:
                try:
                    fd = segment.fd
                except ValueError:   # closed while being unmounted
                    segment = None
            if segment is None:
                self._refuse_handoff(conn, peer, FrameStatus.UNKNOWN_SEGMENT,
                                     f"segment {segment_id!r} is not mounted here")
                continue
            if fd < 0:
                self._refuse_handoff(conn, peer, FrameStatus.BAD_REQUEST,
                                     f"segment {segment_id!r} cannot be shared by fd")
                continue
            self._count("HANDOFF")
            header = encode_response(FrameStatus.OK, segment.info.size_bytes)
            sent = socket.send_fds(conn, [header], [fd])
            if sent < len(header):
                conn.sendall(header[sent:])
            log.debug("segment_fd_handed_off", peer=peer, segment=segment_id)

    def _serve_shm_record(self, conn: socket.socket, peer: str, marker: int) -> bool:
        """A RESERVE or SEAL on the hand-off socket; False if it was malformed (the
        connection ends)."""
        head = _recv_bytes(conn, HANDOFF_RECORD.size)
        sid_len, offset, length = HANDOFF_RECORD.unpack(head)
        if reason := check_segment_id_length(sid_len):
            self._refuse_handoff(conn, peer, FrameStatus.BAD_REQUEST, reason, close=True)
            return False
        got = recv_record(lambda n: _recv_bytes(conn, n), sid_len=sid_len)
        if isinstance(got, str):
            self._refuse_handoff(conn, peer, FrameStatus.BAD_REQUEST, got, close=True)
            return False
        op = Op.RESERVE if marker == HANDOFF_RESERVE else Op.SEAL
        self._count(op.name)
        status, message = self._take_record(op, got[0], offset, length, got[1])
        if status is FrameStatus.OK:
            conn.sendall(encode_response(FrameStatus.OK, 0))
        else:
            self._refuse_handoff(conn, peer, status, message)
        return True

    def _refuse_handoff(self, conn: socket.socket, peer: str, status: FrameStatus, message: str,
                        close: bool = False) -> None:
        client_errors.warning("handoff_refused", kind=status.name, peer=peer,
                              status=status.name, reason=message)
        send_refusal(conn, status, message)
        if close:
            _linger_close(conn)


def _recv_bytes(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    if n:
        _recv_exact(conn, memoryview(buf), frame_started=True)
    return bytes(buf)


def _checksum_of(segment: Segment, offset: int, length: int) -> int:
    """CRC-32C of ``[offset, offset + length)`` of ``segment`` (ValueError once closed)."""
    segment.check_range(offset, length)
    if segment.host_addressable:
        with segment.buffer[offset:offset + length] as view:
            return checksum(view)
    staged = bytearray(length)
    segment.read_into(offset, memoryview(staged))
    return checksum(staged)


def _linger_close(conn: socket.socket) -> None:
    """Close after a refusal so that the refusal still reaches the client.

    Closing a socket with unread bytes in its receive queue makes the kernel send RST, which can
    destroy the response we just sent before the client reads it. So: FIN our side, then read
    and discard whatever the client still sends until it closes (or _LINGER_S passes).
    """
    try:
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + _LINGER_S
        sink = bytearray(1 << 16)
        while (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            if conn.recv_into(sink) == 0:
                break
    except OSError:   # timeout, reset, or stop(): the socket is closed by the caller either way
        pass


def _peer_name(conn: socket.socket, addr: object) -> str:
    if conn.family == socket.AF_UNIX:
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            pid, uid, _gid = _UCRED.unpack(creds)
            return f"unix:pid={pid},uid={uid}"
        except OSError:
            return "unix"
    if isinstance(addr, tuple):
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return str(addr)


def _pipe() -> tuple[int, int]:
    return os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)


def _write_wake(fd: int) -> None:
    try:
        os.write(fd, b"x")
    except OSError:
        pass
