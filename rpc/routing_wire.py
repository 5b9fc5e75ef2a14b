"""KV events <-> the Router service's protobuf: both directions, for the publisher
(:mod:`kvpool.client.router`) and the master (:mod:`kvpool.master.routing_servicer`)."""

from __future__ import annotations

from collections.abc import Iterable

from kvpool.common.errors import InvalidArgument
from kvpool.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    tier_of_medium,
)
from kvpool.protos.kvpool.v1 import routing_pb2 as pb


def batch_to_pb(instance_id: str, events: Iterable[KVEvent], ts: float = 0.0) -> pb.KVEventBatch:
    out = pb.KVEventBatch(instance_id=instance_id, ts=ts)
    for ev in events:
        if isinstance(ev, BlockStored):
            out.events.add(stored=pb.BlockStored(block_hashes=list(ev.hashes), medium=ev.tier))
        elif isinstance(ev, BlockRemoved):
            out.events.add(removed=pb.BlockRemoved(block_hashes=list(ev.hashes), medium=ev.tier))
        elif isinstance(ev, AllBlocksCleared):
            out.events.add(cleared=pb.AllBlocksCleared())
        else:
            raise InvalidArgument(f"not a KV event: {ev!r}")
    return out


def events_from_pb(batch: pb.KVEventBatch) -> list[KVEvent]:
    out: list[KVEvent] = []
    for ev in batch.events:
        kind = ev.WhichOneof("event")
        if kind == "stored":
            out.append(BlockStored(tuple(ev.stored.block_hashes), tier_of_medium(ev.stored.medium)))
        elif kind == "removed":
            out.append(BlockRemoved(tuple(ev.removed.block_hashes),
                                    tier_of_medium(ev.removed.medium)))
        elif kind == "cleared":
            out.append(AllBlocksCleared())
    return out
