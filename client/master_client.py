"""The client side of the master's gRPC API: deadlines, jittered retry, status -> exception.

Object calls return one result per key: a value, or the KVPoolError instance for that key
(the caller decides whether to raise it). Only transport-level failures raise here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
from kvpool.common import wire
from kvpool.common.errors import (
    ClientClosed,
    InvalidArgument,
    KVPoolError,
    MasterUnavailable,
    UnknownNode,
    error_for_status,
)
from kvpool.common.types import NodeEndpoints, ObjectView, Replica, SegmentInfo
from kvpool.common.wire import GRPC_OPTIONS
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.protos.kvpool.v1 import master_pb2_grpc

T = TypeVar("T")



def parse_address(address: str) -> str:
    """Validate ``host:port``; return it unchanged."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"invalid master address {address!r}: expected host:port, "
                              "e.g. 127.0.0.1:50051")
    return address


class MasterClient:
    """A blocking, thread-safe client of one master."""

    def __init__(self, address: str, timeout_s: float = 10.0, retries: int = 3):
        self.address = parse_address(address)
        self._timeout_s = timeout_s
        self._retries = retries
        self._channel: grpc.Channel | None = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = master_pb2_grpc.MasterStub(self._channel)

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _call(self, method: str, request) -> object:
        if self._channel is None:
            raise ClientClosed("the master client is closed")
        fn: Callable = getattr(self._stub, method)
        delay = 0.05
        for attempt in range(self._retries + 1):
            try:
                return fn(request, timeout=self._timeout_s)
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidArgument(e.details()) from None
                if code == grpc.StatusCode.UNAVAILABLE and attempt < self._retries:
                    time.sleep(delay * (0.5 + random.random()))
                    delay *= 2
                    continue
                if code == grpc.StatusCode.CANCELLED and self._channel is None:
                    raise ClientClosed("the master client was closed during the call") from None
                raise MasterUnavailable(
                    f"master {self.address}: {method} failed: {code.name}: {e.details()}") from None
        raise AssertionError("unreachable")

    # -- membership (store nodes) --
    def mount_segment(self, node: NodeEndpoints, segment: SegmentInfo) -> None:
        self._call("MountSegment", pb.MountSegmentRequest(node=wire.node_to_pb(node),
                                                          segment=wire.segment_to_pb(segment)))

    def unmount_segment(self, node_id: str, segment_id: str) -> None:
        r = self._call("UnmountSegment", pb.UnmountSegmentRequest(node_id=node_id,
                                                                  segment_id=segment_id))
        if err := error_for_status(r.status, segment_id):
            raise err

    def heartbeat(self, node_id: str) -> None:
        r = self._call("Heartbeat", pb.HeartbeatRequest(node_id=node_id))
        if r.status == pb.STATUS_UNKNOWN_NODE:
            raise UnknownNode(f"master does not know node {node_id!r}")

    # -- objects --
    def put_start(self, keys: Sequence[str], sizes: Sequence[int], replicas: int = 0
                  ) -> tuple[list[tuple[Replica, ...] | KVPoolError], float]:
        r = self._call("PutStart", pb.PutStartRequest(keys=keys, sizes=sizes, replicas=replicas))
        placed = wire.replicas_from_columns(r.replicas, sizes)
        out = [error_for_status(s, k) or p for k, s, p in zip(keys, r.statuses, placed)]
        return out, r.put_timeout_s

    def put_end(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        return self._statuses("PutEnd", keys)

    def put_revoke(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        return self._statuses("PutRevoke", keys)

    def remove(self, keys: Sequence[str]) -> list[KVPoolError | None]:
        return self._statuses("Remove", keys)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        r = self._call("Exists", pb.KeysRequest(keys=keys))
        return [s == pb.STATUS_OK for s in r.statuses]

    def get_replicas(self, keys: Sequence[str]) -> tuple[list[ObjectView | KVPoolError], float]:
        r = self._call("GetReplicas", pb.KeysRequest(keys=keys))
        sizes = list(r.sizes)
        located = wire.replicas_from_columns(r.replicas, sizes)
        out: list[ObjectView | KVPoolError] = [
            error_for_status(s, k) or ObjectView(k, size, version, replicas)
            for k, s, size, version, replicas in zip(keys, r.statuses, sizes, r.versions, located)]
        return out, r.lease_ttl_s

    def stats(self) -> pb.StatsResponse:
        return self._call("Stats", pb.StatsRequest())

    def _statuses(self, method: str, keys: Sequence[str]) -> list[KVPoolError | None]:
        r = self._call(method, pb.KeysRequest(keys=keys))
        return [error_for_status(s, k) for k, s in zip(keys, r.statuses)]
