"""The client side of the master's lookup port (net/lookup_port.py): GetReplicas and Exists
without gRPC.

:class:`LookupChannel` keeps connections to one master's lookup port open, one per caller in
flight. :class:`Lookups` decides when to use it: once a gRPC answer named the port, until it
fails; a failed port is left alone for a while (gRPC answers the lookups meanwhile), and a port
that a master names anew (a restarted master) is tried at once.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message
from kvpool.common.errors import KVPoolError, MasterUnavailable
from kvpool.common.security import MASTER_NAME
from kvpool.net import lookup_port
from kvpool.net.sockets import recv_exact

# After a port failed: use gRPC alone this long before trying the same port again.
RETRY_AFTER_S = 10.0
# Connecting is the only step allowed to fail fast: a port that is not open to us (a container's
# unpublished port, a firewall that drops) must not hold up a read.
_CONNECT_TIMEOUT_S = 1.0
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
M = TypeVar("M", bound=Message)


class LookupLost(Exception):
    """The lookup port cannot answer (unreachable, hung up, refusing): ask over gRPC."""


class LookupChannel:
    """Connections to ``host:port``, the lookup port of the master at ``master``.

    ``refused(code, message, what)``: the KVPoolError for an answer with an error status (as
    for the same status over gRPC). ``tls``: a client context (common/security.py) when the
    master's gRPC port is mutual TLS: the lookup port is too, with the same certificates;
    ``token``: a client without a certificate authenticates each connection with its bearer
    token instead (net/lookup_port.py AUTH)."""

    def __init__(self, master: str, port: int, timeout_s: float,
                 refused: Callable[[grpc.StatusCode, str, str], KVPoolError],
                 tls: ssl.SSLContext | None = None, token: str = ""):
        self._tls, self._token = tls, token
        host = master.rpartition(":")[0]
        self.target = (master, port)
        self._endpoint = (host[1:-1] if host.startswith("[") else host, port)
        self._timeout_s, self._refused = timeout_s, refused
        self._idle: list[socket.socket] = []
        # Connections of call_async, each usable only on the loop that opened it.
        self._idle_async: list[tuple[asyncio.AbstractEventLoop, asyncio.StreamReader,
                                     asyncio.StreamWriter]] = []
        self._lock = threading.Lock()
        self._closed = False

    def call(self, method: int, request: Message, response_type: type[M]) -> M:
        """The master's answer to ``request`` (a ``method`` of net/lookup_port.py); LookupLost if
        the port cannot give one; the KVPoolError of a refusal (InvalidArgument);
        MasterUnavailable if the master takes longer than the timeout to answer (as a gRPC
        deadline)."""
        frame = lookup_port.encode_request(method, request.SerializeToString())
        while True:
            sock, reused = self._connection()
            try:
                sock.sendall(frame)
                status, length = _header(recv_exact(sock, lookup_port.RESPONSE.size,
                                                    "the master"))
                body = recv_exact(sock, length, "the master")
                break
            except TimeoutError:
                sock.close()
                raise self._too_slow() from None
            except OSError as e:
                sock.close()
                if not reused:
                    raise self._lost(e) from None
                # A kept connection the master dropped (it restarted on the same port, say):
                # once more on a new one. Asking twice is harmless: a lookup only leases.
            except BaseException:
                sock.close()
                raise
        self._release(sock)
        return self._answer(status, body, response_type, "lookup")

    async def call_async(self, method: int, request: Message, response_type: type[M]) -> M:
        """:meth:`call` on the running event loop, for a caller that must not block it (the
        gateway's Route before each request it forwards): no thread hop, answers alike."""
        frame = lookup_port.encode_request(method, request.SerializeToString())
        while True:
            (reader, writer), reused = await self._connection_async()
            try:
                async with asyncio.timeout(self._timeout_s):
                    writer.write(frame)
                    status, length = _header(
                        await reader.readexactly(lookup_port.RESPONSE.size))
                    body = await reader.readexactly(length)
                break
            except TimeoutError:
                writer.close()
                raise self._too_slow() from None
            except (OSError, asyncio.IncompleteReadError) as e:
                writer.close()
                if not reused:   # a kept connection the master dropped: once more, as call
                    raise self._lost(e) from None
            except BaseException:
                writer.close()
                raise
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._closed:
                self._idle_async.append((loop, reader, writer))
                writer = None
        if writer is not None:
            writer.close()
        return self._answer(status, body, response_type, "lookup")

    def open_stream(self, method: int, request: Message) -> socket.socket:
        """A new connection that ``request`` (a stream method: WATCH_MANIFEST) turned into a
        stream; read it with :func:`read_stream_frame`. LookupLost if the port cannot be
        reached."""
        sock, _ = self._connect()
        try:
            sock.sendall(lookup_port.encode_request(method, request.SerializeToString()))
        except OSError as e:
            sock.close()
            raise LookupLost(f"lookup port {self._endpoint[1]}: {e}") from None
        return sock

    def read_stream_frame(self, sock: socket.socket, response_type: type[M]) -> M:
        """The next message of a stream opened by :meth:`open_stream`. Raises TimeoutError
        when none came within the socket's timeout, LookupLost if the port refused the stream
        as a standby does (UNAVAILABLE) or the connection broke (OSError), and the
        KVPoolError of another refusal (an unknown node: NOT_FOUND)."""
        try:
            header = recv_exact(sock, lookup_port.RESPONSE.size, "the master")
            status, length = lookup_port.RESPONSE.unpack(header)
            if length > lookup_port.MAX_BODY_BYTES:
                raise LookupLost(f"a stream frame of {length} bytes")
            body = recv_exact(sock, length, "the master")
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
        if code == grpc.StatusCode.UNAVAILABLE:   # e.g. a standby: gRPC finds the leader
            raise LookupLost(message)
        raise self._refused(code, message, f"master {self.target[0]}: {what}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            idle_async, self._idle_async = self._idle_async, []
        for sock in idle:
            sock.close()
        for loop, _, writer in idle_async:
            if not loop.is_closed():
                loop.call_soon_threadsafe(writer.close)

    def _connection(self) -> tuple[socket.socket, bool]:
        """A connection, and whether it was kept from an earlier call."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect()

    async def _connection_async(self) -> tuple[tuple[asyncio.StreamReader,
                                                     asyncio.StreamWriter], bool]:
        loop = asyncio.get_running_loop()
        with self._lock:
            for i in range(len(self._idle_async) - 1, -1, -1):
                if self._idle_async[i][0] is loop:
                    _, reader, writer = self._idle_async.pop(i)
                    return (reader, writer), True
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):   # the handshake included
                reader, writer = await asyncio.open_connection(
                    *self._endpoint, ssl=self._tls,
                    server_hostname=MASTER_NAME if self._tls is not None else None)
        except (OSError, TimeoutError) as e:    # ssl.SSLError included: another CA
            raise LookupLost(f"lookup port {self._endpoint[1]}: {e or 'connect timed out'}"
                             ) from None
        writer.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._token:
            try:
                async with asyncio.timeout(self._timeout_s):
                    writer.write(lookup_port.encode_request(lookup_port.AUTH,
                                                            self._token.encode()))
                    status, length = lookup_port.RESPONSE.unpack(
                        await reader.readexactly(lookup_port.RESPONSE.size))
                    message = await reader.readexactly(min(length, 4096)) if length else b""
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
                writer.close()
                raise self._lost(f"token: {e}") from None
            if status != 0:
                writer.close()
                raise self._refused_token(message)
        return (reader, writer), False

    def _connect(self) -> tuple[socket.socket, bool]:
        try:
            sock = socket.create_connection(self._endpoint, timeout=_CONNECT_TIMEOUT_S)
        except OSError as e:
            raise LookupLost(f"lookup port {self._endpoint[1]}: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            try:   # the handshake under the connect timeout too
                sock = self._tls.wrap_socket(sock, server_hostname=MASTER_NAME)
            except OSError as e:   # ssl.SSLError included: a master of another CA
                sock.close()
                raise LookupLost(f"lookup port {self._endpoint[1]}: TLS: {e}") from None
        sock.settimeout(self._timeout_s)
        if self._token:
            self._authenticate(sock)
        return sock, False

    def _authenticate(self, sock: socket.socket) -> None:
        """Send the bearer token (AUTH) and read its answer; the port is given up (LookupLost)
        unless it took it: a master without tokens (or an old one) answers with an error."""
        try:
            sock.sendall(lookup_port.encode_request(lookup_port.AUTH, self._token.encode()))
            status, length = lookup_port.RESPONSE.unpack(
                recv_exact(sock, lookup_port.RESPONSE.size, "the master"))
            message = recv_exact(sock, min(length, 4096), "the master") if length else b""
        except OSError as e:
            sock.close()
            raise self._lost(f"token: {e}") from None
        if status != 0:
            sock.close()
            raise self._refused_token(message)

    def _refused_token(self, message: bytes) -> LookupLost:
        return LookupLost(f"lookup port {self._endpoint[1]} refused the token: "
                          f"{message.decode('utf-8', 'replace')}")

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()


def _header(header: bytes) -> tuple[int, int]:
    """An answer's (status, body length); LookupLost past the port's limit."""
    status, length = lookup_port.RESPONSE.unpack(header)
    if length > lookup_port.MAX_BODY_BYTES:
        raise LookupLost(f"an answer of {length} bytes")
    return status, length


class Lookups:
    """Which lookup port to use, if any: learned from gRPC answers, dropped when it fails."""

    def __init__(self, timeout_s: float,
                 refused: Callable[[grpc.StatusCode, str, str], KVPoolError],
                 clock: Callable[[], float] = time.monotonic,
                 tls: ssl.SSLContext | None | bool = None, token: str = ""):
        """``tls``: the client context of a secure master's lookup port; None: plain tcp;
        False: never use the port (gRPC only). ``token``: a bearer token to authenticate
        with (a client without a certificate)."""
        self._timeout_s, self._refused, self._clock = timeout_s, refused, clock
        self._tls, self._token = tls or None, token
        self._lock = threading.Lock()
        self._channel: LookupChannel | None = None
        self._learned: tuple[str, int] | None = None      # the last (master, port) named
        self._failed: dict[tuple[str, int], float] = {}   # target -> when to try it again
        self._closed = tls is False

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
                master, port, self._timeout_s, self._refused, self._tls,
                self._token) if port else None
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
