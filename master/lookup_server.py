"""The master's lookup port (net/lookup_port.py): the data path's calls on a plain tcp listener,
served on the master's one event loop, like its gRPC handlers, so the state still needs no
locks. Each connection is served by its own task: a put call waiting for the store nodes holds
only its own connection."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import grpc
from google.protobuf.message import DecodeError, Message
from kvpool.common.errors import InvalidArgument, KVPoolError, UnknownNode
from kvpool.common.logging import get_logger
from kvpool.common.security import Identity, Tokens, identity_from_der
from kvpool.master.auth import Refused, check, scope, scope_answer
from kvpool.net import lookup_port

log = get_logger(__name__)

_OK = grpc.StatusCode.OK.value[0]
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]
_NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
_MAX_TOKEN_BYTES = 4096
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


Handler = Callable[[Message], Message | Awaitable[Message]]


class Stream:
    """A method that turns its connection into a stream: ``open(request)`` gives the messages
    to send as they come; each frame of method ``reply_method`` the peer sends back goes to
    ``on_reply`` (decoded as ``reply_type``), unanswered."""

    def __init__(self, request_type: type[Message],
                 open: Callable[[Message], AsyncIterator[Message]],
                 reply_method: int, reply_type: type[Message],
                 on_reply: Callable[[Message], None]) -> None:
        self.request_type, self.open = request_type, open
        self.reply_method, self.reply_type, self.on_reply = reply_method, reply_type, on_reply


class LookupServer:
    """Answers each method's frames: ``handlers[method] = (request type, handler)``, the
    handler taking the decoded request and returning (or awaiting) the protobuf response, or
    raising InvalidArgument for a request it refuses.

    ``refusal()``: None while this master may answer, else why not (an HA standby: the client
    then asks over gRPC, which finds the leader). ``on_call(method, code, seconds)``: told of
    each call answered (the master's RPC metrics), with the gRPC method and status names.
    ``tls``: serve TLS with client certificates required (the master's gRPC credentials); each
    call is then checked against its caller's role (master/auth.py) as over gRPC. ``tokens``
    (with a ``tls`` context that lets a client without a certificate in): such a connection
    authenticates with its bearer token first (net/lookup_port.py AUTH)."""

    def __init__(self, handlers: Mapping[int, tuple[type[Message], Handler]],
                 refusal: Callable[[], str | None] = lambda: None,
                 on_call: Callable[[str, str, float], None] | None = None,
                 streams: Mapping[int, Stream] | None = None,
                 tls: ssl.SSLContext | None = None, tokens: Tokens | None = None):
        self._handlers, self._refusal, self._on_call = dict(handlers), refusal, on_call
        self._tls, self._tokens = tls, tokens
        self._streams = dict(streams or {})
        self._server: asyncio.Server | None = None
        # Each connection's writer and the task serving it (stop ends both).
        self._connections: dict[asyncio.StreamWriter, asyncio.Task] = {}
        self.port = 0
        self.calls: dict[int, int] = dict.fromkeys(self._handlers, 0)   # by method, answered

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (0: any free port); return the bound port."""
        self._server = await asyncio.start_server(self._serve, host, port, ssl=self._tls)
        self.port = self._server.sockets[0].getsockname()[1]
        if port == 0 and len(self._server.sockets) > 1:   # e.g. "localhost": v4 and v6
            # Each family got its own free port; clients dial one port, whichever family.
            self._server.close()
            await self._server.wait_closed()
            self._server = await asyncio.start_server(self._serve, host, self.port,
                                                      ssl=self._tls)
        return self.port

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        tasks = list(self._connections.values())
        for writer in list(self._connections):   # idle clients would hold wait_closed open
            if self._tls is not None:
                # A TLS close waits for the peer's close_notify, which an idle client never
                # sends: its task would be cancelled below, and asyncio logs that as an error.
                writer.transport.abort()
            else:
                writer.close()
        # A stream's task ends once its messages do (the master ended its streams first), the
        # others at their closed connection; none is left to be destroyed with the loop.
        _, late = await asyncio.wait(tasks, timeout=1.0) if tasks else ((), ())
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    def _identity(self, writer: asyncio.StreamWriter) -> Identity | None:
        """Who the connection's verified certificate names (None without TLS or a role)."""
        tls = writer.get_extra_info("ssl_object")
        der = tls.getpeercert(binary_form=True) if tls is not None else None
        try:
            return identity_from_der(der) if der else None
        except ValueError:
            return None

    def _check(self, method: int, identity: Identity | None, request: Message) -> None:
        """Refused unless the caller may make this call (nothing is checked without TLS)."""
        if self._tls is not None:
            check(lookup_port.METHOD_NAMES[method], identity, request)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections[writer] = asyncio.current_task()
        identity = self._identity(writer)
        try:
            while True:
                magic, method, length = lookup_port.REQUEST.unpack(
                    await reader.readexactly(lookup_port.REQUEST.size))
                if method == lookup_port.AUTH and identity is None and self._tokens is not None \
                        and magic == lookup_port.MAGIC and length <= _MAX_TOKEN_BYTES:
                    token = await reader.readexactly(length)
                    identity = self._tokens.identify("Bearer " + token.decode("utf-8", "replace"))
                    if identity is None:
                        writer.write(lookup_port.encode_response(
                            _UNAUTHENTICATED, b"unknown bearer token (SECURITY.md)"))
                        await writer.drain()
                        return
                    writer.write(lookup_port.encode_response(_OK, b""))
                    await writer.drain()
                    continue
                if method in self._streams and magic == lookup_port.MAGIC \
                        and length <= lookup_port.MAX_BODY_BYTES:
                    return await self._stream(method, await reader.readexactly(length),
                                              reader, writer, identity)
                if magic != lookup_port.MAGIC or method not in self._handlers \
                        or length > lookup_port.MAX_BODY_BYTES:
                    writer.write(lookup_port.encode_response(_INVALID, (
                        f"malformed lookup request (magic {magic!r}, method {method}, "
                        f"{length} bytes)").encode()))
                    await writer.drain()
                    return
                body = await reader.readexactly(length)
                started = time.perf_counter()
                answer = await self._answer(method, body, identity)
                if self._on_call is not None:
                    self._on_call(lookup_port.METHOD_NAMES[method],
                                  _CODE_NAMES[answer[0]], time.perf_counter() - started)
                self.calls[method] += 1   # before the answer: whoever has it sees it counted
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass    # the client went away (or broke its TLS)
        finally:
            self._connections.pop(writer, None)
            writer.close()

    async def _stream(self, method: int, body: bytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter, identity: Identity | None) -> None:
        """Serve a stream until either end stops it: its messages go out as they come while
        its replies are read; a peer that hangs up (or sends anything else) ends it at once,
        as a cancelled gRPC stream does, so its watch is not left waiting for the next
        message to find out."""
        if (why := self._refusal()) is not None:
            writer.write(lookup_port.encode_response(_UNAVAILABLE, why.encode()))
            return await writer.drain()
        stream = self._streams[method]
        try:
            request = stream.request_type.FromString(body)
            self._check(method, identity, request)
            messages = stream.open(request)
        except DecodeError:
            writer.write(lookup_port.encode_response(_INVALID, b"malformed stream request"))
            return await writer.drain()
        except Refused as e:
            writer.write(lookup_port.encode_response(e.code.value[0], str(e).encode()))
            return await writer.drain()

        async def send() -> None:
            async with contextlib.aclosing(messages):
                async for message in messages:
                    writer.write(lookup_port.encode_response(_OK, message.SerializeToString()))
                    await writer.drain()

        sending = asyncio.create_task(send())
        replies = asyncio.create_task(self._replies(stream, reader, identity))
        try:
            await asyncio.wait((sending, replies), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, replies):
                task.cancel()
            await asyncio.gather(sending, replies, return_exceptions=True)
        error = None if sending.cancelled() else sending.exception()
        if isinstance(error, KVPoolError):   # refused at the start (a node it does not know)
            code = _NOT_FOUND if isinstance(error, UnknownNode) else _INVALID
            writer.write(lookup_port.encode_response(code, str(error).encode()))
            await writer.drain()
        elif isinstance(error, Exception) and not isinstance(error, ConnectionError):
            log.error("stream_failed", error=repr(error))

    async def _replies(self, stream: Stream, reader: asyncio.StreamReader,
                       identity: Identity | None) -> None:
        # A reply another node's identity could not send (an ack for another node) ends the
        # stream, as anything else unexpected does.
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, DecodeError,
                                 Refused, ssl.SSLError):
            while True:
                magic, method, length = lookup_port.REQUEST.unpack(
                    await reader.readexactly(lookup_port.REQUEST.size))
                if magic != lookup_port.MAGIC or method != stream.reply_method \
                        or length > lookup_port.MAX_BODY_BYTES:
                    return
                reply = stream.reply_type.FromString(await reader.readexactly(length))
                self._check(method, identity, reply)
                stream.on_reply(reply)

    async def _answer(self, method: int, body: bytes, identity: Identity | None) -> bytes:
        if (why := self._refusal()) is not None:
            return lookup_port.encode_response(_UNAVAILABLE, why.encode())
        request_type, handler = self._handlers[method]
        try:
            request = request_type.FromString(body)
        except DecodeError:
            return lookup_port.encode_response(
                _INVALID, f"malformed {request_type.DESCRIPTOR.name}".encode())
        name = lookup_port.METHOD_NAMES[method]
        try:
            self._check(method, identity, request)
            scope(name, identity, request)
        except Refused as e:
            return lookup_port.encode_response(e.code.value[0], str(e).encode())
        try:
            response = handler(request)
            if inspect.isawaitable(response):
                response = await response
            scope_answer(name, identity, response)
            return lookup_port.encode_response(_OK, response.SerializeToString())
        except InvalidArgument as e:
            return lookup_port.encode_response(_INVALID, str(e).encode())
        except Exception as e:   # a bug: answered as gRPC would (UNKNOWN), not a dead socket
            log.exception("lookup_failed", method=name)
            return lookup_port.encode_response(_UNKNOWN, f"{type(e).__name__}: {e}".encode())
