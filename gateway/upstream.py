"""One try of a request on one engine: send it, pass the answer back as it arrives.

A stream is passed through chunk by chunk (each read from the engine is written to the client
at once, never buffered to the end). The client's response starts only with the engine's first
chunk, so until then a failed engine can be replaced: :class:`EngineFailed` means nothing reached
the client and the request may go elsewhere. Once the stream began, an engine failure ends it
with an OpenAI error event. A client that goes away (its connection lost, or the handler
cancelled by aiohttp for it) closes the engine connection, and vLLM aborts the request.

I/O errors are mapped to these outcomes here, at one boundary: an engine's (refused, reset,
a read timeout, a 502/503/504, a body cut short) versus the client's (a write to a closed
connection) versus the request's own deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from kvpool.gateway.errors import UpstreamFailed

RETRY_STATUSES = frozenset({502, 503, 504})
_PASSED_HEADERS = ("Authorization", "X-Request-Id")


class EngineFailed(Exception):
    """The engine failed before anything reached the client: mark it down, try another."""


class DeadlineExceeded(Exception):
    """The request's own deadline passed (not the engine's fault). ``outcome``: the stream
    already begun (and now ended with an error event), if any."""

    def __init__(self, outcome: Outcome | None = None):
        super().__init__("deadline exceeded")
        self.outcome = outcome


class EngineFailedMidStream(Exception):
    """The engine failed after the stream began: the client's stream was ended with an error
    event (``outcome``); the engine is to be marked down, the request not retried."""

    def __init__(self, reason: str, outcome: Outcome):
        super().__init__(reason)
        self.outcome = outcome


class ClientGone(Exception):
    """The client closed its connection; ``response``: the one begun for it, if any (what the
    handler returns: aiohttp then sends nothing more)."""

    def __init__(self, response: web.StreamResponse | None = None):
        super().__init__("the client went away")
        self.response = response


@dataclass(slots=True)
class Outcome:
    response: web.StreamResponse
    status: int
    first_chunk_s: float | None    # perf_counter time of the engine's first body chunk
    streamed: bool


async def forward(session: aiohttp.ClientSession, request: web.Request, url: str, body: bytes,
                  *, stream: bool, deadline: float, connect_timeout_s: float,
                  read_timeout_s: float, headers: dict[str, str],
                  on_first_chunk: Callable[[], None]) -> Outcome:
    """Send ``body`` to ``url``; answer ``request`` with the engine's response (``headers``
    added). ``deadline``: a ``time.monotonic()`` time."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded()
    # A stream carries a chunk per token, so a silent engine is a hung one; a whole answer
    # comes only at its end, so only the deadline bounds it (and the connection, if the
    # engine dies meanwhile).
    timeout = aiohttp.ClientTimeout(total=left, sock_connect=connect_timeout_s,
                                    sock_read=read_timeout_s if stream else None)
    sent = {"Content-Type": "application/json"}
    sent.update((h, request.headers[h]) for h in _PASSED_HEADERS if h in request.headers)
    try:
        async with session.post(url, data=body, headers=sent, timeout=timeout) as up:
            try:
                return await _answer(up, request, stream, headers, on_first_chunk)
            except BaseException:
                # Whatever cut the answer short (the client gone, the handler cancelled, the
                # engine failed): drop the engine connection, which makes vLLM abort the
                # request; releasing it would leave the engine generating for nobody.
                up.close()
                raise
    except (ClientGone, EngineFailedMidStream, DeadlineExceeded):
        raise
    except aiohttp.ServerTimeoutError as e:     # connect or read timeout: the engine's
        raise EngineFailed(_describe(e)) from None
    except TimeoutError:                        # the total: this request's deadline
        raise DeadlineExceeded() from None
    except aiohttp.ClientError as e:
        raise EngineFailed(_describe(e)) from None


async def _answer(up: aiohttp.ClientResponse, request: web.Request, stream: bool,
                  headers: dict[str, str], on_first_chunk: Callable[[], None]) -> Outcome:
    if up.status in RETRY_STATUSES:
        raise EngineFailed(f"answered HTTP {up.status}")
    headers = {"Content-Type": up.headers.get("Content-Type", "application/json"), **headers}
    if stream and up.status == 200:
        return await _copy_stream(up, request, headers, on_first_chunk)
    data = await up.read()
    on_first_chunk()
    return Outcome(web.Response(body=data, status=up.status, headers=headers), up.status,
                   time.perf_counter(), False)


async def _copy_stream(up: aiohttp.ClientResponse, request: web.Request,
                       headers: dict[str, str], on_first_chunk: Callable[[], None]) -> Outcome:
    response: web.StreamResponse | None = None
    first_chunk_s = None
    try:
        async for chunk in up.content.iter_any():
            if response is None:
                first_chunk_s = time.perf_counter()
                response = web.StreamResponse(status=200, headers=headers)
                await _client_io(response.prepare(request), response)
                await _client_io(response.write(chunk), response)
                # After the write: the gateway's bookkeeping (calibration) is not the
                # client's wait.
                on_first_chunk()
                continue
            await _client_io(response.write(chunk), response)
    except (aiohttp.ClientError, TimeoutError) as e:
        if response is None:
            raise                   # nothing sent: forward() maps it, the request may retry
        outcome = Outcome(response, 200, first_chunk_s, True)
        deadline = isinstance(e, TimeoutError) and not isinstance(e, aiohttp.ServerTimeoutError)
        reason = "the request's deadline passed" if deadline else \
            f"the engine failed mid-stream: {_describe(e)}"
        await _client_io(response.write(UpstreamFailed(reason).sse()), response)
        await _client_io(response.write_eof(), response)
        if deadline:
            raise DeadlineExceeded(outcome) from None
        raise EngineFailedMidStream(_describe(e), outcome) from None
    if response is None:      # an empty stream: still an answer
        response = web.StreamResponse(status=200, headers=headers)
        await _client_io(response.prepare(request), response)
    await _client_io(response.write_eof(), response)
    return Outcome(response, 200, first_chunk_s, True)


async def _client_io(aw, response: web.StreamResponse) -> None:
    """A write to the client; its failure is the client's, not the engine's."""
    try:
        await aw
    except (ConnectionError, aiohttp.ClientConnectionResetError):
        raise ClientGone(response) from None


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def call(session: aiohttp.ClientSession, request: web.Request, url: str, body: bytes, *,
               deadline: float, connect_timeout_s: float) -> tuple[int, bytes]:
    """Send ``body`` to ``url`` and read the whole answer, passing nothing to the client (a
    disaggregated request's prefill hop): ``(status, body)``. Failures map as in
    :func:`forward`: the engine's to :class:`EngineFailed`, the deadline's to
    :class:`DeadlineExceeded`; a handler cancelled for a client that left closes the
    connection, and vLLM aborts the request."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded()
    timeout = aiohttp.ClientTimeout(total=left, sock_connect=connect_timeout_s)
    sent = {"Content-Type": "application/json"}
    sent.update((h, request.headers[h]) for h in _PASSED_HEADERS if h in request.headers)
    try:
        async with session.post(url, data=body, headers=sent, timeout=timeout) as up:
            if up.status in RETRY_STATUSES:
                raise EngineFailed(f"answered HTTP {up.status}")
            try:
                return up.status, await up.read()
            except BaseException:
                up.close()
                raise
    except aiohttp.ServerTimeoutError as e:
        raise EngineFailed(_describe(e)) from None
    except TimeoutError:
        raise DeadlineExceeded() from None
    except aiohttp.ClientError as e:
        raise EngineFailed(_describe(e)) from None
