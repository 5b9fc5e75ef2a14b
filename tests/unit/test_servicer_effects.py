"""Effects applied in one place: every RPC of the Master service is declared read-only or runs
under ``@mutation``, and a mutation answers only once the watching nodes applied what it
changed in their manifests (a master in this process, on 127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio
import time

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


async def test_fenced_and_sealed_puts_answer_without_the_nodes_ack_unless_a_removal_is_out(
        master):
    """A writer that reserves and seals at the node itself (DESIGN.md, Fenced and sealed puts)
    is answered at once, its changes still sent to the node (with the stream's next message);
    but not while a removal is queued or unacknowledged: the object must be out of its
    manifest first."""
    stub = master
    stream = await watching_node(stub)
    mount = await stub.MountSegment(pb.MountSegmentRequest(
        node=wire.node_to_pb(NodeEndpoints("n1", "boot", "n1:1")),
        segment=wire.segment_to_pb(SegmentInfo("n1-s", 1 << 20)), keeps_manifest=True))
    started = await asyncio.wait_for(stub.PutStart(pb.PutStartRequest(
        keys=["k"], sizes=[100], fenced=True)), 1)   # no ack is ever sent for it
    assert started.epoch == mount.epoch != 0 and list(started.versions) != [0]
    assert started.hold_s > started.put_timeout_s
    await asyncio.wait_for(stub.PutEnd(pb.PutEndRequest(keys=["k"], sealed=True)), 1)
    seqs = []
    while True:   # sent all the same: the reservation and the commit
        changes = await asyncio.wait_for(stream.read(), 5)
        seqs.append(changes.seq)
        if list(changes.committed.keys) == ["k"]:
            break
    await stub.AckManifest(pb.AckManifestRequest(node_id="n1", seq=seqs[-1]))
    # A removal on its way to the node: a fenced put waits for it like any other.
    remove = asyncio.ensure_future(stub.Remove(pb.KeysRequest(keys=["k"])))
    removal = await asyncio.wait_for(stream.read(), 5)
    assert list(removal.removed_keys) == ["k"]
    put = asyncio.ensure_future(stub.PutStart(pb.PutStartRequest(keys=["j"], sizes=[100],
                                                                 fenced=True)))
    await asyncio.sleep(0.2)
    assert not put.done(), "a fenced put answered while a removal was unacknowledged"
    await stub.AckManifest(pb.AckManifestRequest(node_id="n1", seq=removal.seq))
    await asyncio.wait_for(remove, 5)
    reservation = await asyncio.wait_for(stream.read(), 5)
    await stub.AckManifest(pb.AckManifestRequest(node_id="n1", seq=reservation.seq))
    await asyncio.wait_for(put, 5)
    stream.cancel()


def test_answers_describe_a_segment_as_its_node_now_is():
    """Segment descriptors are made once per membership, not per answer (servicer.py
    ``_Descriptors``): a node that comes back with new endpoints is described anew, in the
    answers of both GetReplicas and PutStart."""
    from kvpool.master.state import MasterState

    state = MasterState(MasterConfig(), time.monotonic)
    servicer = MasterServicer(state)

    def mount(boot: str, tcp: str) -> None:
        state.mount_segment(NodeEndpoints("n1", boot, tcp), SegmentInfo("n1/0", 1 << 20))

    def stored(key: str) -> str:
        state.put_start([key], [64])
        state.put_end([key])
        answer = servicer.get_replicas(pb.KeysRequest(keys=[key]))
        [location] = answer.replicas.locations
        return location.node.tcp_endpoint

    mount("boot-1", "127.0.0.1:1")
    assert stored("a") == "127.0.0.1:1"
    assert stored("b") == "127.0.0.1:1"
    mount("boot-2", "127.0.0.1:2")   # the node restarted: new endpoints, its segment again
    assert stored("c") == "127.0.0.1:2"
    started = servicer.put_start(pb.PutStartRequest(keys=["d"], sizes=[64]))
    assert [loc.node.tcp_endpoint for loc in started.replicas.locations] == ["127.0.0.1:2"]
