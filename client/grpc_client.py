"""What every blocking client of a master service shares: the channel, deadlines, jittered
retry of UNAVAILABLE, and the one place gRPC errors become kvpool exceptions."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import grpc
from kvpool.common.errors import (
    ClientClosed, HashSpecMismatch, InvalidArgument, KVPoolError, MasterUnavailable)
from kvpool.common.wire import GRPC_OPTIONS

# Status codes a master service uses to refuse a request; everything else means unreachable.
_REFUSALS: dict[grpc.StatusCode, type[KVPoolError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: HashSpecMismatch,
}


# gRPC's default reconnect backoff grows to 2 minutes, and while it waits every call fails at
# once: a restarted master would sit idle that long. Its jitter stays; the ceiling is 2 s.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def parse_address(address: str) -> str:
    """Validate ``host:port``; return it unchanged."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"invalid master address {address!r}: expected host:port, "
                              "e.g. 127.0.0.1:50051")
    return address


def map_rpc_error(e: grpc.RpcError, what: str) -> KVPoolError:
    """The kvpool exception for a failed call (``what`` names it in the message)."""
    code = e.code()
    if code in _REFUSALS:
        return _REFUSALS[code](e.details())
    return MasterUnavailable(f"{what} failed: {code.name}: {e.details()}")


class GrpcClient:
    """A blocking, thread-safe client of one master service; a context manager."""

    def __init__(self, address: str, stub_factory: Callable[[grpc.Channel], object], *,
                 timeout_s: float = 10.0, retries: int = 3, name: str = "client"):
        self.address = parse_address(address)
        self._timeout_s = timeout_s
        self._retries = retries
        self._name = name
        self._channel: grpc.Channel | None = grpc.insecure_channel(
            address, options=GRPC_OPTIONS + _RECONNECT_OPTIONS)
        self._stub = stub_factory(self._channel)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _call(self, method: str, request, *, retry: bool = True, **kw) -> object:
        """Call ``method`` under the deadline; UNAVAILABLE (nothing reached the server) is
        retried with jittered exponential backoff unless ``retry`` is False (streams)."""
        if self._channel is None:
            raise ClientClosed(f"the {self._name} is closed")
        fn: Callable = getattr(self._stub, method)
        delay = 0.05
        for attempt in range(self._retries + 1 if retry else 1):
            try:
                return fn(request, timeout=self._timeout_s, **kw)
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE and retry and attempt < self._retries:
                    time.sleep(delay * (0.5 + random.random()))
                    delay *= 2
                    continue
                if code == grpc.StatusCode.CANCELLED and self._channel is None:
                    raise ClientClosed(f"the {self._name} was closed during the call") from None
                raise map_rpc_error(e, f"master {self.address}: {method}") from None
        raise AssertionError("unreachable")
