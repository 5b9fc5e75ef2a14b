"""What every blocking client of a master service shares: the channel, deadlines, jittered
retry of UNAVAILABLE, and the one place gRPC errors become kvpool exceptions."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import grpc
from kvpool.common import security
from kvpool.common.addresses import LEADER_METADATA, parse_address
from kvpool.common.errors import (
    ClientClosed,
    HashSpecMismatch,
    InvalidArgument,
    KVPoolError,
    LimitExceeded,
    MasterUnavailable,
    PermissionDenied,
    Unauthenticated,
)
from kvpool.protos.kvpool.v1 import master_pb2, master_pb2_grpc
from kvpool.rpc.leader import MasterTargets
from kvpool.rpc.wire import GRPC_OPTIONS

__all__ = ["GrpcClient", "map_rpc_error", "map_status", "parse_address"]

# Status codes a master service uses to refuse a request; everything else means unreachable.
_REFUSALS: dict[grpc.StatusCode, type[KVPoolError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: HashSpecMismatch,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceeded,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


# gRPC's default reconnect backoff grows to 2 minutes, and while it waits every call fails at
# once: a restarted master would sit idle that long. Its jitter stays; the ceiling is 2 s.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# Between tries of the masters during a failover (jittered, doubling from 50 ms): a new leader
# is found within a second of being elected, and a dead one is not hammered.
_FAILOVER_MAX_DELAY_S = 1.0


def map_rpc_error(e: grpc.RpcError, what: str) -> KVPoolError:
    """The kvpool exception for a failed call (``what`` names it in the message)."""
    return map_status(e.code(), e.details(), what)


def map_status(code: grpc.StatusCode, details: str, what: str) -> KVPoolError:
    """The kvpool exception for a call that ended with ``code`` (a gRPC call's, or the lookup
    port's: rpc/lookup.py)."""
    if code in _REFUSALS:
        return _REFUSALS[code](details)
    return MasterUnavailable(f"{what} failed: {code.name}: {details}")


class GrpcClient:
    """A blocking, thread-safe client of one master service; a context manager.

    ``address``: one master (``host:port``), standby masters (``a:1,b:2``) or
    ``etcd://HOST:PORT[/CLUSTER]`` (rpc/leader.py). With one address an UNAVAILABLE call is
    retried ``retries`` times; with standbys it is retried, on whichever master leads, until
    ``timeout_s`` has passed since the call began (each try under what is left of it).

    ``credentials``: loaded ones, a credentials file, False (plain text), or None: found as
    common/security.py ``resolve`` says for ``role`` (and ``identity``, a node's id); with
    none found the channel is plain text."""

    def __init__(self, address: str, stub_factory: Callable[[grpc.Channel], object], *,
                 timeout_s: float = 10.0, retries: int = 3, name: str = "client",
                 credentials: security.Credentials | str | bool | None = None, role: str = "client",
                 identity: str | None = None):
        self._targets = MasterTargets(address)
        self.credentials = credentials if isinstance(credentials, security.Credentials) \
            else None if credentials is False \
            else security.resolve(self._targets.spec, credentials, role=role, name=identity)
        self._timeout_s = timeout_s
        self._retries = retries
        self._name = name
        self._stub_factory = stub_factory
        self._lock = threading.Lock()
        self._closed = False
        # One channel per master dialled, kept open: going back to one costs no reconnect.
        self._channels: dict[str, tuple[grpc.Channel, object]] = {}
        self._current: tuple[str, object] | None = None   # (address, stub) talked to now
        if first := self._targets.first():
            self._use(first)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def lookup_sessions(self) -> Callable[[str], object] | None:
        """How this client opens its sessions of a master's lookup port (rpc/lookup.py), as
        the identity of its credentials (None: a master without credentials, plain frames)."""
        return None if self.credentials is None else self._open_lookup_session

    def _open_lookup_session(self, master: str):
        with self._lock:
            entry = self._channels.get(master)
        if entry is None:
            raise MasterUnavailable(f"no channel to master {master}")
        try:
            return master_pb2_grpc.MasterStub(entry[0]).OpenLookupSession(
                master_pb2.OpenLookupSessionRequest(), timeout=self._timeout_s)
        except grpc.RpcError as e:
            raise map_rpc_error(e, f"master {master}: OpenLookupSession") from None

    @property
    def token(self) -> str:
        """The bearer token this client authenticates with ("": a certificate, or none)."""
        return self.credentials.token if self.credentials is not None else ""

    @property
    def address(self) -> str:
        """The master talked to now ("" until etcd names a leader)."""
        current = self._current
        return current[0] if current else ""

    @property
    def _channel(self) -> grpc.Channel | None:
        """The current channel; None once closed (or before etcd named a leader)."""
        if self._closed or not self.address:
            return None
        return self._channels[self.address][0]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            channel.close()

    def _use(self, address: str | None) -> None:
        """Talk to ``address`` from now on (None: keep the current one)."""
        if not address:
            return
        with self._lock:
            if self._closed:
                return
            if address not in self._channels:
                options = GRPC_OPTIONS + _RECONNECT_OPTIONS
                if self.credentials is None:
                    channel = grpc.insecure_channel(address, options=options)
                else:
                    channel = grpc.secure_channel(
                        address, self.credentials.grpc_channel(),
                        options=options + security.GRPC_CHANNEL_OPTIONS)
                self._channels[address] = (channel, self._stub_factory(channel))
            self._current = (address, self._channels[address][1])

    def _live_stub(self) -> tuple[str, object]:
        """The current master and its stub, for streams; asks etcd when none is known yet."""
        if self._closed:
            raise ClientClosed(f"the {self._name} is closed")
        if self._current is None:
            self._use(self._targets.next(None, None, self._timeout_s, self.credentials))
        if (current := self._current) is None:
            raise MasterUnavailable(f"no master leads {self._targets.spec} yet")
        return current

    def _hint(self, error: grpc.RpcError | None) -> str | None:
        """The leader a standby named; none for a token client: the name is the leader's
        certificate port, and a token client dials its token port (read from etcd)."""
        return None if self.token else _leader_hint(error)

    def _fail_over(self, address: str, error: grpc.RpcError | None) -> None:
        """After ``address`` answered UNAVAILABLE: move to the master it names as the leader,
        or to the next one to try (a failed look-up in etcd leaves the current one)."""
        hint = self._hint(error)
        if not self._targets.fails_over or (not hint and self.address not in ("", address)):
            return      # another thread has moved on already
        try:
            self._use(self._targets.next(address, hint, min(1.0, self._timeout_s),
                                         self.credentials))
        except KVPoolError:
            pass

    def _call_port(self, lookups, method: int, request, response_type):
        """``request`` on the master's lookup port (``lookups``: rpc/lookup.py ``Lookups``);
        None if no port answers it (ask over gRPC). A master that hangs past the deadline is
        left as after a gRPC deadline: the next call goes to whichever master leads by then."""
        address = self.address
        try:
            return lookups.try_port(address, method, request, response_type)
        except MasterUnavailable:
            if self._targets.fails_over:
                self._fail_over(address, None)
            raise

    async def _call_port_async(self, lookups, method: int, request, response_type):
        """:meth:`_call_port` on the running event loop."""
        address = self.address
        try:
            return await lookups.try_port_async(address, method, request, response_type)
        except MasterUnavailable:
            if self._targets.fails_over:
                self._fail_over(address, None)
            raise

    def _call(self, method: str, request, *, retry: bool = True, **kw) -> object:
        """Call ``method`` under the deadline; UNAVAILABLE is retried with jittered
        exponential backoff unless ``retry`` is False (streams). UNAVAILABLE also comes from
        a master that died after acting on the call, so a retry answers for the state it left:
        a Remove it carried out comes back not found, a PutStart it placed AlreadyExists."""
        if self._targets.fails_over:
            return self._call_leader(method, request, retry, kw)
        if self._closed:
            raise ClientClosed(f"the {self._name} is closed")
        fn: Callable = getattr(self._current[1], method)
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
                if code == grpc.StatusCode.CANCELLED and self._closed:
                    raise ClientClosed(f"the {self._name} was closed during the call") from None
                raise map_rpc_error(e, f"master {self.address}: {method}") from None
        raise AssertionError("unreachable")

    def _call_leader(self, method: str, request, retry: bool, kw: dict) -> object:
        """``_call`` with standby masters: follow the leader until the deadline."""
        deadline = time.monotonic() + self._timeout_s
        delay, jumps = 0.05, 0
        while True:
            error: grpc.RpcError | None = None
            try:
                address, stub = self._live_stub()
                return getattr(stub, method)(
                    request, timeout=max(0.001, deadline - time.monotonic()), **kw)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and self._closed:
                    raise ClientClosed(f"the {self._name} was closed during the call") from None
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        # A hung master (it may have acted: not retried); the next call
                        # goes to whichever master leads by then.
                        self._fail_over(address, None)
                    raise map_rpc_error(e, f"master {address}: {method}") from None
                error, failure = e, map_rpc_error(e, f"master {address}: {method}")
                self._fail_over(address, e)
            except MasterUnavailable as e:    # etcd names no leader (yet), or cannot be read
                address, failure = "", e
            left = deadline - time.monotonic()
            if not retry or left <= 0:
                raise failure
            if self.address != address and self._hint(error) and jumps < 3:
                jumps += 1
                continue                        # pointed at the leader: go at once
            jumps = 0
            time.sleep(min(left, delay * (0.5 + random.random())))
            delay = min(2 * delay, _FAILOVER_MAX_DELAY_S)
            if self.address == address or not self.address:
                self._fail_over(address, None)


def _leader_hint(error: grpc.RpcError | None) -> str | None:
    """The leader's address a standby master named in its refusal, if any."""
    if error is None:
        return None
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - none before a call is made; a hint must never raise
        return None
    return next((v for k, v in metadata if k == LEADER_METADATA), None) or None
