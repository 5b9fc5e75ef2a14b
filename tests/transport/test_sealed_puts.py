"""A writer's RESERVE and SEAL at the node (net/data_port.py), over shm and tcp: fenced by the
granting master's epoch, checked against the bytes' CRC-32C (DESIGN.md, Put)."""

from __future__ import annotations

import os
import socket

import pytest
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.shm import SHMTransport
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.checksum import checksum
from kvpool.common.host import local_boot_id
from kvpool.common.types import Extent, NodeEndpoints, Replica
from kvpool.net.data_port import (
    RESPONSE,
    FrameStatus,
    Op,
    PutRecord,
    encode_record_request,
    encode_request,
    recv_refusal,
)
from kvpool.net.sockets import recv_exact
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.manifest import Manifest
from kvpool.store_node.memory import create_dram_segment

EPOCH = 0x5EA1


@pytest.fixture
def served():
    """A data server of one segment whose manifest's master is EPOCH: (endpoints, segment,
    manifest, server)."""
    seg = create_dram_segment("local", 0, 1 << 20)
    manifest = Manifest()
    manifest.set_epoch(EPOCH)
    server = DataServer({seg.info.segment_id: seg}, manifest=manifest)
    server.start()
    endpoints = NodeEndpoints("local", local_boot_id(), server.tcp_endpoint,
                              server.shm_endpoint)
    yield endpoints, seg, manifest, server
    server.stop()
    seg.close()


@pytest.fixture
def node(served):
    return served[:3]


@pytest.fixture(params=["shm", "tcp"])
def transport(request):
    t = SHMTransport(timeout_s=5) if request.param == "shm" else TCPTransport(timeout_s=5)
    yield t
    t.close()


def _op(endpoints, seg, offset: int, value: bytes) -> IoOp:
    replica = Replica(endpoints, Extent(seg.info.segment_id, offset, len(value)))
    return IoOp(replica, memoryview(value))


def test_a_sealed_put_is_in_the_manifest_pending_the_masters_word(node, transport):
    endpoints, seg, manifest = node
    value = os.urandom(64 << 10)
    errors, sums = transport.write_sealed([_op(endpoints, seg, 4096, value)],
                                          [PutRecord("k", 7, EPOCH, 30.0, None, "parent")])
    assert errors == [None] and sums == [checksum(value)]
    assert bytes(seg.buffer[4096:4096 + len(value)]) == value
    [record] = manifest.records()
    assert (record.key, record.offset, record.size, record.version, record.checksum,
            record.parent) == ("k", 4096, len(value), 7, checksum(value), "parent")
    assert manifest.sealed() == [record]   # not confirmed by the master yet
    manifest.apply([record], [])           # the master's commit arrives on the stream
    assert manifest.sealed() == [] and manifest.records() == [record]


def test_a_stale_epoch_write_is_refused_at_the_node_and_lands_nowhere(node, transport):
    """A late writer of a master that died (its grant carries the old epoch) is refused
    before any byte of it lands: the space may belong to another object by now."""
    endpoints, seg, manifest = node
    before = os.urandom(64 << 10)
    seg.buffer[0:len(before)] = before
    errors, _ = transport.write_sealed([_op(endpoints, seg, 0, os.urandom(64 << 10))],
                                       [PutRecord("late", 3, EPOCH + 1, 30.0)])
    assert "STALE_EPOCH" in str(errors[0])
    assert bytes(seg.buffer[0:len(before)]) == before, "a stale writer's bytes landed"
    assert manifest.records() == [] and manifest.reservations() == []
    # The link still works for a writer of the current master.
    value = os.urandom(1000)
    errors, _ = transport.write_sealed([_op(endpoints, seg, 0, value)],
                                       [PutRecord("now", 4, EPOCH, 30.0)])
    assert errors == [None] and [r.key for r in manifest.records()] == ["now"]


def _seal_over_tcp(endpoints, seg, offset: int, length: int, record: PutRecord) -> str | None:
    """A raw SEAL frame on the data port: None if answered OK, else the refusal."""
    return _seal_batch_over_tcp(endpoints, seg, [(offset, length)], [record])[0]


def _seal_over_shm(endpoints, seg, offset: int, length: int, record: PutRecord) -> str | None:
    return _seal_batch_over_shm(endpoints, seg, [(offset, length)], [record])[0]


@pytest.mark.parametrize("seal", [_seal_over_tcp, _seal_over_shm], ids=["tcp", "shm"])
def test_a_seal_whose_checksum_does_not_match_the_bytes_is_refused(node, seal):
    """The node checks the bytes it holds against the writer's CRC-32C: a record is kept
    only for bytes that are the object's."""
    endpoints, seg, manifest = node
    value = os.urandom(4096)
    seg.buffer[0:len(value)] = value
    refusal = seal(endpoints, seg, 0, len(value), PutRecord("k", 1, EPOCH, 30.0,
                                                            checksum(value) ^ 1))
    assert refusal is not None and "CHECKSUM_MISMATCH" in refusal
    assert manifest.records() == []
    assert seal(endpoints, seg, 0, len(value),
                PutRecord("k", 1, EPOCH, 30.0, checksum(value))) is None
    assert [r.key for r in manifest.records()] == ["k"]


def test_after_a_refused_reserve_the_node_takes_no_byte_of_the_write_behind_it(node):
    """tcp pipelines RESERVE and WRITE: after refusing the RESERVE the node must not serve the
    WRITE already on the stream (it drops the connection), even for a client that keeps
    its end open and waits."""
    endpoints, seg, manifest = node
    before = os.urandom(64 << 10)
    seg.buffer[0:len(before)] = before
    host, _, port = endpoints.tcp_endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sid = seg.info.segment_id
        sock.sendall(encode_record_request(Op.RESERVE, sid, 0, len(before),
                                           PutRecord("late", 3, EPOCH + 1, 30.0))
                     + encode_request(Op.WRITE, sid, 0, len(before)) + os.urandom(len(before)))
        status, length = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
        assert status == FrameStatus.STALE_EPOCH
        recv_refusal(sock, status, length)
        assert sock.recv(1) == b"", "the node answered the WRITE behind a refused RESERVE"
    assert bytes(seg.buffer[0:len(before)]) == before
    assert manifest.reservations() == []


def test_then_runs_once_with_the_bytes_written_and_the_seal_is_answered(node, transport):
    """``write_sealed_then``: the caller's commit runs once the bytes are in the segment,
    exactly once, and the seal's answer comes back with it (shm sends the SEAL first, so the
    node checks it while the caller commits)."""
    endpoints, seg, manifest = node
    value = os.urandom(8192)
    seen = []

    def then(crc: int) -> None:
        seen.append((crc, bytes(seg.buffer[128:128 + len(value)])))

    error, crc, ran = transport.write_sealed_then(
        _op(endpoints, seg, 128, value), PutRecord("t", 9, EPOCH, 30.0), then)
    assert (error, crc, ran) == (None, checksum(value), True)
    assert seen == [(checksum(value), value)]
    assert [(r.key, r.version, r.checksum) for r in manifest.records()] == \
        [("t", 9, checksum(value))]


def test_then_does_not_run_when_the_reservation_is_refused(node, transport):
    endpoints, seg, manifest = node
    seen = []
    error, _, ran = transport.write_sealed_then(
        _op(endpoints, seg, 0, os.urandom(4096)), PutRecord("t", 9, EPOCH + 1, 30.0),
        seen.append)
    assert "STALE_EPOCH" in str(error) and not ran and seen == []
    assert manifest.records() == []


def test_a_slot_put_over_shm_seals_on_the_board_with_no_round_trip_to_the_node(served):
    """A slot reserved over shm names a cell of the link's seal board (net/seal_board.py): the
    put fills it and calls on at once, with no SEAL frame; the node holds the record from then
    on, and takes it as a seal when it must (here: its master changes; its writer leaves)."""
    endpoints, seg, manifest, server = served
    shm = SHMTransport(timeout_s=5)
    try:
        slots = [IoOp(Replica(endpoints, Extent(seg.info.segment_id, offset, 8192)),
                      memoryview(b"")) for offset in (0, 8192)]
        assert shm.reserve(slots, [PutRecord(f"slot{i}", i + 1, EPOCH, 30.0)
                                   for i in range(2)]) == [None, None]
        puts = {}
        for i, offset in enumerate((0, 8192)):
            value = os.urandom(5000)
            called = []
            op = _op(endpoints, seg, offset, value)
            error, crc, wrote = shm.write_sealed_then(
                op, PutRecord(f"k{i}", i + 1, EPOCH, 30.0), called.append, reserved=True)
            assert (error, crc, wrote, called) == (None, checksum(value), True, [crc])
            puts[f"k{i}"] = (offset, crc, i + 1)
        assert server.request_counts().get("SEAL", 0) == 0
        assert server.request_counts()["RESERVE"] == 2
        assert manifest.records() == []         # nothing read on the puts' path
        manifest.set_epoch(EPOCH + 1)           # mounted on a new master: both are seals
        assert {r.key: (r.offset, r.checksum, r.version) for r in manifest.sealed()} == puts
        assert all(r.size == 5000 for r in manifest.sealed())
    finally:
        shm.close()


def _seal_batch_over_tcp(endpoints, seg, extents, records) -> list[str | None]:
    """SEAL frames pipelined in one send on the data port: each answer, in order."""
    host, _, port = endpoints.tcp_endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"".join(encode_record_request(Op.SEAL, seg.info.segment_id, offset,
                                                    length, record)
                              for (offset, length), record in zip(extents, records)))
        answers = []
        for _ in records:
            status, length = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
            answers.append(None if status == FrameStatus.OK else
                           f"{FrameStatus(status).name}: {recv_refusal(sock, status, length)}")
        return answers


def _seal_batch_over_shm(endpoints, seg, extents, records) -> list[str | None]:
    t = SHMTransport(timeout_s=5)
    try:
        ops = [_op(endpoints, seg, offset, memoryview(bytearray(length)))
               for offset, length in extents]
        return [None if e is None else str(e) for e in t._records(Op.SEAL, ops, records)]
    finally:
        t.close()


@pytest.mark.parametrize("seal_batch", [_seal_batch_over_tcp, _seal_batch_over_shm],
                         ids=["tcp", "shm"])
def test_pipelined_seals_are_answered_each_in_order_around_a_refused_one(node, seal_batch):
    """The node answers a batch of pipelined RESERVEs or SEALs together (held back while the
    next frame is read already): each still gets its own answer, in order, a refusal among
    them where it falls, and the frames after it are served."""
    endpoints, seg, manifest = node
    n, size = 40, 1024
    values = [os.urandom(size) for _ in range(n)]
    for i, v in enumerate(values):
        seg.buffer[i * size:(i + 1) * size] = v
    bad = {7, 23}
    records = [PutRecord(f"k{i}", i + 1, EPOCH, 30.0, checksum(v) ^ (i in bad))
               for i, v in enumerate(values)]
    answers = seal_batch(endpoints, seg, [(i * size, size) for i in range(n)], records)
    assert [i for i, a in enumerate(answers) if a is not None] == sorted(bad)
    assert all("CHECKSUM_MISMATCH" in answers[i] for i in bad)
    assert sorted(r.key for r in manifest.records()) == sorted(f"k{i}" for i in range(n)
                                                               if i not in bad)


def test_a_malformed_frame_behind_pipelined_seals_is_refused_after_their_answers(node):
    """The answers held back go out before the BAD_REQUEST that ends the connection."""
    endpoints, seg, manifest = node
    value = os.urandom(1024)
    seg.buffer[0:len(value)] = value
    good = [encode_record_request(Op.SEAL, seg.info.segment_id, 0, len(value),
                                  PutRecord(f"k{i}", i + 1, EPOCH, 30.0, checksum(value)))
            for i in range(3)]
    bad = b"BAD!" + good[0][4:]   # a SEAL frame with a wrong magic
    host, _, port = endpoints.tcp_endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"".join(good) + bad)
        statuses = []
        for _ in range(4):
            status, length = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
            statuses.append(FrameStatus(status))
            if status != FrameStatus.OK:
                recv_refusal(sock, status, length)
    assert statuses == [FrameStatus.OK] * 3 + [FrameStatus.BAD_REQUEST]
