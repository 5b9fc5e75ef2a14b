"""The rdma client's kept read regions (client/transport/rdma.py ``_ReadRegions``) against the
store node's own bookkeeping of the regions it registered (store_node/rdma.py ``NodeRDMA``,
run here with a stand-in device: registering a region only hands out an rkey): whatever the
sequence of reads, writes, commits and expiries, a region the client reuses is one the node
still has open when the client's RDMA READ goes out. A reused region the node closed would be
refused by the device and break the queue pair. tests/transport/test_rdma.py reads through
kept regions on soft-RoCE."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from kvpool.client.transport import rdma as client_rdma
from kvpool.store_node import rdma as node_rdma

SEGMENT = "node0/0"
EXTENTS = [(i * 4096, 4096) for i in range(8)]
# A wave asks for at most half a connection's regions (the client's: 1,024 of 4,096).
WAVE = 3


class _Device:
    """Registers nothing: each region gets a fresh rkey, and knows whether it was closed."""

    name = "stand-in"

    def __init__(self) -> None:
        self.open: set[int] = set()
        self._rkeys = itertools.count(1)

    def register(self, addr: int, length: int, access: int):
        rkey = next(self._rkeys)
        self.open.add(rkey)
        device = self
        return SimpleNamespace(rkey=rkey, lkey=rkey, close=lambda: device.open.discard(rkey))


class _Pair:
    """One link: the node's side (NodeRDMA's regions for one connection) and the client's."""

    def __init__(self) -> None:
        self.device = _Device()
        self.node = node_rdma.NodeRDMA(self.device, SimpleNamespace(REMOTE_READ_ONLY=1,
                                                                    REMOTE_WRITE_ONLY=2))
        self.node._bases[SEGMENT] = 1 << 20
        self.owner = object()   # the handshake connection
        self.kept = client_rdma._ReadRegions()
        self.now_s = 1_000_000.0

    def register(self, extent: tuple[int, int], ttl_s: float | None) -> tuple[int, int]:
        """A region registered as RKEY_READ (``ttl_s``: its grant's) or RKEY_WRITE (None)
        makes one: on the node, then told to the client."""
        offset, length = extent
        write = ttl_s is None
        expiry_s = None if write else self.now_s + ttl_s
        addr, rkey = self.node.region(self.owner, SEGMENT, offset, length, write,
                                      None if write else expiry_s * 1000)
        self.kept.registered_one(SEGMENT, offset, length, addr, rkey, expiry_s)
        return addr, rkey


@pytest.fixture(autouse=True)
def _few_regions(monkeypatch):
    """Six regions a connection (4,096 in production): the oldest goes within a few steps."""
    monkeypatch.setattr(node_rdma, "MAX_REGIONS_PER_CONNECTION", 6)
    monkeypatch.setattr(client_rdma, "MAX_REGIONS_PER_CONNECTION", 6)


step = st.one_of(
    st.tuples(st.just("read"), st.lists(st.integers(0, len(EXTENTS) - 1), min_size=1,
                                        max_size=WAVE), st.sampled_from([10.0, 30.0, 60.0])),
    st.tuples(st.just("write"), st.integers(0, len(EXTENTS) - 1)),
    st.tuples(st.just("commit"), st.integers(0, len(EXTENTS) - 1)),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 4.0, 12.0, 40.0])))


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=40))
def test_a_kept_region_is_one_the_node_still_has_when_the_read_goes_out(steps):
    pair, reused = _Pair(), 0
    for what, *args in steps:
        if what == "read":   # one wave: kept regions first, then the rest asked for at once
            wave, ttl_s = args
            asking = len(wave)
            hits = {i: pair.kept.get(SEGMENT, *EXTENTS[i], asking, pair.now_s) for i in wave}
            fresh = [pair.register(EXTENTS[i], ttl_s) for i in wave if hits[i] is None]
            for region in [*filter(None, hits.values()), *fresh]:
                assert region[1] in pair.device.open, (region, steps)
            reused += sum(region is not None for region in hits.values())
        elif what == "write":
            pair.register(EXTENTS[args[0]], None)
        elif what == "commit":   # the node closes the extent's write regions; the client
            offset = EXTENTS[args[0]][0]   # never hears of it
            pair.node.committed([SimpleNamespace(segment_id=SEGMENT, offset=offset)])
        else:
            pair.now_s += args[0]
            pair.node.expire(pair.now_s * 1000)
    target(float(reused))   # steer towards sequences that reuse many regions


def test_a_re_read_reuses_its_region_until_the_node_would_close_it():
    """The rules by hand: reused within the grant's life less the margin and while fewer than
    the connection's limit came after it; the same extent only (not a sub-range)."""
    pair = _Pair()
    first = pair.register(EXTENTS[0], 30.0)
    assert pair.kept.get(SEGMENT, *EXTENTS[0], 1, pair.now_s) == first
    assert pair.kept.get(SEGMENT, EXTENTS[0][0], 2048, 1, pair.now_s) is None
    # Five more registered after it (writes count): one more asked would close it.
    for extent in EXTENTS[1:6]:
        pair.register(extent, None)
    assert pair.kept.get(SEGMENT, *EXTENTS[0], 0, pair.now_s) == first
    assert pair.kept.get(SEGMENT, *EXTENTS[0], 1, pair.now_s) is None
    # Expiry: kept until _REGION_MARGIN_S before the grant ends.
    pair = _Pair()
    first = pair.register(EXTENTS[0], 30.0)
    late = pair.now_s + 30.0 - client_rdma._REGION_MARGIN_S
    assert pair.kept.get(SEGMENT, *EXTENTS[0], 1, late - 0.1) == first
    assert pair.kept.get(SEGMENT, *EXTENTS[0], 1, late + 0.1) is None
    assert not pair.kept._kept   # forgotten once unusable


def test_a_region_asked_for_without_a_grant_lives_as_the_node_says():
    now = 1_000.0
    assert client_rdma._region_expiry_s(b"", now) == now + node_rdma.UNGRANTED_REGION_S
    from kvpool.common import capabilities
    grant = capabilities.GRANT.pack(7, 1_234_567, bytes(capabilities.TAG_BYTES))
    assert client_rdma._region_expiry_s(grant, now) == 1_234.567
