"""The client side of the master's Router service: register a hash spec, publish KV events, route.

    with RouterClient("127.0.0.1:50051") as router:
        router.register(HashSpec.of(16, model="llama-3-8b"))        # HashSpecMismatch if refused
        router.publish("engine-0", [BlockStored(tuple(hashes))])   # one batch, one round trip
        choice = router.route(token_ids=prompt, candidates=[Candidate("engine-0", 2, 4096), ...])
        choice.instance_id, choice.hits    # {"gpu": 12, "cpu": 0, "store": 30}

For a long-lived engine, ``router.event_stream("engine-0")`` keeps one gRPC client stream open
and sends each ``send(events)`` as a batch on it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Self

import grpc
from kvpool.common.errors import ClientClosed, MasterUnavailable
from kvpool.common.hashing import HashSpec
from kvpool.common.kv_events import KVEvent
from kvpool.net import lookup_port
from kvpool.protos.kvpool.v1 import routing_pb2 as pb
from kvpool.protos.kvpool.v1 import routing_pb2_grpc
from kvpool.rpc.grpc_client import GrpcClient, map_rpc_error, map_status
from kvpool.rpc.lookup import Lookups
from kvpool.rpc.routing_wire import batch_to_pb


@dataclass(frozen=True, slots=True)
class Candidate:
    """An instance the request may go to, and its load."""

    instance_id: str
    queue_depth: int = 0
    inflight_prefill_tokens: int = 0
    # Its measured rates (kvpool.master.calibration.CostCalibrator), tokens/s; 0: the
    # master's configured cost model.
    prefill_tokens_per_s: float = 0.0
    store_tokens_per_s: float = 0.0
    decoding_requests: int = 0    # of queue_depth, those past their first token


@dataclass(frozen=True, slots=True)
class RouteChoice:
    instance_id: str
    policy: str
    hits: dict[str, int]          # expected prefix hits per tier, in blocks
    blocks: int                   # full blocks in the request
    estimated_ttft_s: float


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """A live instance of the master's routing index (``list_instances``)."""

    instance_id: str
    url: str                      # its OpenAI server, as its bridge announced it ("": none)
    role: str                     # "both", "prefill", "decode"
    gpu_blocks: int
    cpu_blocks: int
    seen_s_ago: float


class RouterClient(GrpcClient):
    """A blocking, thread-safe client of the master's Router service."""

    def __init__(self, master: str, timeout_s: float = 10.0, credentials: str | None = None):
        """``credentials``: a credentials file (SECURITY.md; default: found as KVClient's)."""
        super().__init__(master, routing_pb2_grpc.RouterStub, timeout_s=timeout_s, retries=3,
                         name="router client", credentials=credentials)
        # Route on the master's lookup port once an answer named it: a gateway asks before
        # every request it forwards, and gRPC costs ~1 ms a call on a busy 2-core host.
        self._lookups = Lookups(timeout_s, map_status, sessions=self.lookup_sessions)

    def close(self) -> None:
        self._lookups.close()
        super().close()

    def register(self, spec: HashSpec, client_id: str = "") -> HashSpec:
        """Check ``spec`` against the cluster's; return the cluster's. Raises HashSpecMismatch
        when the block size or spec differs (the first client to register fixes them)."""
        r = self._call("RegisterClient", pb.RegisterClientRequest(
            client_id=client_id, spec=pb.HashSpec(name=spec.name, block_size=spec.block_size)))
        return HashSpec(r.cluster_spec.block_size, spec.extra_keys, r.cluster_spec.name)

    def publish(self, instance_id: str, events: Sequence[KVEvent]) -> int:
        """Send one batch of ``instance_id``'s events (empty = heartbeat); return events applied."""
        return self._call("PublishKVEvents", iter([batch_to_pb(instance_id, events)]),
                          retry=False).events

    def event_stream(self, instance_id: str, *, url: str = "", role: str = "") -> KVEventStream:
        """A stream of ``instance_id``'s events; ``url`` and ``role`` (its OpenAI server, and
        "both", "prefill" or "decode") go with every batch, for ``list_instances``."""
        _, stub = self._live_stub()
        return KVEventStream(stub, instance_id, url=url, role=role)

    def list_instances(self) -> list[InstanceInfo]:
        """The live instances the master knows (from their KV events and heartbeats)."""
        r = self._call("ListInstances", pb.ListInstancesRequest())
        return [InstanceInfo(i.instance_id, i.url, i.role or "both", i.gpu_blocks,
                             i.cpu_blocks, i.seen_s_ago) for i in r.instances]

    def route(self, *, token_ids: Sequence[int] | None = None,
              block_hashes: Sequence[bytes] | None = None, prompt_tokens: int = 0,
              candidates: Sequence[Candidate] = (), policy: str = "",
              extra_keys: dict[str, str] | None = None) -> RouteChoice:
        """Choose an instance for a prompt given as token ids (hashed by the master with the
        cluster's spec and ``extra_keys``) or block hashes. No candidates: every live instance."""
        req = _route_request(token_ids, block_hashes, prompt_tokens, candidates, policy,
                             extra_keys)
        r = self._call_port(self._lookups, lookup_port.ROUTE, req, pb.RouteResponse)
        if r is None:
            r = self._call("Route", req)
            self._lookups.learn(self.address, r.lookup_port)
        return _choice(r)

    async def route_async(self, *, token_ids: Sequence[int] | None = None,
                          block_hashes: Sequence[bytes] | None = None, prompt_tokens: int = 0,
                          candidates: Sequence[Candidate] = (), policy: str = "",
                          extra_keys: dict[str, str] | None = None) -> RouteChoice:
        """:meth:`route` for a caller on an event loop: on the lookup port without leaving
        the loop; over gRPC (until an answer names the port, or while it fails) on a worker
        thread."""
        req = _route_request(token_ids, block_hashes, prompt_tokens, candidates, policy,
                             extra_keys)
        r = await self._call_port_async(self._lookups, lookup_port.ROUTE, req, pb.RouteResponse)
        if r is None:
            r = await asyncio.get_running_loop().run_in_executor(None, self._call, "Route", req)
            self._lookups.learn(self.address, r.lookup_port)
        return _choice(r)


def _route_request(token_ids: Sequence[int] | None, block_hashes: Sequence[bytes] | None,
                   prompt_tokens: int, candidates: Sequence[Candidate], policy: str,
                   extra_keys: dict[str, str] | None) -> pb.RouteRequest:
    return pb.RouteRequest(
        token_ids=list(token_ids or ()), block_hashes=list(block_hashes or ()),
        prompt_tokens=prompt_tokens, policy=policy,
        extra_keys=[pb.ExtraKey(name=k, value=str(v)) for k, v in (extra_keys or {}).items()],
        candidates=[pb.Candidate(instance_id=c.instance_id, queue_depth=c.queue_depth,
                                 inflight_prefill_tokens=c.inflight_prefill_tokens,
                                 prefill_tokens_per_s=c.prefill_tokens_per_s,
                                 store_tokens_per_s=c.store_tokens_per_s,
                                 decoding_requests=c.decoding_requests)
                    for c in candidates])


def _choice(r: pb.RouteResponse) -> RouteChoice:
    return RouteChoice(r.instance_id, r.policy, {h.tier: h.blocks for h in r.hits}, r.blocks,
                       r.estimated_ttft_s)


_END = object()


class KVEventStream:
    """One long-lived PublishKVEvents stream; ``send`` queues a batch, ``close`` ends the
    stream and returns the number of events the master applied."""

    def __init__(self, stub: routing_pb2_grpc.RouterStub, instance_id: str, *, url: str = "",
                 role: str = ""):
        self.instance_id, self.url, self.role = instance_id, url, role
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._future = stub.PublishKVEvents.future(self._batches())

    def _batches(self) -> Iterator[pb.KVEventBatch]:
        while (item := self._queue.get()) is not _END:
            yield item

    def send(self, events: Sequence[KVEvent]) -> None:
        with self._lock:
            if self._closed:
                raise ClientClosed("the event stream is closed")
            if self._future.done():
                self._raise()
            batch = batch_to_pb(self.instance_id, events)
            batch.url, batch.role = self.url, self.role
            self._queue.put(batch)

    def close(self, timeout_s: float = 10.0) -> int:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_END)
        try:
            return self._future.result(timeout=timeout_s).events
        except grpc.RpcError:
            self._raise()
        except grpc.FutureTimeoutError:
            raise MasterUnavailable("the master did not acknowledge the event stream") from None

    def _raise(self):
        e = self._future.exception()
        if e is None:
            raise ClientClosed("the event stream ended")
        raise map_rpc_error(e, "event stream")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
