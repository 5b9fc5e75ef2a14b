"""Tiers and Pressure on their own: a move's life (handed out once, switched on success,
freed on failure or expiry), promotion on a second disk read, demotion before a drop."""

from __future__ import annotations

from kvpool.common.config import MasterConfig
from kvpool.common.types import Extent, NodeEndpoints, SegmentInfo
from kvpool.master.chains import Chains
from kvpool.master.eviction import LRUPolicy
from kvpool.master.index import COMPLETE, ObjectIndex
from kvpool.master.leases import Leases
from kvpool.master.manifest_log import ManifestLog
from kvpool.master.membership import Membership
from kvpool.master.pins import Pins
from kvpool.master.pressure import Pressure
from kvpool.master.space import Space
from kvpool.master.tiers import Tiers

B = 1024
CFG = MasterConfig(put_timeout_s=10.0, quarantine_s=30.0, promote_window_s=60.0,
                   high_watermark=0.75, low_watermark=0.25)


class Units:
    """One node with a DRAM segment "m" (4 blocks) over a disk one "d" (8 blocks)."""

    def __init__(self) -> None:
        self.log = ManifestLog()
        self.members = Membership(CFG)
        node = NodeEndpoints("n", "boot", "n:1")
        for sid, tier, blocks in (("m", "dram", 4), ("d", "disk", 8)):
            self.members.mount(node, SegmentInfo(sid, blocks * B, tier), 0.0, self.log.keep("n"))
        self.index, self.chains = ObjectIndex(), Chains(LRUPolicy(), LRUPolicy())
        more = self.index.more
        self.space = Space(self.members.segments, more)
        pins = Pins(CFG, self.members.segments, more)
        self.leases = Leases(CFG.lease_ttl_s, CFG.max_lease_s, self.members.segments, pins.held,
                             more)
        self.tiers = Tiers(CFG, self.members, set(), self.index, self.chains, self.space,
                           pins.held, self.leases)
        self.evicted: list[str] = []
        self.pressure = Pressure(CFG, self.members, set(), self.index, self.chains, pins,
                                 self.leases, self.tiers, self.evict)

    def evict(self, obj) -> None:   # as MasterState does, tombstones and counters aside
        self.evicted.append(obj.key)
        replicas = self.index.replicas(obj)
        self.index.discard(obj)
        self.chains.forget(obj.key)
        for e in replicas:
            self.members.segments[e.segment_id].objects -= 1
        self.space.free_now(replicas)

    def put(self, key: str, sid: str):
        seg = self.members.segments[sid]
        e = Extent(sid, seg.allocator.allocate(B), B)
        seg.objects += 1
        obj = self.index.add(key, B, [e], state=COMPLETE)
        self.chains.track(key, None, disk=sid == "d")
        return obj


def test_a_finished_move_switches_the_index_and_frees_the_source_after_its_lease():
    u = Units()
    obj = u.put("k", "m")
    obj.lease = (5.0, 5.0)   # read under a lease until 5.0 (its cap)
    m, d = u.members.segments["m"], u.members.segments["d"]
    assert u.tiers.start(obj, u.index.replicas(obj)[0], m, d, 0.0)
    [move] = u.tiers.take("n")
    assert u.tiers.take("n") == [] and u.tiers.moving == {"k": move.move_id}
    u.tiers.finished("other-node", move.move_id, True, 1.0)   # not its move: ignored
    assert obj.segment_id == "m"
    u.tiers.finished("n", move.move_id, True, 1.0)
    assert u.index.replicas(obj) == [move.dst] and obj.version > move.version and not u.tiers.moving
    assert "k" in u.chains.disk_policy and "k" not in u.chains.policy
    delta = u.log.take("n")
    assert [(r.key, r.segment_id, r.version) for r in delta.committed] == \
        [("k", "d", obj.version)]
    assert [(r.segment_id, r.until) for r in delta.reserved] == [("m", 5.0)]
    assert (m.quarantined_bytes, u.tiers.demotions) == (B, 1)


def test_a_failed_move_frees_its_destination_now_and_an_expired_one_after_the_quarantine():
    u = Units()
    a, b = u.put("a", "m"), u.put("b", "m")
    m, d = u.members.segments["m"], u.members.segments["d"]
    u.tiers.start(a, u.index.replicas(a)[0], m, d, 0.0)
    u.tiers.start(b, u.index.replicas(b)[0], m, d, 0.0)
    [first, _] = u.tiers.take("n")
    u.tiers.finished("n", first.move_id, False, 1.0)
    assert d.allocator.used_bytes == B and a.segment_id == "m"
    u.tiers.expire(10.0)   # b's move was never reported
    assert d.quarantined_bytes == B and not u.tiers.moving and m.moving_out_bytes == 0


def test_a_second_disk_read_within_the_window_promotes():
    u = Units()
    obj = u.put("k", "d")
    u.tiers.note_disk_read(obj, 0.0)
    u.tiers.note_disk_read(obj, 61.0)   # outside the window: counts as a first read
    assert u.tiers.take("n") == []
    u.tiers.note_disk_read(obj, 62.0)
    [move] = u.tiers.take("n")
    assert (move.src.segment_id, move.dst.segment_id) == ("d", "m")


def test_pressure_demotes_from_a_tier_with_one_below_and_drops_from_the_last():
    u = Units()
    for i in range(4):
        u.put(f"m{i}", "m")
    for i in range(7):
        u.put(f"d{i}", "d")
    u.pressure.drain(0.0)
    moves = u.tiers.take("n")
    assert [mv.key for mv in moves] == ["m0", "m1", "m2"]   # DRAM down to its low watermark
    assert u.evicted == ["d0", "d1", "d2", "d3", "d4"]     # disk: nowhere lower, dropped


def test_room_for_a_put_is_made_only_on_a_last_tier():
    u = Units()
    for i in range(4):
        u.put(f"m{i}", "m")
    for i in range(8):
        u.put(f"d{i}", "d")
    m, d = u.members.segments["m"], u.members.segments["d"]
    assert u.pressure.place(B, 1, [m], 0.0) is None   # DRAM makes room by demoting, later
    assert u.pressure.place(B, 1, [m, d], 0.0) == [Extent("d", 0, B)]
    assert u.evicted == ["d0"]
