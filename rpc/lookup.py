"""The client side of the master's lookup port (net/lookup_port.py): GetReplicas and Exists
without gRPC.

:class:`LookupChannel` keeps connections to one master's lookup port open, one per caller in
flight. :class:`Lookups` decides when to use it: once a gRPC answer named the port, until it
fails; a failed port is left alone for a while (gRPC answers the lookups meanwhile), and a port
that a master names anew (a restarted master) is tried at once.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from google.protobuf.message import Message
from kvpool.common.errors import KVPoolError, MasterUnavailable
from kvpool.net import lookup_port
from kvpool.net.lookup_port import Seal, Unsealed
from kvpool.net.sockets import FrameReader, Spinner, recv_exact, spin_default_s

# After a port failed: use gRPC alone this long before trying the same port again.
RETRY_AFTER_S = 10.0
# Connecting is the only step allowed to fail fast: a port that is not open to us (a container's
# unpublished port, a firewall that drops) must not hold up a read.
_CONNECT_TIMEOUT_S = 1.0
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
M = TypeVar("M", bound=Message)


class LookupLost(Exception):
    """The lookup port cannot answer (unreachable, hung up, refusing): ask over gRPC."""


@dataclass(frozen=True, slots=True)
class Session:
    """A lookup-port session a master opened for us (net/lookup_port.py, "Sessions")."""

    session_id: bytes
    key: bytes = field(repr=False)
    renew_at: float   # monotonic: connections of it are not used (nor made) past this


# A session is renewed this long before its end (at most a tenth of its life), so that no
# connection of it is in use when the master ends it.
_RENEW_MARGIN_S = 60.0


def session_of(answer, clock: Callable[[], float] = time.monotonic) -> Session | None:
    """The Session an OpenLookupSession answer names; None: the master seals nothing."""
    if not answer.session_id:
        return None
    return Session(answer.session_id, answer.key,
                   clock() + answer.ttl_s - min(_RENEW_MARGIN_S, answer.ttl_s / 10))


class _Connection:
    """One connection to the port: its socket, and its seals when it is a session's (``out``
    for what we send, ``inn`` for what we receive), until ``renew_at``."""

    __slots__ = ("sock", "out", "inn", "renew_at", "_sending", "_answer", "_reader")

    def __init__(self, sock: socket.socket, out: Seal | None = None, inn: Seal | None = None,
                 renew_at: float = math.inf) -> None:
        self.sock, self.out, self.inn, self.renew_at = sock, out, inn, renew_at
        self._sending = threading.Lock()   # a stream's acks come from other threads
        self._reader = FrameReader(sock)   # an answer's header and body in one read
        self._answer = Spinner(sock, reader=self._reader)   # polls a while before sleeping

    def send(self, method: int, body: bytes) -> None:
        with self._sending:
            self.sock.sendall(_request(self.out, method, body))

    def receive(self, kind: int | None = None) -> tuple[int, bytes]:
        """The next answer's (status, body); LookupLost if it does not open. ``kind``: the
        call's kind, for an answer to a call (net/sockets.py ``Spinner.wait``); not for a
        stream's frames, which come when they come."""
        self._answer.wait(kind)
        head = self._reader.read(lookup_port.RESPONSE.size, "the master")
        self._answer.arrived()
        status, length = _header(head)
        data = self._reader.read(length, "the master")
        return status, _opened(self.inn, head, data, status)

    def close(self) -> None:
        self.sock.close()


def _request(out: Seal | None, method: int, body: bytes) -> bytes:
    """A request frame, sealed with ``out`` where the connection is a session's."""
    if out is None:
        return lookup_port.encode_request(method, body)
    return out.seal(lookup_port.REQUEST, lookup_port.MAGIC, method, body=body)


def _opened(inn: Seal | None, head: bytes, data: bytes, status: int) -> bytes:
    if inn is None:
        return data
    try:
        return inn.open(head, data)
    except Unsealed:
        if status == _UNAUTHENTICATED:   # the master could not open ours (it says so in clear)
            raise LookupLost(f"the master refused a frame: {data[:200].decode('utf-8', 'replace')}"
                             ) from None
        raise LookupLost("an answer failed authentication") from None


class LookupChannel:
    """Connections to ``host:port``, the lookup port of the master at ``master``.

    ``refused(code, message, what)``: the KVPoolError for an answer with an error status (as
    for the same status over gRPC). ``sessions(master)``, where the master has credentials:
    opens a session of ours there (its OpenLookupSession over gRPC); each connection then
    starts as one of its connections, its frames sealed (net/lookup_port.py, "Sessions").
    It returns the master's OpenLookupSessionResponse."""

    def __init__(self, master: str, port: int, timeout_s: float,
                 refused: Callable[[grpc.StatusCode, str, str], KVPoolError],
                 sessions: Callable[[str], Message] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._sessions, self._clock = sessions, clock
        self._session: Session | None = None
        host = master.rpartition(":")[0]
        self.target = (master, port)
        self._endpoint = (host[1:-1] if host.startswith("[") else host, port)
        self._timeout_s, self._refused = timeout_s, refused
        self._idle: list[_Connection] = []
        # Connections of call_async, each usable only on the loop that opened it.
        self._idle_async: list[tuple[asyncio.AbstractEventLoop, _AsyncConnection]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._spins = spin_default_s() > 0   # $KVPOOL_SPIN_US=0: no polling asked for either

    def call(self, method: int, request: Message, response_type: type[M]) -> M:
        """The master's answer to ``request`` (a ``method`` of net/lookup_port.py); LookupLost if
        the port cannot give one; the KVPoolError of a refusal (InvalidArgument);
        MasterUnavailable if the master takes longer than the timeout to answer (as a gRPC
        deadline)."""
        body = request.SerializeToString()
        while True:
            conn, reused = self._connection()
            try:
                conn.send(method, body)
                # Answers to requests of one method and size take alike.
                status, answer = conn.receive(method << 8 | len(body).bit_length())
                break
            except TimeoutError:
                conn.close()
                raise self._too_slow() from None
            except OSError as e:
                conn.close()
                if not reused:
                    raise self._lost(e) from None
                # A kept connection the master dropped (it restarted on the same port, say):
                # once more on a new one. Asking twice is harmless: a lookup only leases.
            except BaseException:
                conn.close()
                raise
        self._release(conn)
        return self._answer(status, answer, response_type, "lookup")

    def spin(self, seconds: float) -> None:
        """Ask the master to keep polling for ``seconds`` (SPIN, not answered): a call follows
        after a while of the caller's own. On a kept connection only, and never an error: a
        spin is a hint."""
        if not self._spins:
            return
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            return
        try:
            conn.send(lookup_port.SPIN, lookup_port.SPIN_BODY.pack(
                min(round(seconds * 1e6), lookup_port.MAX_SPIN_US)))
        except OSError:
            conn.close()
            return
        self._release(conn)

    async def call_async(self, method: int, request: Message, response_type: type[M]) -> M:
        """:meth:`call` on the running event loop, for a caller that must not block it (the
        gateway's Route before each request it forwards): no thread hop, answers alike."""
        body = request.SerializeToString()
        while True:
            conn, reused = await self._connection_async()
            try:
                async with asyncio.timeout(self._timeout_s):
                    status, answer = await conn.call(method, body)
                break
            except TimeoutError:
                conn.close()
                raise self._too_slow() from None
            except (OSError, asyncio.IncompleteReadError) as e:
                conn.close()
                if not reused:   # a kept connection the master dropped: once more, as call
                    raise self._lost(e) from None
            except BaseException:
                conn.close()
                raise
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._closed:
                self._idle_async.append((loop, conn))
                conn = None
        if conn is not None:
            conn.close()
        return self._answer(status, answer, response_type, "lookup")

    def open_stream(self, method: int, request: Message) -> _Connection:
        """A new connection that ``request`` (a stream method: WATCH_MANIFEST) turned into a
        stream; read it with :meth:`read_stream_frame`, reply with its ``send``. LookupLost
        if the port cannot be reached."""
        conn, _ = self._connect()
        try:
            conn.send(method, request.SerializeToString())
        except OSError as e:
            conn.close()
            raise LookupLost(f"lookup port {self._endpoint[1]}: {e}") from None
        return conn

    def read_stream_frame(self, conn: _Connection, response_type: type[M]) -> M:
        """The next message of a stream opened by :meth:`open_stream`. Raises TimeoutError
        when none came within the socket's timeout, LookupLost if the port refused the stream
        as a standby does (UNAVAILABLE) or the connection broke (OSError), and the
        KVPoolError of another refusal (an unknown node: NOT_FOUND)."""
        try:
            status, body = conn.receive()
        except TimeoutError:
            raise
        except OSError as e:
            raise LookupLost(f"lookup port {self._endpoint[1]}: {e}") from None
        return self._answer(status, body, response_type, "stream")

    def _too_slow(self) -> MasterUnavailable:
        return MasterUnavailable(f"master {self.target[0]}: lookup took longer than "
                                 f"{self._timeout_s:g}s")

    def _lost(self, e: BaseException | str) -> LookupLost:
        return LookupLost(f"lookup port {self._endpoint[1]}: {e}")

    def _answer(self, status: int, body: bytes, response_type: type[M], what: str) -> M:
        if status == 0:
            return response_type.FromString(body)
        code = _STATUS.get(status, grpc.StatusCode.UNKNOWN)
        message = body.decode(errors="replace")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED):
            raise LookupLost(message)   # a standby (gRPC finds the leader); a session ended
        raise self._refused(code, message, f"master {self.target[0]}: {what}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            idle_async, self._idle_async = self._idle_async, []
        for conn in idle:
            conn.close()
        for loop, aconn in idle_async:
            if not loop.is_closed():
                loop.call_soon_threadsafe(aconn.close)

    def _connection(self) -> tuple[_Connection, bool]:
        """A connection, and whether it was kept from an earlier call."""
        now = self._clock()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if conn.renew_at > now:
                    return conn, True
                conn.close()   # its session is about to end
        return self._connect()

    def _session_for(self, stale: Session | None) -> Session | None:
        """The session to open connections with: the one held, unless it is ``stale`` (the
        master refused it) or due for renewal; LookupLost if none can be opened."""
        with self._lock:
            held = self._session
        if held is not None and held is not stale and held.renew_at > self._clock():
            return held
        try:
            session = session_of(self._sessions(self.target[0]), self._clock)
        except (KVPoolError, grpc.RpcError) as e:
            raise LookupLost(f"no lookup session: {e}") from None
        with self._lock:
            self._session = session
        return session

    def _connect(self) -> tuple[_Connection, bool]:
        stale = None
        for _ in range(2 if self._sessions is not None else 1):
            try:
                sock = socket.create_connection(self._endpoint, timeout=_CONNECT_TIMEOUT_S)
            except OSError as e:
                raise LookupLost(f"lookup port {self._endpoint[1]}: {e}") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._timeout_s)
            if self._sessions is None or (session := self._session_for(stale)) is None:
                return _Connection(sock), False
            salt = lookup_port.new_salt()
            try:
                sock.sendall(_hello(session, salt))
                status, length = _header(recv_exact(sock, lookup_port.RESPONSE.size,
                                                    "the master"))
                seals = self._welcome(session, salt, status,
                                      recv_exact(sock, length, "the master"))
            except OSError as e:
                sock.close()
                raise self._lost(f"session: {e}") from None
            except LookupLost:
                sock.close()
                raise
            if seals is not None:
                return _Connection(sock, *seals, session.renew_at), False
            sock.close()
            stale = session   # the master forgot it (restarted, or dropped it): a new one
        raise self._lost("a new session was refused too")

    def _welcome(self, session: Session, salt: bytes, status: int, answer: bytes
                 ) -> tuple[Seal, Seal] | None:
        """The seals of a connection whose SESSION frame the master answered ``status``,
        ``answer``; None if it does not know the session (open another); LookupLost if it
        refused otherwise."""
        if status == 0 and len(answer) == lookup_port.SALT_BYTES:
            return lookup_port.session_seals(session.key, salt, answer, server=False)
        if status != _UNAUTHENTICATED:
            raise self._lost(f"session refused: {answer[:200]!r}")
        return None

    async def _connection_async(self) -> tuple[_AsyncConnection, bool]:
        loop, now = asyncio.get_running_loop(), self._clock()
        with self._lock:
            for i in range(len(self._idle_async) - 1, -1, -1):
                if self._idle_async[i][0] is loop:
                    _, conn = self._idle_async.pop(i)
                    if conn.renew_at > now:
                        return conn, True
                    conn.close()
        stale = None
        for _ in range(2 if self._sessions is not None else 1):
            try:
                async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                    reader, writer = await asyncio.open_connection(*self._endpoint)
            except (OSError, TimeoutError) as e:
                raise LookupLost(f"lookup port {self._endpoint[1]}: "
                                 f"{e or 'connect timed out'}") from None
            writer.transport.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Opening a session is a gRPC call: off the loop (once in a session's life).
            if self._sessions is None or (
                    session := await asyncio.to_thread(self._session_for, stale)) is None:
                return _AsyncConnection(reader, writer), False
            salt = lookup_port.new_salt()
            try:
                async with asyncio.timeout(self._timeout_s):
                    writer.write(_hello(session, salt))
                    status, length = _header(
                        await reader.readexactly(lookup_port.RESPONSE.size))
                    seals = self._welcome(session, salt, status,
                                          await reader.readexactly(length))
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
                writer.close()
                raise self._lost(f"session: {e}") from None
            except LookupLost:
                writer.close()
                raise
            if seals is not None:
                return _AsyncConnection(reader, writer, *seals, session.renew_at), False
            writer.close()
            stale = session
        raise self._lost("a new session was refused too")

    def _release(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()


class _AsyncConnection:
    """:class:`_Connection` on an event loop."""

    __slots__ = ("reader", "writer", "out", "inn", "renew_at")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 out: Seal | None = None, inn: Seal | None = None,
                 renew_at: float = math.inf) -> None:
        self.reader, self.writer, self.out, self.inn = reader, writer, out, inn
        self.renew_at = renew_at

    async def call(self, method: int, body: bytes) -> tuple[int, bytes]:
        self.writer.write(_request(self.out, method, body))
        head = await self.reader.readexactly(lookup_port.RESPONSE.size)
        status, length = _header(head)
        return status, _opened(self.inn, head, await self.reader.readexactly(length), status)

    def close(self) -> None:
        self.writer.close()


def _hello(session: Session, salt: bytes) -> bytes:
    """A connection's first frame: it names ``session``, with the client's ``salt``."""
    return lookup_port.encode_request(lookup_port.SESSION, session.session_id + salt)


def _header(header: bytes) -> tuple[int, int]:
    """An answer's (status, body length); LookupLost past the port's limit (a sealed body's
    tag included)."""
    status, length = lookup_port.RESPONSE.unpack(header)
    if length > lookup_port.MAX_BODY_BYTES + lookup_port.TAG_BYTES:
        raise LookupLost(f"an answer of {length} bytes")
    return status, length


class Lookups:
    """Which lookup port to use, if any: learned from gRPC answers, dropped when it fails."""

    def __init__(self, timeout_s: float,
                 refused: Callable[[grpc.StatusCode, str, str], KVPoolError],
                 clock: Callable[[], float] = time.monotonic,
                 sessions: Callable[[str], Message] | None = None):
        """``sessions``: how a channel opens its session at a master with credentials (see
        LookupChannel); None: plain frames."""
        self._timeout_s, self._refused, self._clock = timeout_s, refused, clock
        self._sessions = sessions
        self._lock = threading.Lock()
        self._channel: LookupChannel | None = None
        self._learned: tuple[str, int] | None = None      # the last (master, port) named
        self._failed: dict[tuple[str, int], float] = {}   # target -> when to try it again
        self._closed = False

    @property
    def channel(self) -> LookupChannel | None:
        return self._channel

    def channel_for(self, master: str) -> LookupChannel | None:
        """The channel in use if it is ``master``'s (after a failover, the old leader's port
        is not the new one's: a paused leader would hold every call to its timeout)."""
        channel = self._channel
        return channel if channel is not None and channel.target[0] == master else None

    def wants_port(self, master: str) -> bool:
        """Whether to ask ``master`` for its lookup port (a client that only calls Exists
        never hears it otherwise): no port of its in use, none named by this master, or the
        one it named failed long enough ago to try again."""
        learned = self._learned
        return self.channel_for(master) is None and not self._closed and (
            learned is None or learned[0] != master
            or (learned[1] != 0 and self._failed.get(learned, 0.0) <= self._clock()))

    def learn(self, master: str, port: int) -> None:
        """``master`` named its lookup ``port`` (0: it has none)."""
        current = self._channel
        if current is not None and current.target == (master, port):
            return
        target = (master, port)
        with self._lock:
            self._learned = target
            if self._closed or self._failed.get(target, 0.0) > self._clock():
                return
            old, self._channel = self._channel, LookupChannel(
                master, port, self._timeout_s, self._refused, self._sessions,
                self._clock) if port else None
        if old is not None:
            old.close()

    def try_port(self, master: str, method: int, request: Message, response_type: type[M]
                 ) -> M | None:
        """``request``'s answer from ``master``'s lookup port; None if none is in use or it
        could not answer (then it is left alone for a while: ask over gRPC). Raises the
        KVPoolError of a refusal, and MasterUnavailable if the master took too long (the
        port is left alone then too)."""
        if (channel := self.channel_for(master)) is None:
            return None
        try:
            return channel.call(method, request, response_type)
        except LookupLost:
            self.lost(channel)
        except MasterUnavailable:
            self.lost(channel)
            raise
        return None

    async def try_port_async(self, master: str, method: int, request: Message,
                             response_type: type[M]) -> M | None:
        """:meth:`try_port` on the running event loop."""
        if (channel := self.channel_for(master)) is None:
            return None
        try:
            return await channel.call_async(method, request, response_type)
        except LookupLost:
            self.lost(channel)
        except MasterUnavailable:
            self.lost(channel)
            raise
        return None

    def lost(self, channel: LookupChannel) -> None:
        """``channel`` failed: gRPC only, until its master names a port again after a while."""
        with self._lock:
            now = self._clock()
            self._failed = {t: at for t, at in self._failed.items() if at > now}
            self._failed[channel.target] = now + RETRY_AFTER_S
            if self._channel is channel:
                self._channel = None
        channel.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
