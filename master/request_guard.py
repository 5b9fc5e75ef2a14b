"""Every gRPC request a client got wrong is answered with a typed status, and logged without a
flood: a request that is not the message it claims (malformed protobuf, a string that is not
UTF-8) is INVALID_ARGUMENT, not gRPC's UNKNOWN with a traceback; an error a handler did not
expect is INTERNAL, its traceback logged a few times a minute, not once per call.

gRPC decodes a request before any handler or interceptor sees it, so the guard swaps in a
decoder that hands a :class:`_Malformed` marker to the handler it wraps instead of raising.
Unary requests (every RPC but the node and event streams) are guarded; a stream's malformed
message still ends its stream with gRPC's own answer, logged at most a few times a minute by
the filter ``common/logging.py`` puts on gRPC's loggers.
"""

from __future__ import annotations

import inspect

import grpc
from kvpool.common.logging import RateLimited, get_logger

log = get_logger(__name__)


async def relay(result, context) -> None:
    """Serve a streaming handler's ``result``: a generator of messages, each written to the
    stream, or a coroutine that writes its own (both are handler styles grpc.aio takes)."""
    if inspect.isasyncgen(result):
        async for message in result:
            await context.write(message)
    else:
        await result


class _Malformed:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class RequestGuard(grpc.aio.ServerInterceptor):
    """Typed answers for malformed requests and unexpected handler errors (see the module)."""

    def __init__(self, limit: RateLimited | None = None) -> None:
        self.limit = limit or RateLimited(log)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        method = details.method.rpartition("/")[2]
        decode = handler.request_deserializer
        limit = self.limit

        def safe_decode(data: bytes):
            try:
                return decode(data) if decode is not None else data
            except Exception as e:  # noqa: BLE001  (protobuf raises DecodeError and others)
                return _Malformed(e)

        async def refuse(request, context) -> bool:
            if isinstance(request, _Malformed):
                limit.warning("malformed_request", kind=method, method=method,
                              peer=context.peer(), error=str(request.error)[:200])
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"malformed {method} request: {request.error}")
            return False

        def unexpected(context, e: Exception) -> str:
            # With its traceback, but rate-limited: the same bug hit by every call of a
            # client would otherwise log a traceback per call.
            limit.error("rpc_handler_failed", kind=(method, type(e).__name__), method=method,
                        peer=context.peer(), error=f"{type(e).__name__}: {e}", exc_info=e)
            return f"{method} failed on the master: {type(e).__name__}: {e}"

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                await refuse(request, context)
                try:
                    return await inner(request, context)
                except (grpc.aio.AbortError, grpc.aio.UsageError):
                    raise
                except Exception as e:  # noqa: BLE001  (a typed answer for anything else)
                    await context.abort(grpc.StatusCode.INTERNAL, unexpected(context, e))
            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=safe_decode,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                await refuse(request, context)
                try:
                    await relay(inner_stream(request, context), context)
                except (grpc.aio.AbortError, grpc.aio.UsageError):
                    raise
                except Exception as e:  # noqa: BLE001
                    await context.abort(grpc.StatusCode.INTERNAL, unexpected(context, e))
            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=safe_decode,
                response_serializer=handler.response_serializer)
        return handler
