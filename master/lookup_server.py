"""The master's lookup port (net/lookup_port.py): GetReplicas and Exists on a plain tcp listener,
served on the master's one event loop, like its gRPC handlers, so the state still needs no
locks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

import grpc
from google.protobuf.message import DecodeError, Message
from kvpool.common.logging import get_logger
from kvpool.net import lookup_port
from kvpool.protos.kvpool.v1 import master_pb2 as pb

log = get_logger(__name__)

_OK = grpc.StatusCode.OK.value[0]
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]


class LookupServer:
    """Answers each method's frames with ``handlers[method](keys)``, a protobuf response.

    ``refusal()``: None while this master may answer, else why not (an HA standby: the client
    then asks over gRPC, which finds the leader). ``max_keys``: the batch limit, as on gRPC."""

    def __init__(self, handlers: Mapping[int, Callable[[Sequence[str]], Message]],
                 max_keys: int, refusal: Callable[[], str | None] = lambda: None):
        self._handlers, self._max_keys, self._refusal = dict(handlers), max_keys, refusal
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.calls: dict[int, int] = dict.fromkeys(self._handlers, 0)   # by method, answered

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
        for writer in list(self._connections):   # idle clients would hold wait_closed open
            writer.close()
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            while True:
                magic, method, length = lookup_port.REQUEST.unpack(
                    await reader.readexactly(lookup_port.REQUEST.size))
                if magic != lookup_port.MAGIC or method not in self._handlers \
                        or length > lookup_port.MAX_BODY_BYTES:
                    writer.write(lookup_port.encode_response(_INVALID, (
                        f"malformed lookup request (magic {magic!r}, method {method}, "
                        f"{length} bytes)").encode()))
                    await writer.drain()
                    return
                writer.write(self._answer(method, await reader.readexactly(length)))
                self.calls[method] += 1
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass    # the client went away
        finally:
            self._connections.discard(writer)
            writer.close()

    def _answer(self, method: int, body: bytes) -> bytes:
        if (why := self._refusal()) is not None:
            return lookup_port.encode_response(_UNAVAILABLE, why.encode())
        try:
            keys = pb.KeysRequest.FromString(body).keys
        except DecodeError:
            return lookup_port.encode_response(_INVALID, b"malformed KeysRequest")
        if len(keys) > self._max_keys:
            return lookup_port.encode_response(_INVALID, (
                f"batch of {len(keys)} keys; the limit is {self._max_keys}").encode())
        try:
            return lookup_port.encode_response(_OK, self._handlers[method](keys).SerializeToString())
        except Exception as e:   # a bug: answered as gRPC would (UNKNOWN), not a dead socket
            log.exception("lookup_failed", keys=len(keys))
            return lookup_port.encode_response(_UNKNOWN, f"{type(e).__name__}: {e}".encode())
