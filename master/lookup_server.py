"""The master's lookup port (net/lookup_port.py): the data path's calls on a plain tcp listener,
served on the master's one event loop, like its gRPC handlers, so the state still needs no
locks. Each connection is served by its own task: a put call waiting for the store nodes holds
only its own connection."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import grpc
from google.protobuf.message import DecodeError, Message
from kvpool.common.errors import InvalidArgument, KVPoolError, UnknownNode
from kvpool.common.logging import get_logger
from kvpool.common.security import Identity
from kvpool.master.auth import Refused, check, scope_answer, scope_frame
from kvpool.master.lookup_sessions import LookupSession, LookupSessions
from kvpool.net import lookup_port
from kvpool.net.lookup_port import Seal, Unsealed
from kvpool.net.sockets import LoopSpinner

log = get_logger(__name__)

_OK = grpc.StatusCode.OK.value[0]
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]
_NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]
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
    ``sessions`` (a master with credentials): every connection is one of these sessions,
    its frames sealed (net/lookup_port.py, "Sessions"), and each call is checked against the
    session's identity (master/auth.py) as over gRPC."""

    def __init__(self, handlers: Mapping[int, tuple[type[Message], Handler]],
                 refusal: Callable[[], str | None] = lambda: None,
                 on_call: Callable[[str, str, float], None] | None = None,
                 streams: Mapping[int, Stream] | None = None,
                 sessions: LookupSessions | None = None):
        self._handlers, self._refusal, self._on_call = dict(handlers), refusal, on_call
        self.sessions = sessions
        self._streams = dict(streams or {})
        self._server: asyncio.Server | None = None
        # Each connection's writer and the task serving it (stop ends both).
        self._connections: dict[asyncio.StreamWriter, asyncio.Task] = {}
        self.port = 0
        self.calls: dict[int, int] = dict.fromkeys(self._handlers, 0)   # by method, answered
        # After an answer the loop polls a while for the next request ($KVPOOL_SPIN_US).
        self._spinner = LoopSpinner()

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host:port`` (0: any free port); return the bound port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        if port == 0 and len(self._server.sockets) > 1:   # e.g. "localhost": v4 and v6
            # Each family got its own free port; clients dial one port, whichever family.
            self._server.close()
            await self._server.wait_closed()
            self._server = await asyncio.start_server(self._serve, host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        tasks = list(self._connections.values())
        for writer in list(self._connections):   # idle clients would hold wait_closed open
            writer.close()
        # A stream's task ends once its messages do (the master ended its streams first), the
        # others at their closed connection; none is left to be destroyed with the loop.
        _, late = await asyncio.wait(tasks, timeout=1.0) if tasks else ((), ())
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    def _check(self, method: int, identity: Identity | None, request: Message) -> None:
        """Refused unless the caller may make this call (nothing is checked without
        sessions: a master without credentials)."""
        if self.sessions is not None:
            check(lookup_port.METHOD_NAMES[method], identity, request)

    async def _open(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                    ) -> _Frames | None:
        """The connection's framing: plain without sessions; else its first frame must name
        a session this master holds (None: refused, answered and to be closed)."""
        if self.sessions is None:
            return _Frames()
        magic, method, length = lookup_port.REQUEST.unpack(
            await reader.readexactly(lookup_port.REQUEST.size))
        if magic != lookup_port.MAGIC or method != lookup_port.SESSION \
                or length != lookup_port.SESSION_FRAME_BYTES:
            why = (b"this lookup port takes session connections only: open a session over "
                   b"gRPC (OpenLookupSession; net/lookup_port.py, SECURITY.md)")
        else:
            body = await reader.readexactly(length)
            session = self.sessions.find(body[:lookup_port.SESSION_ID_BYTES])
            if session is not None:
                salt = lookup_port.new_salt()
                out, inn = lookup_port.session_seals(
                    session.key, body[lookup_port.SESSION_ID_BYTES:], salt, server=True)
                writer.write(lookup_port.encode_response(_OK, salt))
                return _Frames(out, inn, session)
            why = b"unknown or ended lookup session: open another over gRPC"
        writer.write(lookup_port.encode_response(_UNAUTHENTICATED, why))
        await writer.drain()
        return None

    async def _read(self, reader: asyncio.StreamReader, frames: _Frames, method: int | None
                    = None) -> tuple[int, bytes]:
        """The next request frame's (method, body); _Ends if the connection cannot go on.
        ``method``: the one method expected (a stream's replies)."""
        head = await reader.readexactly(lookup_port.REQUEST.size)
        magic, got, length = lookup_port.REQUEST.unpack(head)
        if magic != lookup_port.MAGIC or length > lookup_port.MAX_BODY_BYTES + frames.tag \
                or (method is None and got not in self._handlers and got not in self._streams
                    and got != lookup_port.SPIN) \
                or (method is not None and got != method):
            # (after a malformed header the next frame's start is unknown)
            raise _Ends(_INVALID, f"malformed lookup request (magic {magic!r}, method {got}, "
                                  f"{length} bytes)")
        data = await reader.readexactly(length)
        if frames.session is not None and self.sessions.ended(frames.session):
            raise _Ends(_UNAUTHENTICATED, "the lookup session ended: open another over gRPC")
        return got, frames.body(head, data)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections[writer] = asyncio.current_task()
        frames = None
        try:
            if (frames := await self._open(reader, writer)) is None:
                return
            identity = frames.session.identity if frames.session is not None else None
            loop = asyncio.get_running_loop()
            while True:
                method, body = await self._read(reader, frames)
                self._spinner.heard()
                if method == lookup_port.SPIN:   # not answered: a call follows it
                    if (seconds := lookup_port.spin_s(body)) is None:
                        raise _Ends(_INVALID, "malformed SPIN frame")
                    self._spinner.hold(loop, seconds)
                    continue
                if method in self._streams:
                    return await self._stream(method, body, reader, writer, frames, identity)
                started = time.perf_counter()
                status, answer = await self._answer(method, body, identity)
                if self._on_call is not None:
                    self._on_call(lookup_port.METHOD_NAMES[method], _CODE_NAMES[status],
                                  time.perf_counter() - started)
                self.calls[method] += 1   # before the answer: whoever has it sees it counted
                writer.write(frames.answer(status, answer))
                self._spinner.answered(loop)
                await writer.drain()
        except _Ends as e:   # (closing the writer below sends what it holds first)
            writer.write(frames.answer(e.code, str(e).encode()))
        except Unsealed:   # forged, altered or replayed: answered in clear, and closed
            writer.write(lookup_port.encode_response(
                _UNAUTHENTICATED, b"a lookup frame failed authentication"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass    # the client went away
        finally:
            self._connections.pop(writer, None)
            writer.close()

    async def _stream(self, method: int, body: bytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter, frames: _Frames,
                      identity: Identity | None) -> None:
        """Serve a stream until either end stops it: its messages go out as they come while
        its replies are read; a peer that hangs up (or sends anything else) ends it at once,
        as a cancelled gRPC stream does, so its watch is not left waiting for the next
        message to find out."""
        if (why := self._refusal()) is not None:
            writer.write(frames.answer(_UNAVAILABLE, why.encode()))
            return await writer.drain()
        stream = self._streams[method]
        try:
            request = stream.request_type.FromString(body)
            self._check(method, identity, request)
            messages = stream.open(request)
        except DecodeError:
            writer.write(frames.answer(_INVALID, b"malformed stream request"))
            return await writer.drain()
        except Refused as e:
            writer.write(frames.answer(e.code.value[0], str(e).encode()))
            return await writer.drain()

        async def send() -> None:
            async with contextlib.aclosing(messages):
                async for message in messages:
                    writer.write(frames.answer(_OK, message.SerializeToString()))
                    await writer.drain()

        sending = asyncio.create_task(send())
        replies = asyncio.create_task(self._replies(stream, reader, frames, identity))
        try:
            await asyncio.wait((sending, replies), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, replies):
                task.cancel()
            await asyncio.gather(sending, replies, return_exceptions=True)
        error = None if sending.cancelled() else sending.exception()
        if isinstance(error, KVPoolError):   # refused at the start (a node it does not know)
            code = _NOT_FOUND if isinstance(error, UnknownNode) else _INVALID
            writer.write(frames.answer(code, str(error).encode()))
            await writer.drain()
        elif isinstance(error, Exception) and not isinstance(error, ConnectionError):
            log.error("stream_failed", error=repr(error))

    async def _replies(self, stream: Stream, reader: asyncio.StreamReader, frames: _Frames,
                       identity: Identity | None) -> None:
        # A reply another node's identity could not send (an ack for another node) ends the
        # stream, as anything else unexpected does (a frame that does not open too).
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, DecodeError,
                                 Refused, Unsealed, _Ends):
            while True:
                _, body = await self._read(reader, frames, stream.reply_method)
                reply = stream.reply_type.FromString(body)
                self._check(stream.reply_method, identity, reply)
                stream.on_reply(reply)

    async def _answer(self, method: int, body: bytes, identity: Identity | None
                      ) -> tuple[int, bytes]:
        if (why := self._refusal()) is not None:
            return _UNAVAILABLE, why.encode()
        request_type, handler = self._handlers[method]
        try:
            request = request_type.FromString(body)
        except DecodeError:
            return _INVALID, f"malformed {request_type.DESCRIPTOR.name}".encode()
        name = lookup_port.METHOD_NAMES[method]
        try:
            self._check(method, identity, request)
            scope_frame(name, identity, request, body)
        except Refused as e:
            return e.code.value[0], str(e).encode()
        try:
            response = handler(request)
            if inspect.isawaitable(response):
                response = await response
            scope_answer(name, identity, response)
            return _OK, response.SerializeToString()
        except InvalidArgument as e:
            return _INVALID, str(e).encode()
        except Exception as e:   # a bug: answered as gRPC would (UNKNOWN), not a dead socket
            log.exception("lookup_failed", method=name)
            return _UNKNOWN, f"{type(e).__name__}: {e}".encode()


class _Ends(Exception):
    """The connection cannot go on: answer ``code`` with the message, then close."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Frames:
    """One connection's framing: plain, or sealed under its ``session`` (``out``: the seal
    of what the master sends, ``inn``: of what it receives)."""

    __slots__ = ("out", "inn", "session", "tag")

    def __init__(self, out: Seal | None = None, inn: Seal | None = None,
                 session: LookupSession | None = None) -> None:
        self.out, self.inn, self.session = out, inn, session
        self.tag = lookup_port.TAG_BYTES if inn is not None else 0

    def answer(self, status: int, body: bytes) -> bytes:
        if self.out is None:
            return lookup_port.encode_response(status, body)
        return self.out.seal(lookup_port.RESPONSE, status, body=body)

    def body(self, head: bytes, data: bytes) -> bytes:
        """A request's body (Unsealed: it does not open)."""
        return data if self.inn is None else self.inn.open(head, data)
