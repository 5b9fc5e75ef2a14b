"""Grants (common/capabilities.py) and the data server's check of them, in this process."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common import capabilities as caps
from kvpool.common.errors import SegmentBoundsError
from kvpool.common.host import local_boot_id
from kvpool.common.types import Extent, NodeEndpoints, Replica
from kvpool.net.data_port import (
    RESPONSE,
    FrameStatus,
    Op,
    PutRecord,
    encode_record_request,
    encode_request,
)
from kvpool.net.sockets import recv_exact
from kvpool.store_node.data_server import DataServer, _GrantChecker
from kvpool.store_node.manifest import Manifest
from kvpool.store_node.memory import create_dram_segment

KEY = caps.new_key()


def test_ops_match_the_data_ports():
    assert (caps.READ, caps.WRITE) == (Op.READ, Op.WRITE)


def test_a_grant_covers_exactly_what_it_names():
    g = caps.mint(KEY, caps.READ, "n/0-a", 4096, 512, 7, caps.expiry_ms(10))
    assert len(g) == caps.GRANT.size
    assert caps.check(KEY, g, caps.READ, b"n/0-a", 4096, 512) == (7, "")
    for args in ((caps.WRITE, b"n/0-a", 4096, 512), (caps.READ, b"n/0-b", 4096, 512),
                 (caps.READ, b"n/0-a", 0, 512), (caps.READ, b"n/0-a", 4096, 513)):
        assert caps.check(KEY, g, *args)[1], args
    assert caps.check(caps.new_key(), g, caps.READ, b"n/0-a", 4096, 512)[1]   # another node
    tampered = g[:8] + (caps.GRANT.unpack(g)[1] + 10**9).to_bytes(8, "big") + g[16:]
    assert "does not cover" in caps.check(KEY, tampered, caps.READ, b"n/0-a", 4096, 512)[1]
    assert caps.check(KEY, b"", caps.READ, b"n/0-a", 4096, 512)[1]


def test_an_expired_grant_is_refused():
    g = caps.mint(KEY, caps.READ, "s", 0, 1, 1, caps.expiry_ms(-1))
    assert "expired" in caps.check(KEY, g, caps.READ, b"s", 0, 1)[1]


@pytest.fixture
def keyed():
    seg = create_dram_segment("n", 0, 1 << 20)
    manifest = Manifest()
    manifest.set_epoch(5)
    server = DataServer({seg.info.segment_id: seg}, manifest=manifest)
    server.start()
    server.set_grant_key(KEY)
    node = NodeEndpoints("n", local_boot_id(), server.tcp_endpoint, "")
    yield server, seg, node
    server.stop()
    seg.close()


def _replica(node, seg, op: int, offset: int, length: int, version: int = 1) -> Replica:
    sid = seg.info.segment_id
    return Replica(node, Extent(sid, offset, length),
                   grant=caps.mint(KEY, op, sid, offset, length, version, caps.expiry_ms(10)))


def test_reads_and_writes_need_their_grant(keyed):
    _server, seg, node = keyed
    tcp = TCPTransport(timeout_s=5)
    try:
        w = _replica(node, seg, caps.WRITE, 4096, 4)
        assert tcp.write([IoOp(w, memoryview(b"abcd"))]) == [None]
        r = _replica(node, seg, caps.READ, 4096, 4)
        buf = bytearray(4)
        assert tcp.read([IoOp(r, memoryview(buf))]) == [None] and buf == b"abcd"
        # The write grant is spent; a read grant does not write; no grant does nothing.
        for replica in (w, r, Replica(node, Extent(seg.info.segment_id, 4096, 4))):
            [err] = tcp.write([IoOp(replica, memoryview(b"EVIL"))])
            assert isinstance(err, SegmentBoundsError), replica.grant
        assert bytes(seg.buffer[4096:4100]) == b"abcd"
        [err] = tcp.read([IoOp(Replica(node, Extent(seg.info.segment_id, 0, 1 << 20)),
                               memoryview(bytearray(1 << 20)))])
        assert "grant" in str(err)
    finally:
        tcp.close()


def test_a_spent_write_grant_stays_spent_until_it_expires():
    """The sweep forgets spent write grants that expired, in the order spent, and never one
    that has not (it would then write again): one spent after a longer-lived grant waits for
    it, so the sweep costs what expired, not all that is spent."""
    checker = _GrantChecker()
    checker.set_key(KEY)
    sid = b"n/0-a"

    def grant(offset: int, ttl_s: float) -> bytes:
        return caps.mint(KEY, caps.WRITE, sid.decode(), offset, 64, 1, caps.expiry_ms(ttl_s))

    short = [grant(0, 0.2), grant(64, 0.2)]
    long, late = grant(128, 60), grant(192, 0.2)
    for offset, g in zip((0, 64, 128, 192), (*short, long, late)):
        assert checker.denied(Op.WRITE, g, sid, offset, 64) == ""
    assert "spent" in checker.denied(Op.WRITE, long, sid, 128, 64)
    time.sleep(0.3)
    checker.forget_expired()
    assert list(checker._spent.values()) == [    # noqa: SLF001 (what the sweep keeps)
        caps.GRANT.unpack(g)[1] for g in (long, late)]
    assert "spent" in checker.denied(Op.WRITE, long, sid, 128, 64)
    for offset, g in zip((0, 64, 192), (*short, late)):
        assert "expired" in checker.denied(Op.WRITE, g, sid, offset, 64)


def test_reserve_and_seal_need_the_record_tag_of_their_key(keyed):
    """A writer may record at its node only the key its master placed at the extent: a write
    grant's record tag names it. Without that, a client granted any extent could make the
    node's manifest name another key (another tenant's) there, and drop that key's record."""
    _server, seg, node = keyed
    sid = seg.info.segment_id
    host, _, port = node.tcp_endpoint.rpartition(":")
    read_grant = caps.mint(KEY, caps.READ, sid, 0, 4096, 1, caps.expiry_ms(10))
    write_grant = caps.mint(KEY, caps.WRITE, sid, 0, 4096, 1, caps.expiry_ms(10),
                            stored_key="k")
    assert len(write_grant) == caps.GRANT.size + caps.TAG_BYTES
    for key, grant, expected in (
            ("k", b"", FrameStatus.DENIED), ("k", read_grant, FrameStatus.DENIED),
            ("k", caps.write_grant(write_grant), FrameStatus.DENIED),   # no record tag
            ("victim", caps.record_grant(write_grant), FrameStatus.DENIED),
            ("k", caps.record_grant(write_grant), FrameStatus.OK)):
        for op in (Op.RESERVE, Op.SEAL):
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(encode_record_request(op, sid, 0, 4096,
                                                PutRecord(key, 1, 5, 60.0, 0), grant))
                status, _n = RESPONSE.unpack(recv_exact(s, RESPONSE.size))
                if op is Op.RESERVE or expected is FrameStatus.DENIED:
                    assert status == expected, (key, op)
    # The record tag writes nothing: a WRITE takes the grant's own tag only.
    tcp = TCPTransport(timeout_s=5)
    try:
        [err] = tcp.write([IoOp(
            Replica(node, Extent(sid, 0, 4), grant=caps.record_grant(write_grant)),
            memoryview(b"EVIL"))])
    finally:
        tcp.close()
    assert isinstance(err, SegmentBoundsError)


def test_a_request_outside_any_segment_is_refused_as_before(keyed):
    _server, seg, node = keyed
    host, _, port = node.tcp_endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(encode_request(Op.READ, seg.info.segment_id, 1 << 20, 1))
        status, _n = RESPONSE.unpack(recv_exact(s, RESPONSE.size))
    assert status == FrameStatus.OUT_OF_BOUNDS


def test_grant_check_cost():
    """What a node pays per request and the master per replica, with the signer each keeps
    (the figures are printed; the bound only catches a check that became orders of magnitude
    slower)."""
    signer = caps.Signer(KEY)
    sid = b"node-0/0-0123456789abcdef"
    g = signer.mint(caps.READ, sid, 1 << 20, 2 << 20, 12345, caps.expiry_ms(30))
    n = 20_000
    start = time.perf_counter()
    for _ in range(n):
        signer.check(g, caps.READ, sid, 1 << 20, 2 << 20)
    check_us = (time.perf_counter() - start) / n * 1e6
    start = time.perf_counter()
    for _ in range(n):
        signer.mint(caps.READ, sid, 1 << 20, 2 << 20, 12345, 1)
    mint_us = (time.perf_counter() - start) / n * 1e6
    print(f"grant check {check_us:.2f} us, mint {mint_us:.2f} us")
    assert check_us < 200 and mint_us < 200


def test_a_batch_of_grants_is_minted_as_one_by_one_and_each_checks():
    """mint_many's batch path (two AES calls over every grant) makes the grants mint makes."""
    signer = caps.Signer(KEY)
    expiry = caps.expiry_ms(10)
    offsets = [i * 2112 for i in range(40)]
    lengths = [64 + 13 * i for i in range(40)]
    versions = [(1 << 62) + 7 * i for i in range(40)]
    for n in (1, 7, 8, 40):
        batch = signer.mint_many(caps.READ, b"n/0-a", offsets[:n], lengths[:n], versions[:n],
                                 expiry)
        assert batch == [signer.mint(caps.READ, b"n/0-a", o, ln, v, expiry)
                         for o, ln, v in zip(offsets, lengths, versions[:n])]
        for g, o, ln, v in zip(batch, offsets, lengths, versions):
            assert caps.check(KEY, g, caps.READ, b"n/0-a", o, ln) == (v, "")
            assert caps.check(KEY, g, caps.WRITE, b"n/0-a", o, ln)[1]
            assert caps.check(KEY, g, caps.READ, b"n/0-a", o, ln + 1)[1]
        # Joined (a packed answer's), from uint64 arrays: the same grants, one after another.
        arrays = (np.array(c[:n], np.uint64) for c in (offsets, lengths, versions))
        assert signer.mint_many(caps.READ, b"n/0-a", *arrays, expiry, joined=True) \
            == b"".join(batch)
        # Write grants with their record tags: each record checks for its own key only.
        keys = [f"k{i}" for i in range(n)]
        writes = signer.mint_many(caps.WRITE, b"n/0-a", offsets[:n], lengths[:n],
                                  versions[:n], expiry, keys)
        for g, o, ln, v, k in zip(writes, offsets, lengths, versions, keys):
            assert caps.check(KEY, caps.write_grant(g), caps.WRITE, b"n/0-a", o, ln) == (v, "")
            record = caps.record_grant(g)
            assert signer.check(record, caps.RECORD, b"n/0-a", o, ln, key=k.encode()) == (v, "")
            assert signer.check(record, caps.RECORD, b"n/0-a", o, ln, key=b"other")[1]


def test_the_master_mints_a_batchs_grants_in_replica_order_over_several_segments():
    """GrantMinter: one segment's batch goes whole; replicas over several segments (and
    misses, with no replica) are minted per segment and put back in replica order."""
    from kvpool.master.grants import GrantMinter
    nodes = {"a/0": "a", "b/0": "b"}
    minter = GrantMinter(nodes.__getitem__)
    keys = {n: caps.Signer(minter.key_for(n)) for n in ("a", "b")}
    counts = [1, 2, 0] * 4 + [1] * 8
    segment_ids, offsets = [], []
    for i, c in enumerate(counts):
        for r in range(c):
            segment_ids.append("a/0" if (i + r) % 2 == 0 else "b/0")
            offsets.append(4096 * len(offsets))
    sizes = [100 + i for i in range(len(counts))]
    versions = [1000 + i for i in range(len(counts))]
    grants = minter.mint(caps.READ, counts, segment_ids, offsets, sizes, versions, 10)
    assert len(grants) == len(segment_ids)
    joined = minter.mint(caps.READ, counts, segment_ids, offsets, sizes, versions, 10,
                         joined=True)   # (a packed answer's: one after another)
    size = caps.GRANT.size
    assert len(joined) == len(grants) * size
    j = 0
    for i, c in enumerate(counts):
        for _ in range(c):
            sid = segment_ids[j]
            for grant in (grants[j], joined[j * size:(j + 1) * size]):
                assert keys[nodes[sid]].check(grant, caps.READ, sid.encode(), offsets[j],
                                              sizes[i]) == (versions[i], "")
            j += 1
    one = minter.mint(caps.READ, [1] * 9, ["a/0"] * 9, offsets[:9], sizes[:9], versions[:9], 10)
    for g, o, s, v in zip(one, offsets, sizes, versions):
        assert keys["a"].check(g, caps.READ, b"a/0", o, s) == (v, "")
