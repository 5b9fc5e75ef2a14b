"""Membership on its own: silent and expired nodes, where new objects may go, tier neighbours."""

from __future__ import annotations

from kvpool.common.config import MasterConfig
from kvpool.common.types import NodeEndpoints, SegmentInfo
from kvpool.master.membership import Membership

TTL_S = 9.0


def members(*mounts: tuple[str, str, str]) -> Membership:
    """Nodes and segments mounted at time 0: (node id, segment id, tier)."""
    m = Membership(MasterConfig(node_ttl_s=TTL_S))
    for node, sid, tier in mounts:
        m.mount(NodeEndpoints(node, "boot", f"{node}:1"), SegmentInfo(sid, 1 << 20, tier), 0.0,
                None)
    return m


def ids(segments) -> list[str]:
    return sorted(s.info.segment_id for s in segments)


def test_silent_nodes_take_no_new_objects_unless_too_few_others_are_left():
    m = members(("n1", "a", "dram"), ("n2", "b", "dram"), ("n3", "c", "dram"))
    m.touch("n1", 4.0)
    m.touch("n2", 4.0)
    assert m.expired(4.0) == []   # n3 silent for 4 s, over a third of the TTL
    assert ids(m.open_segments(2)) == ["a", "b"]
    assert ids(m.open_segments(3)) == ["a", "b", "c"]   # three nodes needed: n3 too
    assert ids(m.open_segments(1, closed={"a"})) == ["b"]
    assert m.heard_from("n1", 4.0) and not m.heard_from("n3", 4.0)
    m.touch("n3", 4.5)   # a heartbeat clears it at once
    assert ids(m.open_segments(1)) == ["a", "b", "c"]


def test_when_every_node_is_silent_none_is_avoided_and_the_dead_are_reported():
    m = members(("n1", "a", "dram"), ("n2", "b", "dram"))
    assert m.expired(5.0) == []
    assert ids(m.open_segments(1)) == ["a", "b"]
    m.touch("n1", 6.0)
    assert m.expired(9.5) == ["n2"]   # silent for the whole TTL


def test_a_node_back_with_new_endpoints_restarted_and_lost_its_segments():
    m = members(("n1", "a", "dram"), ("n1", "b", "disk"))
    assert m.restarted(NodeEndpoints("n1", "boot", "n1:1")) == []
    assert ids(m.restarted(NodeEndpoints("n1", "boot", "n1:2"))) == ["a", "b"]
    assert m.disk_segments == {"b"}
    m.remove_segment(m.segments["b"])
    assert m.disk_segments == set() and m.nodes["n1"].segment_ids == {"a"}


def test_the_neighbour_tier_is_the_nearest_one_on_the_node_roomiest_first():
    m = members(("n1", "h", "hbm"), ("n1", "d1", "dram"), ("n1", "d2", "dram"),
                ("n1", "k", "disk"), ("n2", "x", "dram"))
    m.segments["d1"].allocator.allocate(4096)
    hbm, disk = m.segments["h"], m.segments["k"]
    assert m.neighbour_tier(hbm, +1).info.segment_id == "d2"   # the roomier DRAM segment
    assert m.neighbour_tier(hbm, +1, closed={"d2"}).info.segment_id == "d1"
    assert m.neighbour_tier(disk, -1).info.segment_id == "d2"  # one tier up, not HBM
    assert m.neighbour_tier(disk, +1) is None and m.neighbour_tier(hbm, -1) is None
    assert m.neighbour_tier(m.segments["x"], +1) is None   # another node's tiers do not count
