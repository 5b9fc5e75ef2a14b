"""The store node's two-sided data plane: the tcp data port and the shm fd hand-off.

tcp: an idle connection costs no thread. One thread waits on every idle connection (epoll,
one-shot); a connection with a request in flight goes to a worker thread, which serves frames
while they keep coming (blocking sockets: the GIL is released in recv/send) and hands the
connection back once none arrived for ``_LINGER_WORK_S``. READ sends the response header and then
the segment slice straight from the mapping; WRITE receives straight into the segment slice.
Framing: :mod:`kvpool.net.data_port`. Limits (:class:`DataLimits`): at most ``max_connections``
connections (at the cap, the one idle longest is closed to make room, so a flood of idle
connections cannot lock a client out); a tcp connection idle for ``idle_timeout_s`` is closed
(not one that holds an RDMA queue pair, nor an shm link: their EOF tells the client the node died);
a frame that stalls mid-way for ``idle_timeout_s`` ends its connection.

tcp grants (common/capabilities.py): once the master has handed this node its key
(:meth:`DataServer.set_grant_key`, at MountSegment), a READ, WRITE, RESERVE or SEAL of an
extent inside a segment is served only under the master's grant for exactly that operation
and extent, unexpired; a WRITE spends its grant. Refused DENIED before a byte is touched.

shm hand-off: a listening unix stream socket in the Linux abstract namespace, answered only for
peers trusted by SO_PEERCRED (:class:`DataLimits` ``shm_writers``/``shm_readers``; DENIED for
anyone else). A same-host client sends a segment id (``!H`` length + utf-8, or'ed with
``HANDOFF_WRITABLE`` for the writable fd, writers only; :data:`kvpool.net.data_port.
HANDOFF_REQUEST`); the reply is a ``frames.RESPONSE`` header: status OK with the segment size
as its length field and the segment's memfd attached (SCM_RIGHTS; a read-only one unless the
writable fd was asked for), or an error status followed by a utf-8 message. The
client keeps the connection open: it may ask for more segments on it, and its EOF tells the
client that this node died. The server never sends anything unsolicited.

Client misbehaviour (bounds, malformed frames, disconnects) is logged as a fact, never as a
traceback, and only costs that client its connection.
"""

from __future__ import annotations

import collections
import errno
import os
import resource
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Self

from kvpool.common import capabilities
from kvpool.common.checksum import checksum
from kvpool.common.logging import RateLimited, get_logger
from kvpool.common.loops import OnCrash, Supervisor
from kvpool.common.tenants import tenant_of
from kvpool.common.types import ObjectRecord, Reservation
from kvpool.net.data_port import (
    GRANT_BYTES,
    HANDOFF_BOARD,
    HANDOFF_INDEX,
    HANDOFF_RECORD,
    HANDOFF_REQUEST,
    HANDOFF_RESERVE,
    HANDOFF_SEAL,
    HANDOFF_WRITABLE,
    HELD_TRAILER,
    MAGIC_GRANTED,
    MAX_SEGMENT_ID_BYTES,
    QP_INFO,
    REQUEST,
    RKEY,
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
from kvpool.net import seal_board
from kvpool.net.sockets import FrameReader, PeerClosed, Spinner, send_all
from kvpool.store_node.manifest import Board, Manifest, SealConflict, StaleEpoch
from kvpool.store_node.memory import Segment
from kvpool.store_node.rdma import RegionRefused

log = get_logger(__name__)
# What clients get wrong, once per request: a few lines a minute per kind, then counts.
client_errors = RateLimited(log)

_LINGER_S = 2.0          # how long to drain a refused client before closing (see _linger_close)
_JOIN_TIMEOUT_S = 5.0
# How long a worker waits for a connection's next frame before handing it back to the idle
# poller: longer than a client's gap between two calls of a busy loop (a master round trip),
# so a busy connection keeps its worker, and short enough that an idle one costs no thread.
_LINGER_WORK_MS = 20
# Frames whose client sends its next frame at once (a WRITE's bytes behind its RESERVE, the
# SEAL behind a WRITE, once its checksum is done): only after these does a worker poll for the
# next frame ($KVPOOL_SPIN_US). After any other answer the client's next frame comes after a
# master round trip at least, and a node polling through it takes a core from that client and
# the master (README "Security's cost": on two cores a 64 KiB tcp get was ~15% slower so).
_POLL_AFTER = frozenset({Op.RESERVE, Op.WRITE})
_POLL_AFTER_HANDOFF = frozenset({HANDOFF_RESERVE})
_RECORD_OK = encode_response(FrameStatus.OK, 0)   # a RESERVE's or SEAL's answer
# Answers held back (_Conn.answer) go out once this many bytes or buffers are held.
_HELD_MAX_BYTES = 4 << 20
_HELD_MAX_PARTS = 128
_FD_HEADROOM = 128       # fds kept for segments, the master's channel, logs (see _fit_fd_limit)
_IN = select.EPOLLIN | select.EPOLLONESHOT
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


def _recv_exact(reader: FrameReader, view: memoryview, *, frame_started: bool) -> None:
    """Fill ``view`` from ``reader``'s socket; raise _Disconnected on EOF."""
    try:
        reader.read_into(view, "client")
    except PeerClosed as exc:
        raise _Disconnected(mid_frame=frame_started or exc.received > 0) from None


@dataclass(frozen=True, slots=True)
class DataLimits:
    """What one store node's data server allows (``kvpool store-node`` flags).

    ``max_connections``: tcp and shm connections at once (default 4096, lowered to fit the
    process's fd limit); at the cap the tcp connection idle longest is closed for a new one.
    ``idle_timeout_s``: a tcp connection with no request for this long is closed (default 120
    s; clients reconnect on their next call), and a frame stalled mid-way as long ends its
    connection.
    ``shm_writers`` / ``shm_readers``: the shm hand-off's peers by SO_PEERCRED, as ``"uid:N"``
    or ``"gid:N"`` (the peer's primary gid). Writers get the writable fd (and may RESERVE and
    SEAL), readers only a read-only fd; anyone else is refused. The node's own uid and root
    are always writers (both can read and write the node's memory anyway); by default nobody
    else is trusted.
    """

    max_connections: int = 4096
    idle_timeout_s: float = 120.0
    shm_writers: tuple[str, ...] = ()
    shm_readers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for spec in (*self.shm_writers, *self.shm_readers):
            parse_peer(spec)
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {self.max_connections}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be positive, not {self.idle_timeout_s}")


def parse_peer(spec: str) -> tuple[str, int]:
    """``"uid:N"`` or ``"gid:N"`` as ("uid"|"gid", N); ValueError saying what is expected."""
    kind, _, number = spec.partition(":")
    if kind not in ("uid", "gid") or not number.isdigit():
        raise ValueError(f"shm peer {spec!r}: expected uid:N or gid:N")
    return kind, int(number)


class _ShmTrust:
    """Who gets which hand-off: WRITE (the writable fd, records), READ (a read-only fd), or
    NONE, from a peer's SO_PEERCRED."""

    NONE, READ, WRITE = 0, 1, 2

    def __init__(self, writers: tuple[str, ...], readers: tuple[str, ...]) -> None:
        self._write = {parse_peer(s) for s in writers} | {("uid", os.getuid()), ("uid", 0)}
        self._read = {parse_peer(s) for s in readers}

    def of(self, uid: int, gid: int) -> int:
        ids = {("uid", uid), ("gid", gid)}
        if ids & self._write:
            return self.WRITE
        return self.READ if ids & self._read else self.NONE


class _GrantChecker:
    """Checks a request's grant (common/capabilities.py) against the master's key, and
    remembers spent write grants until they expire: one WRITE per grant."""

    def __init__(self) -> None:
        self._signer: capabilities.Signer | None = None
        self._lock = threading.Lock()
        # A spent grant's MAC -> its expiry (unix ms), in the order spent.
        self._spent: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def set_key(self, key: bytes) -> None:
        with self._lock:
            if self._signer is None or key != self._signer.key:
                self._spent.clear()
                self._signer = capabilities.Signer(key) if key else None

    def denied(self, op: Op, grant: bytes, segment_id: bytes, offset: int, length: int,
               key: str = "") -> str:
        """Why ``op`` on the extent is refused ("" if it is allowed); a WRITE spends it. A
        RESERVE or SEAL needs the write grant's record tag for the record's ``key``."""
        signer = self._signer
        if signer is None:
            return ""
        if not grant:
            return "this node serves only extents the master granted: the request has no grant"
        if op is Op.READ or op is Op.WRITE or op is Op.READ_HELD:
            _version, why = signer.check(grant, op.value, segment_id, offset, length)
        else:
            _version, why = signer.check(grant, capabilities.RECORD, segment_id, offset,
                                         length, key=key.encode())
        if why or op is not Op.WRITE:
            return why
        _version, expiry, tag = capabilities.GRANT.unpack(grant)
        with self._lock:
            if tag in self._spent:
                return "this write grant was spent: an extent is written once per put"
            self._spent[tag] = expiry
        return ""

    def forget_expired(self) -> None:
        """Forget the spent grants that expired, the oldest spent first, up to the first one
        that has not: its own expiry refuses an expired grant. One spent later may expire
        sooner (grants last as long as their put's hold, a slot's longer); it stays until
        those before it go. What this costs is what expired, not all that is spent: a scan
        of all of them (2,500 puts/s, one minute's grants: 150,000) held the GIL ~10 ms a
        second, every connection's frames waiting."""
        now_ms = time.time() * 1000
        with self._lock:
            spent = self._spent
            while spent:
                tag, expiry = next(iter(spent.items()))
                if expiry >= now_ms:
                    return
                del spent[tag]


class _Conn:
    """One client connection and what serving it keeps between frames."""

    __slots__ = ("board", "busy", "fd", "header", "held", "held_bytes", "keep_open",
                 "last_active", "next_frame", "peer", "poll_next", "queue_pairs", "reader", "shm",
                 "shake", "sid_buf", "sock", "trust")

    def __init__(self, sock: socket.socket, peer: str, shm: bool, trust: int) -> None:
        self.sock, self.fd, self.peer, self.shm, self.trust = sock, sock.fileno(), peer, shm, trust
        self.busy = False                  # a worker holds it (not in the idle poller)
        self.shake = isinstance(sock, ssl.SSLSocket)   # its TLS handshake is still to come
        self.last_active = time.monotonic()
        # A trusted shm link is exempt from the idle timeout and from eviction (its EOF tells
        # the client that the node died); an untrusted one waits to be refused, or times out.
        self.keep_open = shm and trust != _ShmTrust.NONE
        self.header = bytearray(HANDOFF_REQUEST.size if shm else REQUEST.size)
        self.sid_buf = bytearray(MAX_SEGMENT_ID_BYTES)
        self.queue_pairs: list = []        # RDMA queue pairs set up on it: die with it
        # A worker polls a while for the client's next frame before it sleeps on it
        # ($KVPOOL_SPIN_US) where that frame follows at once (``poll_next``: _POLL_AFTER).
        # Every read of the socket: a frame in one or two. A RESERVE's or SEAL's answer, and
        # a READ's from a segment that lends views of its bytes, is held back while the
        # client's next frame is read already (``held``: the buffers, in order): a batch of
        # them pipelined is answered in one send, not one each (sent before anything else
        # is, and before the worker waits for the client: :meth:`flush`).
        self.held: list[bytes | memoryview] = []
        self.held_bytes = 0
        self.reader = FrameReader(sock, before_wait=self.flush)
        self.next_frame = Spinner(sock, reader=self.reader)
        self.poll_next = False
        self.board: Board | None = None    # its seal board (shm writers: net/seal_board.py)

    def answer_record(self) -> None:
        """A RESERVE or SEAL taken: its OK, sent at once unless the next frame is read
        already (then with that one's answer, or before the worker next waits)."""
        self.answer(_RECORD_OK)

    def answer(self, *parts: bytes | memoryview) -> None:
        """An answer of ``parts``, held back as :meth:`answer_record`'s is (sent at once past
        ``_HELD_MAX_BYTES`` held, or ``_HELD_MAX_PARTS`` buffers)."""
        self.held += parts
        self.held_bytes += sum(len(p) for p in parts)
        if not self.reader.pending() or self.held_bytes >= _HELD_MAX_BYTES \
                or len(self.held) >= _HELD_MAX_PARTS:
            self.flush()

    def flush(self) -> None:
        """Send the answers held back."""
        if self.held:
            held, self.held, self.held_bytes = self.held, [], 0
            send_all(self.sock, held)


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
    without one). ``limits``: connections and idle timeout (:class:`DataLimits`). ``tls``:
    the tcp port speaks TLS under it (net/data_tls.py ``server_context``; the shm hand-off
    does not).
    """

    def __init__(self, segments: Mapping[str, Segment], host: str = "127.0.0.1", port: int = 0,
                 shm: bool = True, rdma=None, supervisor: Supervisor | None = None,
                 manifest: Manifest | None = None, limits: DataLimits | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self._segments = segments
        self._tls = tls
        self._manifest = manifest   # takes writers' RESERVE and SEAL; None: refused
        self._rdma = rdma
        self._counts: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self._host = host
        self._port = port
        self._shm = shm
        self.tcp_endpoint = ""
        self.shm_endpoint = ""
        self._limits = limits or DataLimits()
        self._max_connections = self._limits.max_connections
        self._trust = _ShmTrust(self._limits.shm_writers, self._limits.shm_readers)
        self._grants = _GrantChecker()
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}      # by fd
        self._epoll: select.epoll | None = None
        self._workers: ThreadPoolExecutor | None = None
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
        self._max_connections = _fit_fd_limit(self._limits.max_connections)
        self._epoll = select.epoll()
        # Threads only for connections with a request in flight: at most one per connection.
        self._workers = ThreadPoolExecutor(self._max_connections, thread_name_prefix="kvpool-data")
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
            conns = list(self._conns.values())
        for c in conns:
            # shutdown (not close) wakes a worker blocked in recv/send on it without racing
            # against fd reuse; the worker (or, for an idle one, _drop below) closes it.
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._workers is not None:
            self._workers.shutdown(wait=True, cancel_futures=True)
        for c in conns:
            self._drop(c)
        if self._epoll is not None:
            self._epoll.close()
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

    def set_grant_key(self, key: bytes) -> None:
        """The key the master signs this node's grants with (MountSegment): from now on a
        tcp READ, WRITE, RESERVE or SEAL is served only with a grant under it. Empty: none
        (every request served, as before grants)."""
        self._grants.set_key(key)

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
            shm = sum(c.shm for c in self._conns.values())
            return {"tcp": len(self._conns) - shm, "shm": shm}

    def _count(self, op: str, nbytes: int = 0) -> None:
        with self._lock:
            self._counts[op] += 1
            if nbytes:
                self._bytes[op] += nbytes

    # ---------------------------------------------------------------- accepting

    def _accept_loop(self) -> None:
        """Accept new connections, hand connections with a request to a worker, and close the
        ones idle too long; the one thread that waits on every idle connection."""
        epoll = self._epoll
        listeners = {self._tcp_listener.fileno(): self._tcp_listener}
        if self._shm_listener is not None:
            listeners[self._shm_listener.fileno()] = self._shm_listener
        for fd in (*listeners, self._wake_r):
            try:
                epoll.register(fd, select.EPOLLIN)
            except FileExistsError:   # registered by a previous run of this loop (a restart)
                pass
        sweep_every = min(1.0, self._limits.idle_timeout_s / 4)
        next_sweep = time.monotonic() + sweep_every
        while not self._stopping.is_set():
            try:
                events = epoll.poll(max(0.0, next_sweep - time.monotonic()))
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd in listeners:
                    self._accept(listeners[fd])
                elif fd != self._wake_r:
                    self._dispatch(fd)
            if time.monotonic() >= next_sweep:
                self._close_idle()
                self._grants.forget_expired()
                if self._rdma is not None:
                    self._rdma.expire()
                next_sweep = time.monotonic() + sweep_every

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, addr = listener.accept()
        except OSError as exc:  # e.g. ECONNABORTED, EMFILE: keep serving the others
            log.warning("accept_failed", error=str(exc))
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.1)
            return
        shm = sock.family == socket.AF_UNIX
        peer = _peer_name(sock, addr)
        if len(self._conns) >= self._max_connections and not self._evict_one():
            client_errors.warning("connection_refused", kind="max_connections", peer=peer,
                                  max_connections=self._max_connections)
            sock.close()
            return
        # A frame stalled mid-way ends the connection. Kernel timeouts on a blocking socket,
        # not settimeout: that makes it non-blocking, and a 2 MiB READ reply then takes a
        # poll and a partial send per socket buffer instead of one sendmsg.
        stall = struct.pack("ll", int(self._limits.idle_timeout_s),
                            int(self._limits.idle_timeout_s % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, stall)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, stall)
        if not shm:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:   # the handshake is a worker's, not this thread's
                sock = self._tls.wrap_socket(sock, server_side=True,
                                             do_handshake_on_connect=False)
        c = _Conn(sock, peer, shm, self._trust.of(*_peer_ids(sock)) if shm else _ShmTrust.NONE)
        with self._lock:
            if self._stopping.is_set():
                sock.close()
                return
            self._conns[c.fd] = c
        self._epoll.register(c.fd, _IN)

    def _dispatch(self, fd: int) -> None:
        """A request (or EOF) arrived on an idle connection: a worker serves it."""
        with self._lock:
            c = self._conns.get(fd)
            if c is None or c.busy:
                return
            c.busy = True
        try:
            self._workers.submit(self._work, c)
        except RuntimeError:   # shut down: stop() closes it
            pass

    def _evict_one(self) -> bool:
        """Close the tcp connection idle longest to make room for a new one; False if every
        connection is busy or kept open."""
        with self._lock:
            idle = [c for c in self._conns.values() if not c.busy and not c.keep_open]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.last_active)
        client_errors.warning("idle_connection_evicted", kind="max_connections",
                              peer=victim.peer, max_connections=self._max_connections)
        self._drop(victim)
        return True

    def _close_idle(self) -> None:
        deadline = time.monotonic() - self._limits.idle_timeout_s
        with self._lock:
            stale = [c for c in self._conns.values()
                     if not c.busy and not c.keep_open and c.last_active < deadline]
        for c in stale:
            log.debug("idle_connection_closed", peer=c.peer)
            self._drop(c)

    def _drop(self, c: _Conn) -> None:
        """Forget and close a connection no worker holds. Idempotent."""
        with self._lock:
            if self._conns.get(c.fd) is not c:
                return
            del self._conns[c.fd]
        try:
            self._epoll.unregister(c.fd)
        except (OSError, ValueError):   # never registered, or the poller is closed
            pass
        for qp in c.queue_pairs:
            qp.close()
        if self._rdma is not None:
            self._rdma.release(c)
        if c.board is not None:   # what its writer sealed there is the node's to keep
            if self._manifest is not None:
                self._manifest.release_board(c.board)
            c.board.close()
        c.sock.close()

    def _work(self, c: _Conn) -> None:
        """Serve ``c``'s frames while they keep coming, then hand it back to the idle poller
        (or close it: the client left, broke the framing, or the node is stopping)."""
        serve = self._shm_frame if c.shm else self._tcp_frame
        keep = False
        try:
            if c.shake:
                c.sock.do_handshake()
                c.shake = False
            while serve(c) and not self._stopping.is_set():
                if not ((c.poll_next and c.next_frame.wait())
                        or c.next_frame.readable_within(_LINGER_WORK_MS)):
                    keep = True
                    break
        except _Disconnected as exc:
            if not self._stopping.is_set():
                log.debug("client_disconnected", peer=c.peer, mid_frame=exc.mid_frame)
        except OSError as exc:   # reset, or a frame stalled past the idle timeout
            if not self._stopping.is_set():
                log.debug("client_connection_lost", peer=c.peer, error=str(exc))
        except Exception:  # a bug here, not client misbehaviour: say so loudly, keep serving
            log.exception("connection_handler_failed", peer=c.peer)
        if keep and not self._stopping.is_set():
            with self._lock:
                c.busy = False
                c.last_active = time.monotonic()
            try:
                self._epoll.modify(c.fd, _IN)
                return
            except (OSError, ValueError):   # stop() closed the poller meanwhile
                pass
        with self._lock:
            c.busy = False
        self._drop(c)

    # ---------------------------------------------------------------- tcp data port

    def _tcp_frame(self, c: _Conn) -> bool:
        """Serve one data-port frame of ``c``; False if the connection must end."""
        conn, peer, header, reader = c.sock, c.peer, c.header, c.reader
        _recv_exact(reader, memoryview(header), frame_started=False)
        magic, op, sid_len, offset, length = REQUEST.unpack(header)
        c.poll_next = op in _POLL_AFTER
        if op != Op.RESERVE and op != Op.SEAL and op != Op.READ:
            c.flush()   # answers go in order (a READ's is held too: _serve_by_segment)
        if reason := malformed_request(magic, op, sid_len, offset, length):
            self._refuse_malformed(c, reason)
            return False
        granted = magic == MAGIC_GRANTED
        if op == Op.CONNECT_QP:
            self._count(Op.CONNECT_QP.name)
            if not self._connect_qp(c):
                return False
            # The client keeps this connection for the queue pair's life: never idle-closed.
            c.keep_open = bool(c.queue_pairs)
            return True
        sid_view = memoryview(c.sid_buf)[:sid_len]
        _recv_exact(reader, sid_view, frame_started=True)
        sid_bytes = sid_view.tobytes()
        try:
            segment_id = sid_bytes.decode("utf-8")
        except UnicodeDecodeError:
            self._refuse_malformed(c, "segment id is not utf-8")
            return False
        grant = _recv_bytes(reader, GRANT_BYTES) if granted else b""
        op = Op(op)
        if op is Op.RKEY_READ or op is Op.RKEY_WRITE:
            self._grant_region(c, op, segment_id, sid_bytes, offset, length, grant)
            return True
        if op is Op.READ_HELD:
            self._read_held(conn, segment_id, sid_bytes, offset, length, grant)
            return True
        if op in (Op.RESERVE, Op.SEAL):
            got = recv_record(lambda n: _recv_bytes(reader, n))
            if isinstance(got, str):
                self._refuse_malformed(c, got)
                return False
            self._count(op.name)
            why = self._grants.denied(op, grant, sid_bytes, offset, length, got[1].key)
            if why and op is Op.SEAL:
                slot_why = self._slot_denied(op, grant, segment_id, sid_bytes, offset, length,
                                             got[1].key)
                why = why if slot_why is None else slot_why
            if why:
                status, message = FrameStatus.DENIED, why
            else:
                status, message = self._take_record(op, segment_id, offset, length, got[1])
            if status is FrameStatus.OK:
                c.answer_record()
                return True
            c.flush()
            client_errors.warning("put_record_refused", kind=status.name, peer=peer,
                                  op=op.name, key=got[1].key, reason=message)
            send_refusal(conn, status, message)
            if op is Op.RESERVE:
                # Its WRITE may follow on the stream: no byte of it may land.
                _linger_close(conn)
                return False
            return True
        # Grants are checked for a request the node could serve: one outside any segment is
        # refused as before (a segment's size is no secret: the master hands it out).
        segment = self._segments.get(segment_id)
        servable = segment is not None and offset + length <= segment.info.size_bytes
        why = self._grants.denied(op, grant, sid_bytes, offset, length) if servable else ""
        if why and op is Op.WRITE:
            slot_why = self._slot_denied(op, grant, segment_id, sid_bytes, offset, length)
            why = why if slot_why is None else slot_why
        if not why and self._serve_by_segment(c, op, segment_id, offset, length):
            self._count(op.name, length)
            return True
        self._count(op.name)
        c.flush()
        status, message = (FrameStatus.DENIED, why) if why else \
            self._refusal(segment_id, offset, length)
        client_errors.warning("request_refused", kind=status.name, peer=peer, op=op.name,
                              segment=segment_id, offset=offset, length=length,
                              status=status.name)
        send_refusal(conn, status, message)
        if op is Op.WRITE:
            # The payload follows on the stream; we will not consume it frame by frame.
            _linger_close(conn)
            return False
        return True

    def _read_held(self, conn: socket.socket, segment_id: str, sid_bytes: bytes, offset: int,
                   length: int, grant: bytes) -> None:
        """A READ_HELD (net/data_port.py): the object the manifest holds at ``offset`` with the
        grant's version, within the granted extent; its bytes, then whether it stood all
        along."""
        why = self._grants.denied(Op.READ_HELD, grant, sid_bytes, offset, length)
        if why:
            self._count(Op.READ_HELD.name)
            return send_refusal(conn, FrameStatus.DENIED, why)
        version = capabilities.GRANT.unpack(grant)[0] if len(grant) == GRANT_BYTES else 0
        segment = self._segments.get(segment_id)
        held = None if self._manifest is None or not version or segment is None else \
            self._manifest.held(segment_id, offset, length, version)
        try:
            if held is not None:
                segment.send_to(conn, offset, held[1],
                                encode_response(FrameStatus.OK, held[1] + HELD_TRAILER.size))
        except ValueError:   # closed by an unmount since the lookup: nothing was sent
            held = None
        self._count(Op.READ_HELD.name, 0 if held is None else held[1])
        if held is None:
            return send_refusal(conn, FrameStatus.NOT_HELD,
                                f"this node holds no object of version {version} at {offset} "
                                f"of segment {segment_id!r}")
        conn.sendall(HELD_TRAILER.pack(1 if self._manifest.still_held(held[0]) else 0))

    def _slot_denied(self, op: Op, grant: bytes, segment_id: str, sid_bytes: bytes,
                     offset: int, length: int, key: str = "") -> str | None:
        """Why a WRITE or SEAL into a writer's slot (client/slots.py) is refused ("" if it is
        allowed; None: no slot is reserved there): its grant names the whole slot, which the
        writer reserved here with it, and its placeholder key. The write may be shorter; the
        seal may name any other key of the placeholder's tenant."""
        manifest = self._manifest
        res = manifest.reservation_at(segment_id, offset) if manifest is not None else None
        if res is None or not res.key or length > res.size or key == res.key:
            return None
        if op is Op.SEAL and tenant_of(key)[0] != tenant_of(res.key)[0]:
            return f"{key!r} is not a key of the slot's tenant"
        return self._grants.denied(op, grant, sid_bytes, offset, res.size,
                                   res.key if op is Op.SEAL else "")

    def _grant_region(self, c: _Conn, op: Op, segment_id: str, sid_bytes: bytes, offset: int,
                      length: int, grant: bytes) -> None:
        """Answer an RKEY_READ or RKEY_WRITE: a memory region over exactly the granted extent
        (store_node/rdma.py), or a refusal; the connection stays usable either way."""
        self._count(op.name)
        write = op is Op.RKEY_WRITE
        segment = self._segments.get(segment_id)
        if segment is None or offset + length > segment.info.size_bytes or not length:
            status, message = self._refusal(segment_id, offset, length) if length else (
                FrameStatus.OUT_OF_BOUNDS, "an empty extent has no region")
        elif why := self._grants.denied(Op.WRITE if write else Op.READ, grant, sid_bytes,
                                        offset, length):
            status, message = FrameStatus.DENIED, why
        elif self._rdma is None:
            status, message = FrameStatus.UNSUPPORTED, "this node has no RDMA device"
        else:
            expiry = capabilities.GRANT.unpack(grant)[1] if grant else None
            try:
                addr, rkey = self._rdma.region(c, segment_id, offset, length, write, expiry)
            except RegionRefused as exc:
                status, message = FrameStatus.UNSUPPORTED, str(exc)
            except Exception as exc:  # noqa: BLE001 - pyverbs errors: refuse, keep serving
                log.warning("region_refused", peer=c.peer, segment=segment_id, error=str(exc))
                status, message = FrameStatus.UNSUPPORTED, f"registering the region failed: {exc}"
            else:
                send_reply(c.sock, FrameStatus.OK, RKEY.pack(addr, rkey))
                return
        client_errors.warning("request_refused", kind=status.name, peer=c.peer, op=op.name,
                              segment=segment_id, offset=offset, length=length,
                              status=status.name)
        send_refusal(c.sock, status, message)

    def _connect_qp(self, c: _Conn) -> bool:
        """Answer a CONNECT_QP; False if the connection was refused and must end."""
        conn, peer, queue_pairs = c.sock, c.peer, c.queue_pairs
        payload = bytearray(QP_INFO.size)
        _recv_exact(c.reader, memoryview(payload), frame_started=True)
        if self._rdma is None:
            reply, status = b"this node has no RDMA device", FrameStatus.UNSUPPORTED
        else:
            try:
                reply, qp = self._rdma.accept(bytes(payload))
                queue_pairs.append(qp)
                status = FrameStatus.OK
            except ValueError as exc:
                self._refuse_malformed(c, str(exc))
                return False
            except Exception as exc:  # noqa: BLE001 - pyverbs errors: refuse, keep serving
                log.warning("queue_pair_refused", peer=peer, error=str(exc))
                reply = f"queue pair setup failed: {exc}".encode()
                status = FrameStatus.UNSUPPORTED
        send_reply(conn, status, reply)
        if status == FrameStatus.OK:
            log.debug("queue_pair_connected", peer=peer)
        return True

    def _serve_by_segment(self, c: _Conn, op: Op, segment_id: str, offset: int,
                          length: int) -> bool:
        """Serve a request with the segment's I/O (Segment.send_to / recv_from: a slice of
        the mapping, sendfile(2) on disk, staging for HBM). False, with nothing moved, if
        the segment is not mounted (or an unmount closed it meanwhile) or the range is
        outside it: the caller refuses the request."""
        segment, conn = self._segments.get(segment_id), c.sock
        if segment is None or offset + length > segment.info.size_bytes:
            return False
        try:
            if op is Op.READ:
                # Held back with the answers to the frames that follow at once, where the
                # segment lends a view of its bytes: one send for a run of pipelined READs.
                view = segment.view_to_send(offset, length)
                if view is not None:
                    c.answer(encode_response(FrameStatus.OK, length), view)
                else:
                    c.flush()
                    segment.send_to(conn, offset, length, encode_response(FrameStatus.OK, length))
            else:
                segment.recv_from(lambda v: _recv_exact(c.reader, v, frame_started=True),
                                  offset, length)
                conn.sendall(encode_response(FrameStatus.OK, 0))
        except ValueError:   # closed by an unmount since the lookup
            return False
        return True

    def _take_record(self, op: Op, segment_id: str, offset: int, length: int,
                     record: PutRecord, board: Board | None = None) -> tuple[FrameStatus, str]:
        """A writer's RESERVE (before it writes) or SEAL (after: the bytes are checked against
        the record's CRC-32C first) into the manifest (store_node/manifest.py); the status
        and message to answer. ``board``: the shm writer's seal board, for a RESERVE that
        names a cell of it."""
        if self._manifest is None:
            return FrameStatus.UNSUPPORTED, "this node keeps no manifest"
        if record.cell is not None and (op is not Op.RESERVE or board is None
                                        or not 0 <= record.cell < seal_board.CELLS):
            return FrameStatus.BAD_REQUEST, (f"cell {record.cell} of no seal board this "
                                             "connection was given, or not in a RESERVE")
        segment = self._segments.get(segment_id)
        if length <= 0:
            return FrameStatus.OUT_OF_BOUNDS, "a put's extent cannot be empty"
        if segment is None or offset + length > segment.info.size_bytes:
            return self._refusal(segment_id, offset, length)
        try:
            if op is Op.RESERVE:
                until = time.monotonic() + record.hold_s
                self._manifest.reserve(
                    record.epoch, Reservation(record.key, segment_id, offset, length, until),
                    record.version, None if record.cell is None else (board, record.cell))
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
        except SealConflict as e:
            return FrameStatus.CONFLICT, str(e)
        return FrameStatus.OK, ""

    def _refusal(self, segment_id: str, offset: int, length: int) -> tuple[FrameStatus, str]:
        """Why a request that :meth:`_serve_by_segment` did not serve is refused."""
        segment = self._segments.get(segment_id)
        if segment is None or offset + length <= segment.info.size_bytes:
            return FrameStatus.UNKNOWN_SEGMENT, f"segment {segment_id!r} is not mounted here"
        return FrameStatus.OUT_OF_BOUNDS, (f"[{offset}, {offset + length}) is outside segment "
                                           f"{segment_id!r} of {segment.info.size_bytes} bytes")

    def _refuse_malformed(self, c: _Conn, reason: str) -> None:
        """BAD_REQUEST, after the answers held back (in order), then close."""
        c.flush()
        client_errors.warning("malformed_frame", peer=c.peer, reason=reason)
        send_refusal(c.sock, FrameStatus.BAD_REQUEST, reason)
        _linger_close(c.sock)

    # ---------------------------------------------------------------- shm hand-off

    def _shm_frame(self, c: _Conn) -> bool:
        """Serve one hand-off socket frame of ``c``; False if the connection must end."""
        conn, peer, length_buf = c.sock, c.peer, c.header
        _recv_exact(c.reader, memoryview(length_buf), frame_started=False)
        if c.trust == _ShmTrust.NONE:
            self._refuse_handoff(conn, peer, FrameStatus.DENIED,
                                 "this node does not trust your uid/gid with its shared memory "
                                 "(kvpool store-node --shm-writer/--shm-reader)", close=True)
            return False
        (sid_len,) = HANDOFF_REQUEST.unpack(length_buf)
        c.poll_next = sid_len in _POLL_AFTER_HANDOFF
        if sid_len != HANDOFF_RESERVE and sid_len != HANDOFF_SEAL:
            c.flush()   # answers go in order
        if sid_len == HANDOFF_INDEX:
            return self._hand_index(c)
        if sid_len in (HANDOFF_RESERVE, HANDOFF_SEAL, HANDOFF_BOARD):
            if c.trust != _ShmTrust.WRITE:
                self._refuse_handoff(conn, peer, FrameStatus.DENIED, "only a trusted writer "
                                     "may reserve or seal over shm", close=True)
                return False
            if sid_len == HANDOFF_BOARD:
                return self._hand_board(c)
            return self._serve_shm_record(c, sid_len)
        writable = bool(sid_len & HANDOFF_WRITABLE)
        sid_len &= ~HANDOFF_WRITABLE
        if reason := check_segment_id_length(sid_len):
            self._refuse_handoff(conn, peer, FrameStatus.BAD_REQUEST, reason, close=True)
            return False
        sid_buf = bytearray(sid_len)
        _recv_exact(c.reader, memoryview(sid_buf), frame_started=True)
        try:
            segment_id = sid_buf.decode("utf-8")
        except UnicodeDecodeError:
            self._refuse_handoff(conn, peer, FrameStatus.BAD_REQUEST,
                                 "segment id is not utf-8", close=True)
            return False
        if writable and c.trust != _ShmTrust.WRITE:
            self._refuse_handoff(conn, peer, FrameStatus.DENIED,
                                 "this node trusts your uid/gid to read its shared memory, "
                                 "not to write it")
            return True
        segment = self._segments.get(segment_id)
        fd = -1
        if segment is not None:
            try:
                fd = segment.fd if writable else segment.readonly_fd
            except ValueError:   # closed while being unmounted
                segment = None
        if segment is None:
            self._refuse_handoff(conn, peer, FrameStatus.UNKNOWN_SEGMENT,
                                 f"segment {segment_id!r} is not mounted here")
            return True
        if fd < 0:
            self._refuse_handoff(conn, peer, FrameStatus.BAD_REQUEST,
                                 f"segment {segment_id!r} cannot be shared by fd")
            return True
        self._count("HANDOFF")
        _hand_fd(conn, segment.info.size_bytes, fd)
        log.debug("segment_fd_handed_off", peer=peer, segment=segment_id)
        return True

    def _hand_board(self, c: _Conn) -> bool:
        """The connection's seal board (net/seal_board.py), made on its first asking."""
        if self._manifest is None:
            self._refuse_handoff(c.sock, c.peer, FrameStatus.UNSUPPORTED,
                                 "this node keeps no manifest")
            return True
        if c.board is None:
            c.board = Board(*seal_board.create())
        _hand_fd(c.sock, seal_board.BOARD_BYTES, c.board.fd)
        return True

    def _hand_index(self, c: _Conn) -> bool:
        """The node's index of its committed objects (net/shm_index.py), read-only."""
        index = None if self._manifest is None else self._manifest.index
        if index is None:
            self._refuse_handoff(c.sock, c.peer, FrameStatus.UNSUPPORTED,
                                 "this node keeps no shm index")
            return True
        _hand_fd(c.sock, index.size, index.readonly_fd)
        return True

    def _serve_shm_record(self, c: _Conn, marker: int) -> bool:
        """A RESERVE or SEAL on the hand-off socket; False if it was malformed (the
        connection ends)."""
        conn, peer = c.sock, c.peer
        head = _recv_bytes(c.reader, HANDOFF_RECORD.size)
        sid_len, offset, length = HANDOFF_RECORD.unpack(head)
        if reason := check_segment_id_length(sid_len):
            c.flush()
            self._refuse_handoff(conn, peer, FrameStatus.BAD_REQUEST, reason, close=True)
            return False
        got = recv_record(lambda n: _recv_bytes(c.reader, n), sid_len=sid_len)
        if isinstance(got, str):
            c.flush()
            self._refuse_handoff(conn, peer, FrameStatus.BAD_REQUEST, got, close=True)
            return False
        op = Op.RESERVE if marker == HANDOFF_RESERVE else Op.SEAL
        self._count(op.name)
        status, message = self._take_record(op, got[0], offset, length, got[1], c.board)
        if status is FrameStatus.OK:
            c.answer_record()
        else:
            c.flush()
            self._refuse_handoff(conn, peer, status, message)
        return True

    def _refuse_handoff(self, conn: socket.socket, peer: str, status: FrameStatus, message: str,
                        close: bool = False) -> None:
        client_errors.warning("handoff_refused", kind=status.name, peer=peer,
                              status=status.name, reason=message)
        send_refusal(conn, status, message)
        if close:
            _linger_close(conn)


def _recv_bytes(reader: FrameReader, n: int) -> bytes:
    try:
        return reader.read(n, "client")
    except PeerClosed:
        raise _Disconnected(mid_frame=True) from None


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


def _peer_ids(conn: socket.socket) -> tuple[int, int]:
    """A unix peer's (uid, gid) by SO_PEERCRED; (-1, -1), trusted by nobody, if unknown."""
    try:
        _pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       _UCRED.size))
    except OSError:
        return -1, -1
    return uid, gid


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


def _fit_fd_limit(max_connections: int) -> int:
    """``max_connections``, or fewer where the process's fd limit cannot hold that many plus
    ``_FD_HEADROOM``: the soft limit is raised toward the hard one first. At the fd limit the
    node could accept nothing (nor open a segment), so the cap must be reached first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + _FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        fitted = max(1, soft - _FD_HEADROOM)
        log.warning("max_connections_lowered", requested=max_connections, allowed=fitted,
                    fd_limit=soft)
        return fitted
    return max_connections


def _pipe() -> tuple[int, int]:
    return os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)


def _write_wake(fd: int) -> None:
    try:
        os.write(fd, b"x")
    except OSError:
        pass


def _hand_fd(sock: socket.socket, length: int, fd: int) -> None:
    """Answer a hand-off OK with ``length`` and ``fd`` attached (a segment, a seal board, the
    shm index)."""
    header = encode_response(FrameStatus.OK, length)
    sent = socket.send_fds(sock, [header], [fd])
    if sent < len(header):
        sock.sendall(header[sent:])
