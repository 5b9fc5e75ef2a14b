"""grpc.aio wiring for the master: the servicer, a periodic tick, clean shutdown on signals."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Sequence

import grpc
from kvpool.common.config import MasterConfig
from kvpool.common.logging import get_logger
from kvpool.common.loops import OnCrash, Supervisor
from kvpool.common.metrics import MetricsServer, new_registry
from kvpool.common.security import Credentials, Tokens
from kvpool.master.auth import Authorizer
from kvpool.master.lookup_server import LookupServer, Stream
from kvpool.master.lookup_sessions import LookupSessions
from kvpool.master.metrics import GcPauses, MasterCollector, RpcMetrics, ServerFigures
from kvpool.master.request_guard import RequestGuard
from kvpool.master.routing import RoutingIndex, RoutingLimits
from kvpool.master.routing_servicer import RouterServicer, store_lookup
from kvpool.master.servicer import MasterServicer
from kvpool.master.state import MasterState
from kvpool.net import lookup_port
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.protos.kvpool.v1 import master_pb2_grpc, routing_pb2_grpc
from kvpool.protos.kvpool.v1 import routing_pb2 as routing_pb
from kvpool.rpc.wire import GRPC_OPTIONS

log = get_logger(__name__)
# The tick expires nodes, puts, leases and moves. One that raised may have left the index half
# changed, and going on without it would leak space and keep dead nodes indexed: the master
# stops instead, and a new one rebuilds the index from what the nodes re-announce (the path a
# master restart takes anyway, which loses no cached data).
TICK_ON_CRASH = OnCrash(restarts=0, why="the master's index may be half updated; a restarted "
                                        "master rebuilds it from the store nodes")


def _log_eviction(key: str, version: int) -> None:
    log.debug("object_evicted", key=key, version=version)



class MasterServer:
    """A master process's server: ``await start()``, then ``await stop()``."""

    def __init__(self, config: MasterConfig, host: str = "127.0.0.1", port: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 lookup_port: int | None = 0,
                 lookup_refusal: Callable[[], str | None] = lambda: None,
                 supervisor: Supervisor | None = None, metrics_port: int | None = None,
                 credentials: Credentials | None = None, tokens: Tokens | None = None,
                 token_port: int | None = None):
        """``interceptors``: wrap every call (master/ha.py refuses them on a standby).
        ``lookup_port``: where to serve lookups besides gRPC (master/lookup_server.py; 0: any
        free port, None: nowhere); ``lookup_refusal`` says why they are refused, if they are.
        ``supervisor`` runs the tick (common/loops.py; a test's does not exit).
        ``metrics_port``: where to serve /metrics, /healthz and /readyz (common/metrics.py;
        0: any free port, None: nowhere).
        ``credentials``: serve gRPC as mutual TLS with client certificates required, the
        lookup port as sessions opened over it (net/lookup_port.py), and check each call
        against its caller's role (master/auth.py); None: plain text, nothing checked (a
        test's in-process master, ``--insecure``).
        ``tokens`` (with credentials): also serve gRPC on ``token_port`` (0: any free port) as
        TLS without client certificates, each call's bearer token naming its caller (for
        clients that cannot hold a certificate; common/security.py ``Tokens``)."""
        if tokens is not None and credentials is None:
            raise ValueError("bearer tokens need the master's credentials (TLS)")
        self.credentials, self._tokens, self._token_port = credentials, tokens, token_port
        self.token_port: int | None = None
        self.config = config
        self._interceptors = list(interceptors)
        self._lookup_port, self._lookup_refusal = lookup_port, lookup_refusal
        self._lookup: LookupServer | None = None
        self._rpc_metrics: RpcMetrics | None = None
        # Each eviction at debug level: an auditor (kvpool soak) tells evictions from losses.
        self.state = MasterState(config, clock, on_evict=_log_eviction)
        # The routing index (instances' own caches, from KV events) reads the object index
        # as its "store" tier; both live on this process's one event loop.
        self.routing = RoutingIndex(clock, store_lookup=store_lookup(self.state),
                                    limits=RoutingLimits(
                                        config.max_routing_instances,
                                        config.max_routing_instances_per_tenant,
                                        config.max_routing_blocks_per_instance,
                                        config.max_routing_blocks))
        self._host, self._port = host, port
        self._server: grpc.aio.Server | None = None
        self._ticker: asyncio.Task | None = None
        self._supervisor = supervisor or Supervisor()
        self._metrics_port = metrics_port
        self.metrics: MetricsServer | None = None
        self._gc_pauses: GcPauses | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    @property
    def metrics_address(self) -> str | None:
        """Where /metrics and the probes are served, if they are."""
        return self.metrics.address if self.metrics else None

    async def start(self) -> str:
        """Bind and serve; return the bound ``host:port``."""
        # The guard innermost: the other interceptors see its typed answers.
        interceptors = [*self._interceptors, RequestGuard()]
        if self.credentials is not None:   # outside a standby's refusal: strangers learn nothing
            interceptors.insert(0, Authorizer(tokens=self._tokens))
        if self._metrics_port is not None:
            # Bound first: a port that is taken fails the start before anything serves.
            registry = new_registry()
            self._collector = MasterCollector(self.state, asyncio.get_running_loop(),
                                              lambda: self._lookup_refusal() is None,
                                              self._figures)
            registry.register(self._collector)
            self._gc_pauses = GcPauses()
            registry.register(self._gc_pauses)
            self._rpc_metrics = RpcMetrics(registry)
            interceptors.insert(0, self._rpc_metrics)   # first: refused calls count too
            self.metrics = MetricsServer(registry, self._not_ready, self._host,
                                         self._metrics_port)
        try:
            await self._serve(interceptors)
        except BaseException:
            if self.metrics:
                self.metrics.stop()
                self._gc_pauses.close()
            raise
        self._ticker = asyncio.create_task(
            self._supervisor.run("tick", self._tick_forever, TICK_ON_CRASH))
        if self.metrics:
            self.metrics.start()
        log.info("master_started", address=self.address, lookup_port=self._servicer.lookup_port,
                 security=f"mutual TLS, CA {self.credentials.ca_file}" if self.credentials
                 else "none (plain text, every caller trusted)", token_port=self.token_port,
                 **vars(self.config))
        return self.address

    def _figures(self) -> ServerFigures:
        """What the server around the state counts, for the metrics (on the event loop)."""
        unacked, timeouts = self._servicer.manifest_lag()
        calls = self._lookup.calls if self._lookup else {}
        return ServerFigures({lookup_port.METHOD_NAMES[m]: n for m, n in calls.items()},
                             unacked, timeouts, len(self.routing.instances()),
                             self.routing.total_blocks, self.routing.dropped_blocks)

    async def _serve(self, interceptors: list[grpc.aio.ServerInterceptor]) -> None:
        """Serve gRPC, and lookups on their port; nothing left serving if either fails."""
        self._server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
        self._servicer = MasterServicer(self.state)
        master_pb2_grpc.add_MasterServicer_to_server(self._servicer, self._server)
        router = RouterServicer(self.routing)
        routing_pb2_grpc.add_RouterServicer_to_server(router, self._server)
        try:
            if self.credentials is None:
                self.port = self._server.add_insecure_port(f"{self._host}:{self._port}")
            else:
                self.port = self._server.add_secure_port(f"{self._host}:{self._port}",
                                                         self.credentials.grpc_server())
                if self._tokens is not None:
                    self.token_port = self._server.add_secure_port(
                        f"{self._host}:{self._token_port or 0}",
                        self.credentials.grpc_server_tls_only())
        except RuntimeError as e:
            raise OSError(f"cannot listen on {self._host}:{self._port}: {e}") from None
        await self._server.start()
        if self._lookup_port is not None:
            servicer = self._servicer
            self._lookup = LookupServer({
                lookup_port.GET_REPLICAS: (pb.KeysRequest, servicer.get_replicas),
                lookup_port.EXISTS: (pb.KeysRequest, servicer.exists),
                lookup_port.PUT_START: (pb.PutStartRequest,
                                        servicer.with_effects(servicer.put_start)),
                lookup_port.PUT_END: (pb.PutEndRequest, servicer.with_effects(servicer.put_end)),
                lookup_port.PUT_REVOKE: (pb.KeysRequest,
                                         servicer.with_effects(servicer.put_revoke)),
                lookup_port.ROUTE: (routing_pb.RouteRequest, router.route),
            }, self._lookup_refusal,
                on_call=self._rpc_metrics.observe if self._rpc_metrics else None,
                streams={lookup_port.WATCH_MANIFEST: Stream(
                    pb.WatchManifestRequest, servicer.watch_manifest, lookup_port.ACK_MANIFEST,
                    pb.AckManifestRequest, servicer.ack_manifest)},
                sessions=None if self.credentials is None else LookupSessions(
                    self.config.lookup_session_ttl_s,
                    self.config.max_lookup_sessions_per_identity))
            self._servicer.lookup_sessions = self._lookup.sessions
            try:
                self._servicer.lookup_port = router.lookup_port = await self._lookup.start(
                    self._host, self._lookup_port)
            except OSError as e:
                await self._server.stop(0)
                raise OSError(f"cannot listen on {self._host}:{self._lookup_port} for "
                              f"lookups: {e.strerror or e}") from None

    async def _tick_forever(self) -> None:
        # Expiry resolution: a tenth of the shortest timeout, never busier than 20 Hz.
        period = max(0.05, min(self.config.node_ttl_s, self.config.put_timeout_s,
                               self.config.lease_ttl_s) / 10)
        while True:
            await asyncio.sleep(period)
            for node, silent_s, dropped in self.state.tick():
                log.warning("node_expired", node=node, silent_s=round(silent_s, 2),
                            objects_dropped=dropped)
            for instance in self.routing.tick():
                log.info("instance_aged_out", instance=instance)

    def _not_ready(self) -> str | None:
        """Why this master should not take traffic now (readiness probe), or None."""
        refusal = self._lookup_refusal()
        if refusal:
            return refusal   # a standby: it refuses every call
        recovering = self._collector.snapshot()[0].recovering_segments
        if recovering:
            return f"index being rebuilt: {recovering} segments not announced yet"
        return None

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.metrics:
            self.metrics.stop()
            self._gc_pauses.close()
        if self._ticker:
            self._ticker.cancel()
        if self._server:
            self._servicer.close_streams()   # first: the lookup port's streams end with them
        if self._lookup:
            await self._lookup.stop()
        if self._server:
            await self._server.stop(grace_s)
        log.info("master_stopped", address=self.address)


async def serve(config: MasterConfig, host: str, port: int,
                on_started: Callable[[str, str | None], None] | None = None,
                lookup_port: int | None = 0, metrics_port: int | None = None,
                credentials: Credentials | None = None, tokens: Tokens | None = None,
                token_port: int | None = None) -> None:
    """Run a master until SIGINT/SIGTERM."""
    server = MasterServer(config, host, port, lookup_port=lookup_port,
                          metrics_port=metrics_port, credentials=credentials, tokens=tokens,
                          token_port=token_port)
    address = await server.start()
    if on_started:   # the address clients use, and the metrics server's (if any)
        on_started(address, server.metrics_address)
    if server.token_port is not None:
        print(f"tokens: {host}:{server.token_port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
