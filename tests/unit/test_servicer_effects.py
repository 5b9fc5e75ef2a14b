"""Effects applied in one place: every RPC of the Master service is declared read-only or runs
under ``@mutation``, and a mutation answers only once the watching nodes applied what it
changed in their manifests (a master in this process, on 127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from kvpool.common.config import MasterConfig
from kvpool.common.types import NodeEndpoints, SegmentInfo
from kvpool.master.server import MasterServer
from kvpool.master.servicer import READ_ONLY, MasterServicer
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.protos.kvpool.v1 import master_pb2_grpc
from kvpool.rpc import wire

RPCS = [m.name for m in pb.DESCRIPTOR.services_by_name["Master"].methods]


def test_every_rpc_is_declared_read_only_or_applies_its_effects():
    assert READ_ONLY <= set(RPCS), f"not RPCs of the service: {READ_ONLY - set(RPCS)}"
    for name in RPCS:
        wrapped = getattr(getattr(MasterServicer, name), "applies_effects", False)
        if name in READ_ONLY:
            assert not wrapped, f"{name} is declared read-only but runs under @mutation"
        else:
            assert wrapped, (f"{name} may change the index but does not run under @mutation "
                             "(servicer.py): it could answer before its changes are durable; "
                             "wrap it, or declare it in READ_ONLY if it changes nothing")


@pytest.fixture
async def master():
    server = MasterServer(MasterConfig(), lookup_port=None)
    address = await server.start()
    async with grpc.aio.insecure_channel(address) as channel:
        yield master_pb2_grpc.MasterStub(channel)
    await server.stop(0)


async def watching_node(stub, node_id: str = "n1"):
    """A node that keeps a manifest, with its WatchManifest stream open."""
    await stub.MountSegment(pb.MountSegmentRequest(
        node=wire.node_to_pb(NodeEndpoints(node_id, "boot", f"{node_id}:1")),
        segment=wire.segment_to_pb(SegmentInfo(f"{node_id}-s", 1 << 20)), keeps_manifest=True))
    stream = stub.WatchManifest(pb.WatchManifestRequest(node_id=node_id))
    assert (await stream.read()).seq == 0   # the stream is open
    return stream


async def answered_after_ack(stub, stream, call) -> pb.ManifestChanges:
    """Start ``call``; it must not answer before the node acknowledges the change it made."""
    task = asyncio.ensure_future(call)
    changes = await asyncio.wait_for(stream.read(), 5)
    await asyncio.sleep(0.1)
    assert not task.done(), "answered before the node applied the change"
    await stub.AckManifest(pb.AckManifestRequest(node_id="n1", seq=changes.seq))
    await asyncio.wait_for(task, 5)
    return changes


async def test_mutations_answer_once_the_node_applied_their_changes(master):
    stub = master
    stream = await watching_node(stub)
    changes = await answered_after_ack(
        stub, stream, stub.PutStart(pb.PutStartRequest(keys=["k"], sizes=[100])))
    assert list(changes.reserved.keys) == ["k"]
    changes = await answered_after_ack(stub, stream, stub.PutEnd(pb.PutEndRequest(keys=["k"])))
    assert list(changes.committed.keys) == ["k"]
    changes = await answered_after_ack(
        stub, stream, stub.Pin(pb.PinRequest(keys=["k"])))
    assert list(changes.committed.pinned) == [True]
    changes = await answered_after_ack(
        stub, stream, stub.Remove(pb.KeysRequest(keys=["k"])))
    assert list(changes.removed_keys) == ["k"]
    # Changing nothing a manifest holds waits for nothing (no node ack comes here).
    for call in (stub.Exists(pb.KeysRequest(keys=["k"])), stub.Remove(pb.KeysRequest(keys=["k"])),
                 stub.Pin(pb.PinRequest(keys=["x"], ttl_s=5))):
        await asyncio.wait_for(call, 1)
    stream.cancel()
