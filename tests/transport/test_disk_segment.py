"""The disk tier's pieces without a cluster: a DiskSegment served over tcp (sendfile reads),
node-side copies DRAM <-> disk, the manifest log's replay, and DiskTier's refusals."""

from __future__ import annotations

import json
import os

import pytest
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.errors import InvalidArgument, NoSpace
from kvpool.common.host import local_boot_id
from kvpool.common.types import Extent, NodeEndpoints, ObjectRecord, Replica
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.disk import MANIFEST, META, DiskTier
from kvpool.store_node.memory import create_dram_segment

SIZE = 4 << 20


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path / "disk", SIZE, "n1")
    t.open("n1")
    yield t
    t.close()


def test_a_disk_segment_is_read_and_written_over_tcp(tier):
    seg = tier.segment
    server = DataServer({seg.info.segment_id: seg}, shm=True)
    server.start()
    transport = TCPTransport(timeout_s=5)
    try:
        node = NodeEndpoints("n1", local_boot_id(), server.tcp_endpoint, server.shm_endpoint)
        payload = os.urandom(3 << 20)
        replica = Replica(node, Extent(seg.info.segment_id, 4096, len(payload)), tier="disk")
        assert transport.write([IoOp(replica, memoryview(payload))]) == [None]
        seg.sync()
        out = bytearray(len(payload))
        assert transport.read([IoOp(replica, memoryview(out))]) == [None]   # via sendfile
        assert out == payload
        beyond = Replica(node, Extent(seg.info.segment_id, SIZE - 10, 20), tier="disk")
        assert transport.read([IoOp(beyond, memoryview(bytearray(20)))])[0] is not None
        assert seg.fd == -1   # never handed to same-host clients
    finally:
        transport.close()
        server.stop()


def test_node_side_copies_between_dram_and_disk(tier):
    dram = create_dram_segment("n1", 0, 1 << 20)
    try:
        data = os.urandom(300_000)
        dram.buffer[64:64 + len(data)] = data
        tier.segment.write_from(8192, dram.buffer[64:64 + len(data)])        # demotion
        back = create_dram_segment("n1", 1, 1 << 20)
        tier.segment.read_into(8192, back.buffer[0:len(data)])               # promotion
        assert bytes(back.buffer[:len(data)]) == data
        back.close()
        with pytest.raises(ValueError):
            tier.segment.write_from(SIZE - 10, memoryview(b"x" * 20))
    finally:
        dram.close()


def test_the_manifest_log_survives_a_restart_and_is_compacted(tmp_path):
    t = DiskTier(tmp_path / "d", SIZE, None)
    t.open("node-a")
    sid = t.segment.info.segment_id
    r1 = ObjectRecord("k1", sid, 0, 100, 7, 1)
    r2 = ObjectRecord("k2", sid, 128, 100, None, 2)
    t.manifest.apply([r1, r2, ObjectRecord("dram-only", "n/0-x", 0, 5, None, 3)], [])
    # k2 promoted to DRAM (committed elsewhere), k1 removed then put again on disk.
    t.manifest.apply([ObjectRecord("k2", "n/0-x", 64, 100, None, 4)], [("k1", 1)])
    t.manifest.apply([ObjectRecord("k1", sid, 256, 100, 9, 5)], [])
    with open(tmp_path / "d" / MANIFEST, "a") as f:
        f.write('{"c": ["torn", ')   # a crash mid-line
    t.close()
    again = DiskTier(tmp_path / "d", SIZE, None)   # no --node-id: the directory's is taken
    assert again.node_id == "node-a"
    again.open(again.node_id)
    assert again.segment.info.segment_id == sid
    assert again.manifest.records() == [ObjectRecord("k1", sid, 256, 100, 9, 5)]
    assert len((tmp_path / "d" / MANIFEST).read_text().splitlines()) == 1   # compacted
    again.close()


def test_the_manifest_log_keeps_parents_and_pins_and_reads_logs_written_without_them(tmp_path):
    t = DiskTier(tmp_path / "d", SIZE, None)
    t.open("node-a")
    sid = t.segment.info.segment_id
    t.manifest.apply([ObjectRecord("p", sid, 0, 100, 7, 1),
                      ObjectRecord("c", sid, 128, 100, 8, 2, "p"),
                      ObjectRecord("h", sid, 512, 100, 8, 4, None, True)], [])
    t.close()
    with open(tmp_path / "d" / MANIFEST, "a") as f:   # a line as logged before parents
        f.write(json.dumps({"c": ["old", sid, 256, 100, None, 3]}) + "\n")
    again = DiskTier(tmp_path / "d", SIZE, None)
    again.open(again.node_id)
    assert again.manifest.records() == [ObjectRecord("p", sid, 0, 100, 7, 1),
                                        ObjectRecord("c", sid, 128, 100, 8, 2, "p"),
                                        ObjectRecord("old", sid, 256, 100, None, 3),
                                        ObjectRecord("h", sid, 512, 100, 8, 4, None, True)]
    again.close()


def test_disk_tier_refusals(tmp_path):
    t = DiskTier(tmp_path / "d", SIZE, "a")
    t.open("a")
    with pytest.raises(InvalidArgument, match="in use by another store node"):
        DiskTier(tmp_path / "d", SIZE, "a")
    t.close()
    with pytest.raises(InvalidArgument, match="holds the disk tier of node 'a'"):
        DiskTier(tmp_path / "d", SIZE, "b")
    with pytest.raises(InvalidArgument, match="pass --disk-size"):
        DiskTier(tmp_path / "d", 2 * SIZE, "a")
    (tmp_path / "d" / META).write_text(json.dumps({"node_id": 1}))
    with pytest.raises(InvalidArgument, match="damaged"):
        DiskTier(tmp_path / "d", SIZE, "a")
    with pytest.raises(NoSpace, match="does not fit"):
        DiskTier(tmp_path / "e", 1 << 60, "a")
    (tmp_path / "f").write_text("")
    with pytest.raises(InvalidArgument, match="not a directory"):
        DiskTier(tmp_path / "f", SIZE, "a")


def test_a_write_into_the_segment_first_forgets_the_records_it_overlaps(tmp_path):
    t = DiskTier(tmp_path / "d", SIZE, "a")
    t.open("a")
    sid = t.segment.info.segment_id
    t.manifest.apply([ObjectRecord(f"k{i}", sid, i * 128, 100, None, i + 1) for i in range(4)],
                     [])
    t.manifest.forget_range(50, 150)    # [50, 200): the tail of k0 and the head of k1
    assert [r.key for r in t.manifest.records()] == ["k2", "k3"]
    t.manifest.forget_range(1000, 64)   # nothing there
    # A commit over a stale record (its removal never arrived) replaces it.
    t.manifest.apply([ObjectRecord("new", sid, 256, 100, None, 9)], [])
    assert [r.key for r in t.manifest.records()] == ["new", "k3"]
    t.close()
    again = DiskTier(tmp_path / "d", SIZE, "a")
    again.open("a")
    assert [r.key for r in again.manifest.records()] == ["new", "k3"]   # as logged
    again.close()


def test_a_client_write_over_tcp_forgets_the_records_it_overlaps(tier):
    sid = tier.segment.info.segment_id
    tier.manifest.apply([ObjectRecord("old", sid, 0, 4096, None, 1),
                         ObjectRecord("kept", sid, 8192, 4096, None, 2)], [])
    server = DataServer({sid: tier.segment}, shm=False)
    server.start()
    transport = TCPTransport(timeout_s=5)
    try:
        node = NodeEndpoints("n1", local_boot_id(), server.tcp_endpoint)
        replica = Replica(node, Extent(sid, 1024, 100), tier="disk")   # inside "old"
        assert transport.write([IoOp(replica, memoryview(b"x" * 100))]) == [None]
        assert [r.key for r in tier.manifest.records()] == ["kept"]
        assert bytes(tier.segment.buffer[1024:1124]) == b"x" * 100
    finally:
        transport.close()
        server.stop()
