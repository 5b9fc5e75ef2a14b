"""Memory tiers in MasterState (sans-IO, fake clock): placement prefers the fastest tier, a
tier past its high watermark demotes to the next one through moves the node makes and reports,
only a node's last tier drops data, and a disk block read twice within the window comes back up.
Then a model-based test (hypothesis state machine) of tiers + eviction + reads in flight."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvpool.common.errors import AlreadyExists, KVPoolError, NoSpace, ObjectNotFound
from kvpool.common.types import SegmentInfo

from .conftest import FakeClock, get_replicas
from .test_state import LEASE_S, PUT_TIMEOUT_S, endpoints, make_state

B = 64   # one alignment unit: a segment of n * B bytes holds exactly n objects


def tiered(clock, dram: int = 4, disk: int = 8, **cfg):
    """A node "n" with a DRAM segment "m" and a disk segment "d" (sizes in objects)."""
    state = make_state(clock, high_watermark=0.75, low_watermark=0.5, **cfg)
    state.mount_segment(endpoints("n"), SegmentInfo("m", dram * B, "dram"))
    state.mount_segment(endpoints("n"), SegmentInfo("d", disk * B, "disk"))
    return state


def put(state, key):
    [placed] = state.put_start([key], [B])
    assert isinstance(placed, tuple), placed
    assert state.put_end([key]) == [None]
    return placed


def where(state, key) -> list[tuple[str, str]]:
    """[(segment id, tier)] of ``key``'s replicas (a read: leases it)."""
    [view] = get_replicas(state, [key])
    return [(r.extent.segment_id, r.tier) for r in view.replicas]


def segment_stats(state, segment_id):
    return next(g for g in state.stats().segments if g.info.segment_id == segment_id)


def filled_past_the_watermark(clock):
    """A tiered state whose DRAM holds k0..k3 (past its high watermark), unleased, ticked: the
    demotions of k0 and k1 are issued."""
    state = tiered(clock)
    for i in range(4):
        put(state, f"k{i}")
    clock.advance(LEASE_S + 1)
    state.tick()
    return state


def run_moves(state, node="n", ok=True):
    moves = state.take_moves(node)
    state.moves_finished(node, [m.move_id for m in moves] if ok else [],
                         [] if ok else [m.move_id for m in moves])
    return moves


def test_puts_go_to_the_fastest_tier_with_room(clock):
    state = tiered(clock)
    assert [put(state, f"k{i}")[0].extent.segment_id for i in range(6)] == ["m"] * 4 + ["d"] * 2
    assert put(state, "k6")[0].tier == "disk"


def test_a_full_tier_demotes_in_policy_order_and_switches_only_when_the_copy_is_done(clock):
    state = tiered(clock)
    for i in range(4):
        put(state, f"k{i}")
        clock.advance(1)
    get_replicas(state, ["k0"])     # k0 is used again: k1 becomes the oldest
    clock.advance(LEASE_S + 1)
    state.tick()                   # 4/4 > 0.75: down to 0.5, i.e. two objects leave
    moves = state.take_moves("n")
    assert [m.key for m in moves] == ["k1", "k2"]
    assert all(m.src.segment_id == "m" and m.dst.segment_id == "d" for m in moves)
    assert state.take_moves("n") == []           # handed out once
    version = moves[0].version
    assert where(state, "k1") == [("m", "dram")]   # not switched before the copy is done
    state.tick()
    assert state.take_moves("n") == []           # moving objects count as gone already
    state.moves_finished("n", [m.move_id for m in moves])
    [view] = get_replicas(state, ["k1"])
    assert [r.extent for r in view.replicas] == [moves[0].dst]
    assert view.replicas[0].tier == "disk" and view.version != version
    s = state.stats()
    assert (s.demotions, s.evictions, s.objects) == (2, 0, 4)
    seg = {g.info.segment_id: g for g in s.segments}
    # The sources were leased (read above, k1 just now): free only once those leases end.
    assert seg["m"].quarantined_bytes == 2 * B
    clock.advance(LEASE_S + 1)
    state.tick()
    assert state.stats().segments[0].quarantined_bytes == 0
    assert state.stats().segments[0].used_bytes == 2 * B


def test_a_failed_move_frees_its_destination_and_keeps_the_object(clock):
    state = filled_past_the_watermark(clock)
    moves = run_moves(state, ok=False)
    assert len(moves) == 2
    assert where(state, "k0") == [("m", "dram")]
    disk = segment_stats(state, "d")
    assert disk.used_bytes == 0
    clock.advance(LEASE_S + 1)
    state.tick()                                  # tried again (k0, read above, is newer)
    assert [m.key for m in run_moves(state)] == ["k1", "k2"]
    assert state.stats().demotions == 2


def test_an_unreported_move_expires_and_its_destination_is_quarantined(clock):
    state = filled_past_the_watermark(clock)
    moves = state.take_moves("n")
    clock.advance(PUT_TIMEOUT_S + 1)
    state.tick()   # expired (the node may still be writing the destination); issued again
    disk = segment_stats(state, "d")
    assert disk.quarantined_bytes == 2 * B
    again = state.take_moves("n")
    assert [m.key for m in again] == ["k0", "k1"]
    assert {m.dst for m in again}.isdisjoint({m.dst for m in moves})
    state.moves_finished("n", [m.move_id for m in moves])   # too late: ignored
    assert state.stats().demotions == 0
    state.moves_finished("n", [m.move_id for m in again])
    assert state.stats().demotions == 2


def test_moves_expire_in_the_outbox_too(clock):
    state = filled_past_the_watermark(clock)   # queued for a node that is not heard in time
    clock.advance(PUT_TIMEOUT_S + 1)
    state.tick()
    # Only the moves issued again are handed out: an expired one's destination is reused
    # after the quarantine, and a late copy into it would overwrite another object.
    assert len(state.take_moves("n")) == 2


def test_an_object_removed_during_its_move_is_not_resurrected(clock):
    state = filled_past_the_watermark(clock)
    moves = state.take_moves("n")
    assert state.remove(["k0"]) == [None]
    state.moves_finished("n", [m.move_id for m in moves])
    assert state.exists(["k0", "k1"]) == [False, True]
    disk = segment_stats(state, "d")
    assert (disk.used_bytes, disk.objects) == (B, 1)


def test_only_the_last_tier_drops_data(clock):
    state = tiered(clock, dram=4, disk=4)
    for i in range(8):                            # DRAM and disk full
        put(state, f"k{i}")
        clock.advance(1)
    clock.advance(LEASE_S + 1)
    [placed] = state.put_start(["new"], [B])      # room is made on disk, never in DRAM
    assert placed[0].tier == "disk"
    assert state.exists([f"k{i}" for i in range(8)]) == [True] * 4 + [False] + [True] * 3
    state.put_end(["new"])
    state.tick()                                  # both tiers are past their watermark
    moves = run_moves(state)
    assert moves and all(m.dst.segment_id == "d" for m in moves)
    s = state.stats()
    assert s.evictions >= 1 + len(moves)          # disk made room for the demotions
    assert all(state.exists([f"k{i}" for i in range(4)]))   # DRAM's objects all kept


def test_a_disk_object_read_twice_within_the_window_is_promoted(clock):
    state = tiered(clock, promote_window_s=10.0)
    for i in range(4):
        put(state, f"k{i}")
    clock.advance(LEASE_S + 1)
    state.tick()
    run_moves(state)                              # k0, k1 on disk
    clock.advance(LEASE_S + 1)
    state.tick()
    assert where(state, "k0") == [(where(state, "k0")[0][0], "disk")]   # read twice: but...
    assert state.take_moves("n") != []            # ...promoted (DRAM is at 2/4: room)
    get_replicas(state, ["k1"])
    clock.advance(11)                             # outside the window: no promotion
    get_replicas(state, ["k1"])
    moves = state.take_moves("n")
    assert moves == []
    state.moves_finished("n", [])


def test_pinned_objects_are_neither_demoted_nor_evicted(clock):
    state = tiered(clock)
    for i in range(4):
        put(state, f"k{i}")
    assert state.pin(["k0", "k1"]) == [None, None]
    clock.advance(LEASE_S + 1)
    state.tick()
    assert [m.key for m in state.take_moves("n")] == ["k2", "k3"]


# -- model-based ----------------------------------------------------------------------------

KEYS = [f"k{i}" for i in range(6)]


class TiersMachine(RuleBasedStateMachine):
    """Random puts, reads, removes, ticks and node moves (done, failed, held back) against a
    reference model: the keys stored and each one's bytes (a token), and a fake node memory
    that the moves copy for real. Checked after every step: every indexed object reads its own
    token at every replica; a read granted earlier sees its token while its lease lasts; only
    disk-tier objects are ever dropped; the allocators account for every byte."""

    @initialize()
    def setup(self):
        self.clock = FakeClock()
        self.state = tiered(self.clock, dram=2, disk=4, promote_window_s=10.0)
        self.memory: dict[tuple[str, int], object] = {}   # (segment, offset) -> token
        self.model: dict[str, object] = {}                 # key -> token
        self.reads: list[tuple[str, object, tuple, float]] = []
        self.held: list = []                               # moves taken, not reported yet
        self.tier: dict[str, set[str]] = {}                # key -> tiers, before each step
        self.serial = 0
        self.hard: set[str] = set()                        # hard-pinned keys

    def _snapshot(self):
        self.tier = {}
        for key in self.model:
            obj = self.state._objects[key]
            self.tier[key] = {self.state._segments[e.segment_id].info.tier
                              for e in self.state._index.replicas(obj)}

    def _settle_model(self):
        """Keys gone from the index without a remove were evicted: only from disk."""
        for key in list(self.model):
            if not self.state.exists([key])[0]:
                assert self.tier.get(key) == {"disk"}, (key, self.tier.get(key))
                assert key not in self.hard, key   # hard pins are never evicted
                del self.model[key]

    @rule(key=st.sampled_from(KEYS))
    def put(self, key):
        self._snapshot()
        [placed] = self.state.put_start([key], [B])
        if key in self.model:
            assert isinstance(placed, AlreadyExists)
            return
        if isinstance(placed, NoSpace):
            return
        assert isinstance(placed, tuple), placed
        self.serial += 1
        token = (key, self.serial)
        for r in placed:
            self.memory[(r.extent.segment_id, r.extent.offset)] = token
        assert self.state.put_end([key]) == [None]
        self._settle_model()
        self.model[key] = token

    @rule(key=st.sampled_from(KEYS))
    def get(self, key):
        self._snapshot()
        [view] = get_replicas(self.state, [key])
        if key not in self.model:
            assert isinstance(view, ObjectNotFound)
            return
        assert not isinstance(view, KVPoolError), view
        for r in view.replicas:
            place = (r.extent.segment_id, r.extent.offset)
            self.reads.append((key, self.model[key], place, self.clock.now + LEASE_S))
        self._settle_model()

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key):
        self._snapshot()
        [err] = self.state.remove([key])
        assert (err is None) == (key in self.model)
        self.model.pop(key, None)
        self.hard.discard(key)

    @rule(key=st.sampled_from(KEYS), ttl_s=st.sampled_from([None, 5.0]))
    def pin(self, key, ttl_s):
        [err] = self.state.pin([key], ttl_s)
        if key not in self.model:
            assert isinstance(err, ObjectNotFound)
        elif err is None and ttl_s is None:
            self.hard.add(key)
        else:
            assert err is None or isinstance(err, NoSpace)   # past the hard-pin quota

    @rule(key=st.sampled_from(KEYS))
    def unpin(self, key):
        self.state.unpin([key])
        self.hard.discard(key)

    @rule(dt=st.sampled_from([0.0, 0.0, 1.0, 6.0, 12.0]))
    def tick(self, dt):
        self._snapshot()
        self.state.heartbeat("n")   # the node stays alive: its objects go only by eviction
        self.clock.advance(dt)
        self.state.tick()
        self._settle_model()

    @rule(outcome=st.sampled_from(["done", "failed", "hold"]))
    def node_moves(self, outcome):
        moves = self.state.take_moves("n")
        if outcome == "hold":
            self.held += moves
            return
        self._run(moves, outcome == "done")

    @precondition(lambda self: self.held)
    @rule()
    def report_held(self):
        moves, self.held = self.held, []
        self._run(moves, True)

    def _run(self, moves, ok):
        self._snapshot()
        if ok:   # the node copies for real, then reports
            for m in moves:
                token = self.memory.get((m.src.segment_id, m.src.offset))
                self.memory[(m.dst.segment_id, m.dst.offset)] = token
        done = [m.move_id for m in moves] if ok else []
        self.state.moves_finished("n", done, [] if ok else [m.move_id for m in moves])
        self._settle_model()

    @invariant()
    def indexed_objects_read_their_own_bytes(self):
        for key, token in self.model.items():
            obj = self.state._objects[key]
            for e in self.state._index.replicas(obj):
                assert self.memory.get((e.segment_id, e.offset)) == token, key

    @invariant()
    def reads_in_flight_keep_their_bytes_while_leased(self):
        now = self.clock.now
        self.reads = [r for r in self.reads if r[3] > now]
        for key, token, place, _ in self.reads:
            assert self.memory.get(place) == token, (key, place)

    @invariant()
    def allocators_account_for_every_byte(self):
        st_ = self.state
        for sid, seg in st_._segments.items():
            indexed = B * seg.objects
            moving_in = sum(B for m in st_._tiers._moves.values() if m.dst_seg is seg)
            assert seg.allocator.used_bytes == indexed + seg.quarantined_bytes + moving_in, sid


TiersMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50,
                                          deadline=None)
test_tiers_state_machine = TiersMachine.TestCase


def test_demotion_follows_the_prefix_order_tails_first_shared_prefix_last(clock):
    state = make_state(clock, high_watermark=0.75, low_watermark=0.25)
    state.mount_segment(endpoints("n"), SegmentInfo("m", 5 * B, "dram"))
    state.mount_segment(endpoints("n"), SegmentInfo("d", 8 * B, "disk"))
    # A shared system block s0 and two chains below it; s0 is the oldest of all.
    for key, parent in [("s0", None), ("a0", "s0"), ("a1", "a0"), ("b0", "s0"), ("b1", "b0")]:
        [placed] = state.put_start([key], [B], parents=[parent])
        assert isinstance(placed, tuple)
        state.put_end([key])
        clock.advance(1)
    clock.advance(LEASE_S + 1)
    state.tick()   # 5/5 > 0.75: down to 0.25, i.e. four leave; plain LRU would take s0 first
    assert [m.key for m in run_moves(state)] == ["a1", "b1"]
    state.tick()   # still draining: the parents of the tails that went down go next
    assert [m.key for m in run_moves(state)] == ["a0", "b0"]
    state.tick()   # 1/5 is under the low watermark: the shared block stays
    assert run_moves(state) == []


def test_chains_keep_their_links_down_on_disk_and_back_up(clock):
    """A chain demoted to disk is dropped from disk tail first (the parent comes down after
    its children and links them there), and a block promoted back links to its parent again;
    the manifest records of the moves name the parent."""
    state = make_state(clock, high_watermark=0.75, low_watermark=0.25, promote_window_s=10.0)
    state.mount_segment(endpoints("n"), SegmentInfo("m", 3 * B, "dram"), keeps_manifest=True)
    state.mount_segment(endpoints("n"), SegmentInfo("d", 4 * B, "disk"), keeps_manifest=True)
    for key, parent in [("c0", None), ("c1", "c0"), ("c2", "c1")]:
        state.put_start([key], [B], parents=[parent])
        state.put_end([key])
        clock.advance(1)
    clock.advance(LEASE_S + 1)
    for _ in range(3):   # 3/3 > 0.75: all go down, one tier step per tick, tail first
        state.tick()
        assert len(run_moves(state)) == 1
    assert [where(state, k)[0][1] for k in ("c0", "c1", "c2")] == ["disk"] * 3   # c2: newest
    committed = state.take_manifest("n").committed
    assert {r.key: r.parent for r in committed if r.segment_id == "d"} == \
        {"c0": None, "c1": "c0", "c2": "c1"}
    clock.advance(11)   # the reads above are out of the promotion window
    for i in range(4):  # DRAM to its watermark (2), the disk's free slot, then one must go
        put(state, f"z{i}")
    assert state.exists(["c0", "c1", "c2"]) == [True, True, False]   # LRU would drop c0
    # c1 read twice: promoted, and linked to c0 again (waiting for it in DRAM's policy).
    clock.advance(LEASE_S + 1)
    state.remove(["z0"])   # room in DRAM below its high watermark for the promotion
    state.remove(["z1"])
    get_replicas(state, ["c1"])
    get_replicas(state, ["c1"])
    [move] = run_moves(state)
    assert move.key == "c1" and where(state, "c1")[0][1] == "dram"
    assert state._chains.parent_of("c1", disk=False) == "c0"
    [rec] = [r for r in state.take_manifest("n").committed if r.key == "c1"]
    assert rec.segment_id == "m" and rec.parent == "c0"


def test_promotion_considers_every_disk_replica(clock):
    """An object whose first replica is in DRAM on one node and whose second is on another
    node's disk: read twice, the disk replica is promoted."""
    state = make_state(clock, promote_window_s=10.0)
    state.mount_segment(endpoints("a"), SegmentInfo("a-m", 4 * B, "dram"))
    state.mount_segment(endpoints("b"), SegmentInfo("b-d", 4 * B, "disk"))
    state.put_start(["k"], [B], replicas=2)
    state.put_end(["k"])
    state.mount_segment(endpoints("b"), SegmentInfo("b-m", 4 * B, "dram"))   # room above it
    assert where(state, "k") == [("a-m", "dram"), ("b-d", "disk")]
    get_replicas(state, ["k"])
    [move] = state.take_moves("b")
    assert (move.src.segment_id, move.dst.segment_id) == ("b-d", "b-m")
    state.moves_finished("b", [move.move_id])
    assert where(state, "k") == [("a-m", "dram"), ("b-m", "dram")]
