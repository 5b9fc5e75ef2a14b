"""The Router gRPC service, hosted by the master process: registration, KV events, Route.

Thin like the Master servicer: protobuf <-> RoutingIndex calls, errors -> gRPC status. It runs
on the master's one asyncio loop, so the index and the object index need no locks.
"""

from __future__ import annotations

import grpc
from kvpool.common.errors import InvalidArgument, LimitExceeded
from kvpool.common.hashing import SPEC_NAME, HashSpec, block_key
from kvpool.common.logging import get_logger
from kvpool.common.tenants import scoped, tenant_of
from kvpool.master.auth import caller_tenant
from kvpool.master.routing import (
    Candidate,
    RouteQuery,
    RoutingIndex,
    RoutingPolicy,
    StoreLookup,
    make_policy,
)
from kvpool.master.state import MasterState
from kvpool.protos.kvpool.v1 import routing_pb2 as pb
from kvpool.protos.kvpool.v1 import routing_pb2_grpc
from kvpool.rpc.routing_wire import events_from_pb

log = get_logger(__name__)
_MAX_BLOCKS = 65536


def store_lookup(state: MasterState) -> StoreLookup:
    """The store tier of the routing index: whether the object index holds each block, among
    the tenant's objects (no tenant can learn what another's store holds)."""
    return lambda hashes, tenant="": state.exists([scoped(tenant, block_key(h))
                                                   for h in hashes])


class RouterServicer(routing_pb2_grpc.RouterServicer):
    """``spec``: the cluster's hash spec; None lets the first registering client fix it."""

    def __init__(self, index: RoutingIndex, spec: HashSpec | None = None, seed: int = 0):
        self.lookup_port = 0   # named in Route answers once the master's lookup port is bound
        self.index = index
        self.spec = spec
        self._policies: dict[str, RoutingPolicy] = {}   # stateful ones (round robin) persist
        self._seed = seed

    async def RegisterClient(self, request, context):
        name, size = request.spec.name or SPEC_NAME, request.spec.block_size
        if self.spec is None:
            try:
                self.spec = HashSpec(size, name=name)
            except InvalidArgument as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            log.info("hash_spec_fixed", spec=name, block_size=size, client=request.client_id)
        elif (name, size) != (self.spec.name, self.spec.block_size):
            log.warning("client_refused", client=request.client_id, spec=name, block_size=size)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"hash spec mismatch: this cluster hashes {self.spec.block_size}-token blocks "
                f"with {self.spec.name}; the client uses {size}-token blocks with {name}. Its "
                f"keys could never match the cluster's: configure the engine's block size to "
                f"{self.spec.block_size}")
        return pb.RegisterClientResponse(cluster_spec=pb.HashSpec(
            name=self.spec.name, block_size=self.spec.block_size))

    async def PublishKVEvents(self, request_iterator, context):
        batches = events = 0
        tenant = caller_tenant()   # a tenant's instances are its own (common/tenants.py)
        async for batch in request_iterator:
            instance = scoped(tenant, batch.instance_id)
            try:
                events += self.index.apply(instance, events_from_pb(batch))
                if batch.url or batch.role:
                    self.index.announce(instance, batch.url, batch.role)
            except InvalidArgument as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except LimitExceeded as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            batches += 1
        return pb.PublishKVEventsResponse(batches=batches, events=events)

    async def Route(self, request, context):
        try:
            response = self.route(request)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        response.lookup_port = self.lookup_port
        return response

    def route(self, request: pb.RouteRequest) -> pb.RouteResponse:
        """Route's answer (also served on the master's lookup port: a gateway routes every
        request); InvalidArgument if the request is malformed."""
        query = self._query(request)
        tenant = request.tenant   # a tenant routes among its own instances only
        candidates = [Candidate(scoped(tenant, c.instance_id), c.queue_depth,
                                c.inflight_prefill_tokens, c.prefill_tokens_per_s,
                                c.store_tokens_per_s, c.decoding_requests)
                      for c in request.candidates] or None
        if candidates is None and tenant:
            candidates = [Candidate(i) for i in self.index.instances()
                          if tenant_of(i)[0] == tenant]
        decision = self.index.route(query, candidates, self._policy(request.policy))
        return pb.RouteResponse(
            instance_id=tenant_of(decision.instance_id)[1] if tenant else decision.instance_id,
            policy=decision.policy, blocks=len(query.hashes),
            estimated_ttft_s=decision.estimated_ttft_s,
            hits=[pb.TierHits(tier=t, blocks=b) for t, b in decision.hit_blocks.items()])

    async def ListInstances(self, request, context):
        tenant = caller_tenant()   # a client sees its tenant's instances only
        infos = []
        for v in self.index.describe():
            owner, named = tenant_of(v.instance_id)
            if not tenant or owner == tenant:
                infos.append(pb.InstanceInfo(
                    instance_id=named if tenant else v.instance_id, url=v.url, role=v.role,
                    gpu_blocks=v.gpu_blocks, cpu_blocks=v.cpu_blocks, seen_s_ago=v.seen_s_ago))
        return pb.ListInstancesResponse(instances=infos)

    def _policy(self, name: str) -> RoutingPolicy:
        policy = make_policy(name, self._seed)
        return self._policies.setdefault(policy.name, policy)

    def _query(self, request: pb.RouteRequest) -> RouteQuery:
        if request.token_ids and request.block_hashes:
            raise InvalidArgument("give token_ids or block_hashes, not both")
        if self.spec is None:
            raise InvalidArgument("no client has registered a hash spec yet: call "
                                  "RegisterClient first")
        size = self.spec.block_size
        if request.token_ids:
            spec = HashSpec(size, tuple((k.name, k.value) for k in request.extra_keys))
            hashes = tuple(spec.hashes(request.token_ids))
            return RouteQuery(hashes, len(request.token_ids), size, request.tenant)
        if len(request.block_hashes) > _MAX_BLOCKS:
            raise InvalidArgument(f"{len(request.block_hashes)} blocks; the limit is {_MAX_BLOCKS}")
        hashes = tuple(request.block_hashes)
        return RouteQuery(hashes, request.prompt_tokens or len(hashes) * size, size,
                          request.tenant)
