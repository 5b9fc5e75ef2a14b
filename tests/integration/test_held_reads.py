"""Single gets over tcp at a place the client put or got before (READ_HELD: net/data_port.py,
client/local_reads.py) against a real secure master and store nodes: served with no master
call, never another object's bytes, never a removed object's, only under a READ_HELD grant,
and counted by the master."""

from __future__ import annotations

import signal
import socket
import time

import pytest
from kvpool.client import KVClient
from kvpool.common.errors import ObjectNotFound
from kvpool.net.data_port import HELD_TRAILER, RESPONSE, FrameStatus, Op, encode_request
from kvpool.net.sockets import recv_exact
from kvpool.rpc.master_client import MasterClient

from .conftest import run_cluster
from .test_local_reads import served_locally, value_of

VALUE = 64 << 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from run_cluster(tmp_path_factory.mktemp("held-reads"), nodes=1,
                           segment_size="16MiB")


def tcp_client(cluster, **kw) -> KVClient:
    return KVClient(cluster.master, transports=["tcp"], **kw)


def served_held(client: KVClient, key: str) -> bytes:
    return served_locally(client, key, reads="_held")


@pytest.mark.parametrize("slots", [True, False])
def test_an_object_put_is_read_again_with_the_master_stopped(cluster, slots):
    key = f"still-{slots}"
    with tcp_client(cluster, timeout_s=2.0, put_slots=slots) as c:
        c.put(key, value_of(key))
        assert len(c._held) == 1   # the put's PutStart (its slot's) gave its place
        assert served_held(c, key) == value_of(key)
        master = cluster.master_proc.popen
        master.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert c.get(key) == value_of(key)
            assert time.monotonic() - started < 1.0
        finally:
            master.send_signal(signal.SIGCONT)
    with tcp_client(cluster, local_reads=False) as plain:
        assert plain.get(key) == value_of(key)
        assert plain._held is None


def test_a_get_keeps_the_place_for_the_next_one(cluster):
    with tcp_client(cluster) as writer, tcp_client(cluster) as reader:
        writer.put("shared", value_of("shared"))
        assert reader.get("shared") == value_of("shared")   # asks the master
        assert reader._held.served == 0 and len(reader._held) == 1
        assert served_held(reader, "shared") == value_of("shared")


def test_a_key_removed_by_another_client_is_not_read_at_its_old_place(cluster):
    with tcp_client(cluster) as owner, tcp_client(cluster) as reader:
        owner.put("gone", value_of("gone"))
        served_held(reader, "gone")
        owner.remove("gone")   # answered once the node dropped it
        with pytest.raises(ObjectNotFound):
            reader.get("gone")
        assert len(reader._held) == 0


def _read_held(replica, grant: bytes, op: Op = Op.READ_HELD) -> tuple[int, bytes]:
    e = replica.extent
    host, _, port = replica.node.tcp_endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(encode_request(op, e.segment_id, e.offset, e.length, grant))
        status, n = RESPONSE.unpack(recv_exact(s, RESPONSE.size))
        return status, recv_exact(s, n) if n else b""


def test_a_held_read_needs_a_read_held_grant_for_its_object(cluster):
    """The data port: READ_HELD with a plain READ grant, or READ with a READ_HELD grant, is
    DENIED (the MAC names the operation); with its own grant it is the object's bytes and the
    trailer 1; once the object is removed, NOT_HELD."""
    with tcp_client(cluster) as c:
        c.put("guarded", value_of("guarded", 4096))
        served_held(c, "guarded")   # its commit reached the node
        with MasterClient(cluster.master) as mc:
            answer = mc.locate_answer(["guarded"], held=True)
        from kvpool.rpc.located import only_replica
        replica = only_replica(answer)
        held = answer.held_grants
        assert len(held) == 32 and held != replica.grant
        assert _read_held(replica, replica.grant)[0] == FrameStatus.DENIED
        assert _read_held(replica, held, Op.READ)[0] == FrameStatus.DENIED
        assert _read_held(replica, b"")[0] == FrameStatus.DENIED
        status, data = _read_held(replica, held)
        assert status == FrameStatus.OK
        assert data[:-HELD_TRAILER.size] == value_of("guarded", 4096)
        assert HELD_TRAILER.unpack(data[-HELD_TRAILER.size:]) == (1,)
        c.remove("guarded")
        status, message = _read_held(replica, held)
        assert status == FrameStatus.NOT_HELD, message


def test_bytes_sent_while_the_object_was_dropped_are_not_trusted(bare_master):
    """The trailer: while the node sends a READ_HELD's bytes, it voids the object (as a
    writer's RESERVE of that space would) and the bytes change: the read is not trusted."""
    from kvpool.store_node.node import StoreNode

    node = StoreNode(bare_master.master, [8 << 20], node_id="inproc", rdma_device=False,
                     scrub_bytes_per_s=0, shm=False)
    node.start()
    try:
        with tcp_client(bare_master) as c:
            c.put("raced", value_of("raced"))
            served_held(c, "raced")
            rec = node.manifest.get("raced")
            segment = node.segments[rec.segment_id]
            replica, size = c._held.place("raced")
            tcp = c._transport_for(replica)
            buf = memoryview(bytearray(size))
            assert tcp.read_held(replica, buf) and bytes(buf) == value_of("raced")
            send_to = segment.send_to

            def overwritten_meanwhile(sock, offset, length, header=b""):
                send_to(sock, offset, length, header)
                node.manifest.overwriting(rec.segment_id, rec.offset, rec.size)
                segment.buffer[rec.offset:rec.offset + rec.size] = value_of("other", rec.size)

            segment.send_to = overwritten_meanwhile
            assert not tcp.read_held(replica, buf)
            segment.send_to = send_to
            assert not tcp.read_held(replica, buf)   # refused from now on
    finally:
        node.stop()
