"""Standby masters: leader election on an etcd lease (``kvpool master --ha etcd://...``).

Every master of a cluster serves its gRPC port from the start. The one that holds the leader
key (``/kvpool/CLUSTER/leader``, bound to its lease, holding its address) serves for real; the
others answer every call at once with UNAVAILABLE "not the leader; leader is X" and X in the
``kvpool-leader`` trailing metadata. Refusing beats not listening: a client is sent straight to
the leader instead of waiting out connect timeouts, its channel to a standby stays connected
(no reconnect backoff when that standby is elected), and a user pointed at a standby is told
where to go.

Fencing: the leader counts its lease from the moment it *sent* the grant or keep-alive, so its
own deadline passes before etcd's does; every call is checked against that deadline, so an old
leader refuses work before a new one can be elected, even before it has noticed. A leader that
loses its lease stops serving and exits (status 1): its index may differ from what the nodes now
hold, so it must come back as a fresh standby (under systemd or Kubernetes: a restart). A new
leader starts with an empty index; the store nodes, told UNKNOWN_NODE, mount again and
re-announce their manifests (store_node/node.py), as after a master restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import signal
import time
from collections.abc import Callable

import grpc
from kvpool.common.addresses import LEADER_METADATA, EtcdURL, parse_address
from kvpool.common.config import MasterConfig
from kvpool.common.errors import InvalidArgument, MasterUnavailable
from kvpool.common.logging import get_logger
from kvpool.common.loops import RESTART, Supervisor
from kvpool.master.server import MasterServer
from kvpool.rpc.leader import etcd_channel

log = get_logger(__name__)

DEFAULT_LEASE_TTL_S = 5
# Each etcd call is bounded; a keep-alive is sent three times per lease.
ETCD_CALL_TIMEOUT_S = 2.0
# A standby re-checks the key this often even without a watch event (a broken watch).
RECHECK_S = 2.0


def _etcd_rpc():
    try:
        from aetcd.rpc import rpc_pb2, rpc_pb2_grpc
    except ImportError:
        raise InvalidArgument("--ha needs the aetcd package (pip install aetcd)") from None
    return rpc_pb2, rpc_pb2_grpc


class LeaderElection:
    """Campaign for, hold and give up the leader key of one cluster in etcd. One event loop."""

    def __init__(self, url: EtcdURL, address: str, lease_ttl_s: int = DEFAULT_LEASE_TTL_S,
                 clock: Callable[[], float] = time.monotonic, credentials=None):
        self._pb, self._grpc = _etcd_rpc()
        self._url, self.address = url, address
        self._credentials = credentials   # the master's, for etcds://
        self._ttl = max(1, int(lease_ttl_s))
        self._clock = clock
        self._endpoint = 0
        self._channel: grpc.aio.Channel | None = None
        self._lease_id = 0
        self._valid_until = 0.0     # by our clock, we lead until then unless renewed
        self._revision = 0          # etcd's revision when we last saw the key held
        self.leader: str | None = None   # the leader as last seen (ourselves once elected)
        # Our token port's address (``--tokens``), published beside ours while we lead.
        self.token_address: str | None = None

    def is_leader(self) -> bool:
        """Whether this master may serve now; False as soon as its lease may have lapsed."""
        return self._clock() < self._valid_until

    @property
    def etcd_endpoint(self) -> str:
        return self._url.endpoints[self._endpoint]

    def _stub(self, name: str):
        if self._channel is None:
            self._channel = etcd_channel(self._url, self.etcd_endpoint, self._credentials,
                                         aio=True)
        return getattr(self._grpc, f"{name}Stub")(self._channel)

    async def _next_endpoint(self) -> None:
        """After a failed call: the next etcd endpoint, on a new channel."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        self._endpoint = (self._endpoint + 1) % len(self._url.endpoints)

    async def campaign(self) -> None:
        """Return once this master holds the leader key; until then, track who does."""
        delay = 0.1
        while True:
            try:
                if await self._try_acquire():
                    log.info("leader_elected", address=self.address, lease_ttl_s=self._ttl,
                             key=self._url.key.decode())
                    return
                delay = 0.1
                await self._wait_for_vacancy()
            except (grpc.aio.AioRpcError, MasterUnavailable) as e:
                log.warning("etcd_unreachable", endpoint=self.etcd_endpoint,
                            error=f"{e.code().name}: {e.details()}"
                            if isinstance(e, grpc.aio.AioRpcError) else str(e))
                await self._next_endpoint()
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(2 * delay, 2.0)

    async def _try_acquire(self) -> bool:
        """Put the key with our address on a fresh lease if nobody holds it."""
        pb = self._pb
        sent = self._clock()
        grant = await self._stub("Lease").LeaseGrant(pb.LeaseGrantRequest(TTL=self._ttl),
                                                     timeout=ETCD_CALL_TIMEOUT_S)
        if grant.error:
            raise MasterUnavailable(f"etcd refused a lease: {grant.error}")
        key = self._url.key
        r = await self._stub("KV").Txn(pb.TxnRequest(
            compare=[pb.Compare(key=key, target=pb.Compare.CREATE, result=pb.Compare.EQUAL,
                                create_revision=0)],
            success=[pb.RequestOp(request_put=pb.PutRequest(
                key=key, value=self.address.encode(), lease=grant.ID)), *(
                [pb.RequestOp(request_put=pb.PutRequest(
                    key=self._url.tokens_key, value=self.token_address.encode(),
                    lease=grant.ID))] if self.token_address else [])],
            failure=[pb.RequestOp(request_range=pb.RangeRequest(key=key))]),
            timeout=ETCD_CALL_TIMEOUT_S)
        if r.succeeded:
            self._lease_id, self._valid_until = grant.ID, sent + grant.TTL
            self.leader = self.address
            return True
        kvs = r.responses[0].response_range.kvs
        self.leader = kvs[0].value.decode() if kvs else None
        self._revision = r.header.revision
        with contextlib.suppress(grpc.aio.AioRpcError):   # it would expire anyway
            await self._stub("Lease").LeaseRevoke(pb.LeaseRevokeRequest(ID=grant.ID),
                                                  timeout=ETCD_CALL_TIMEOUT_S)
        return False

    async def _wait_for_vacancy(self) -> None:
        """Until the key is deleted (its holder's lease ended) or RECHECK_S passes."""
        pb = self._pb
        create = pb.WatchRequest(create_request=pb.WatchCreateRequest(
            key=self._url.key, start_revision=self._revision + 1,
            filters=[pb.WatchCreateRequest.NOPUT]))
        # Written, not passed as an iterator: etcd ends a watch whose client half-closes.
        call = self._stub("Watch").Watch(timeout=RECHECK_S)
        try:
            await call.write(create)
            while True:
                response = await call.read()
                if response is grpc.aio.EOF or response.events or response.canceled:
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        finally:
            call.cancel()

    async def hold(self) -> None:
        """Keep the lease alive; return when leadership is lost (the lease ended, or etcd
        could not be reached before it would)."""
        pb = self._pb
        while self.is_leader():
            await asyncio.sleep(self._ttl / 3)
            sent = self._clock()
            left = self._valid_until - sent
            if left <= 0:
                break
            try:
                call = self._stub("Lease").LeaseKeepAlive(
                    iter([pb.LeaseKeepAliveRequest(ID=self._lease_id)]),
                    timeout=min(ETCD_CALL_TIMEOUT_S, left))
                reply = None
                async for reply in call:
                    break
                call.cancel()
                # The key, not only the lease, must still be ours (someone may delete it).
                held = await self._stub("KV").Range(pb.RangeRequest(key=self._url.key),
                                                    timeout=min(ETCD_CALL_TIMEOUT_S, left))
            except grpc.aio.AioRpcError as e:
                log.warning("lease_keepalive_failed", endpoint=self.etcd_endpoint,
                            error=e.code().name, lease_left_s=round(left, 2))
                await self._next_endpoint()
                continue
            if reply is None or reply.TTL <= 0 or not held.kvs \
                    or held.kvs[0].lease != self._lease_id:
                break
            self._valid_until = sent + reply.TTL
        self._valid_until = 0.0
        log.error("leadership_lost", address=self.address, key=self._url.key.decode())

    async def resign(self) -> None:
        """Stop leading now and free the key, so a standby takes over at once."""
        if not self._lease_id:
            return
        self._valid_until = 0.0
        lease, self._lease_id = self._lease_id, 0
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub("Lease").LeaseRevoke(self._pb.LeaseRevokeRequest(ID=lease),
                                                  timeout=ETCD_CALL_TIMEOUT_S)
        log.info("leadership_resigned", address=self.address)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


class LeaderOnly(grpc.aio.ServerInterceptor):
    """Serves calls only while ``election`` says we lead; refuses them with the leader's
    address otherwise. Installed only on HA masters: a single master pays nothing."""

    def __init__(self, election: LeaderElection):
        self._election = election

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return handler
        if not self._election.is_leader():
            return _refusal(handler, self._election.leader, self._election.address)
        if handler.response_streaming and not handler.request_streaming:
            return _fenced_stream(handler, self._election)
        return handler


class _FencedContext:
    """A stream's context whose writes stop once the lease may have lapsed: a leader that
    wakes from a pause must not push manifest changes a new leader knows nothing of."""

    def __init__(self, context, election: LeaderElection):
        self._context, self._election = context, election

    def __getattr__(self, name):
        return getattr(self._context, name)

    async def write(self, message) -> None:
        if not self._election.is_leader():
            await self._context.abort(grpc.StatusCode.UNAVAILABLE,
                                      f"master {self._election.address} lost the leadership")
        await self._context.write(message)


def _fenced_stream(handler: grpc.RpcMethodHandler, election: LeaderElection
                   ) -> grpc.RpcMethodHandler:
    """``handler`` (a server stream that writes to its context) with fenced writes."""
    inner = handler.unary_stream

    async def fenced(request, context):
        fenced_context = _FencedContext(context, election)
        result = inner(request, fenced_context)
        if inspect.isasyncgen(result):      # a stream that yields instead of writing
            async for message in result:
                await fenced_context.write(message)
        else:
            await result

    return grpc.unary_stream_rpc_method_handler(
        fenced, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)


def _refusal(handler: grpc.RpcMethodHandler, leader: str | None, me: str
             ) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAVAILABLE, naming the leader."""
    known = leader if leader and leader != me else None
    message = (f"master {me} is not the leader; leader is {known}" if known else
               f"master {me} is not the leader; no leader is elected yet, retry shortly")
    metadata = ((LEADER_METADATA, known),) if known else ()

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, message, trailing_metadata=metadata)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def advertised(host: str, port: int, advertise: str | None) -> str:
    """The address this master publishes as leader: ``advertise`` (``HOST`` or
    ``HOST:PORT``) or the bound one; a wildcard host must be given one."""
    if advertise:
        return parse_address(advertise if ":" in advertise else f"{advertise}:{port}",
                             "--advertise address")
    if host in ("0.0.0.0", "::", ""):
        raise InvalidArgument(f"--host {host} is not an address clients can dial: with --ha, "
                              "give --advertise HOST (the address others reach this master on)")
    return f"{host}:{port}"


async def serve_ha(config: MasterConfig, host: str, port: int, url: EtcdURL, *,
                   advertise: str | None = None, lease_ttl_s: int = DEFAULT_LEASE_TTL_S,
                   on_started: Callable[[str, str | None], None] | None = None,
                   lookup_port: int | None = 0, metrics_port: int | None = None,
                   credentials=None, tokens=None, token_port: int | None = None) -> None:
    """Run a master that leads while it holds the etcd lease, until SIGINT/SIGTERM (then it
    resigns, for an immediate takeover). Raises MasterUnavailable if it loses the lease."""
    if advertise:
        advertised(host, port or 1, advertise)    # a bad --advertise fails before binding
    elif host in ("0.0.0.0", "::", ""):
        advertised(host, port, None)
    election = LeaderElection(url, "", lease_ttl_s, credentials=credentials)
    server = MasterServer(config, host, port, interceptors=[LeaderOnly(election)],
                          lookup_port=lookup_port, lookup_refusal=lambda: None
                          if election.is_leader() else f"master {election.address} does not lead",
                          metrics_port=metrics_port, credentials=credentials, tokens=tokens,
                          token_port=token_port)
    await server.start()
    election.address = advertised(host, server.port, advertise)
    if server.token_port is not None:   # token clients find it in etcd while we lead
        # On the advertised host, with the bound port (--token-port to fix it).
        election.token_address = f"{election.address.rpartition(':')[0]}:{server.token_port}"
    if on_started:   # the address clients use, and the metrics server's (if any)
        on_started(election.address, server.metrics_address)
    if election.token_address:
        print(f"tokens: {election.token_address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait())
    # Both restart after a crash: campaigning again is what campaign does after any failure,
    # and fencing does not rest on hold (every call is checked against the lease's deadline):
    # a hold that keeps crashing renews nothing, the lease runs out, and this master stops
    # leading and exits as after any lost lease.
    supervisor = Supervisor()
    task = asyncio.create_task(supervisor.run("election", election.campaign, RESTART))
    lost = False
    try:
        await asyncio.wait([stopping, task], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            task = asyncio.create_task(supervisor.run("lease", election.hold, RESTART))
            await asyncio.wait([stopping, task], return_when=asyncio.FIRST_COMPLETED)
            lost = task.done()
    finally:
        for t in (task, stopping):
            t.cancel()
        await election.resign()
        # A short grace even when the lease is lost: calls are refused already (fencing), and
        # the manifest streams, ended first, complete instead of being cancelled.
        await server.stop(0.2 if lost else 1.0)
        await election.close()
    if lost:
        raise MasterUnavailable("lost the leadership (the etcd lease ended); exiting so that "
                                "this master comes back as a fresh standby")
