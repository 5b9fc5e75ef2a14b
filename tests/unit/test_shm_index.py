"""The node's shm index of committed objects (net/shm_index.py), both ends, and the manifest
that keeps it (store_node/manifest.py): what stands in it, and that nothing stands over space
someone may write."""

from __future__ import annotations

import mmap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpool.common.types import ObjectRecord, Reservation
from kvpool.net import shm_index
from kvpool.net.shm_index import IndexReader, IndexWriter
from kvpool.store_node.manifest import Manifest

EPOCH = 7


def reader_of(w: IndexWriter) -> IndexReader:
    return IndexReader(mmap.mmap(w.readonly_fd, w.size, mmap.MAP_SHARED, mmap.PROT_READ))


def find(r: IndexReader, key: str):
    return r.find(shm_index.digest(key))


@pytest.fixture
def index():
    w = IndexWriter(64)
    assert w.add_segment("s0") and w.add_segment("s1")
    yield w
    w.close()


def test_an_entry_says_where_its_object_is_and_stands_until_changed(index):
    r = reader_of(index)
    index.put("a", "s1", 4096, 100, 3, 0xC0FFEE)
    index.put("b", "s0", 0, 10, 4, None)
    a = find(r, "a")
    assert (r.segment_id(a.segment), a.offset, a.length, a.version, a.crc) == \
        ("s1", 4096, 100, 3, 0xC0FFEE)
    assert find(r, "b").crc is None and r.still(a)
    index.remove("a")
    assert find(r, "a") is None and not r.still(a)
    index.put("a", "s1", 4096, 100, 3, 0xC0FFEE)   # back in the same way: a new number
    assert not r.still(a) and r.still(find(r, "a"))


def test_space_someone_may_write_voids_every_entry_over_it_and_no_other(index):
    r = reader_of(index)
    index.put("long", "s0", 0, 8192, 1, None)
    index.put("mid", "s0", 8192, 4096, 1, None)
    index.put("next", "s0", 12288, 4096, 1, None)
    index.put("other", "s1", 8192, 4096, 1, None)
    held = {k: find(r, k) for k in ("long", "mid", "next", "other")}
    index.overwritten("s0", 8000, 300)   # the tail of "long", the head of "mid"
    assert find(r, "long") is None and find(r, "mid") is None
    assert not r.still(held["long"]) and not r.still(held["mid"])
    assert r.still(held["next"]) and r.still(held["other"])
    index.overwritten("s0", 16384, 100)   # just past "next"
    assert r.still(held["next"])
    # A commit over another key's place voids that key's entry too.
    index.put("new", "s0", 12000, 1000, 2, None)
    assert find(r, "next") is None and find(r, "new") is not None


def test_a_full_bucket_or_an_unknown_segment_leaves_the_key_to_the_master():
    w = IndexWriter(1)   # one bucket of WAYS entries
    w.add_segment("s0")
    r = reader_of(w)
    for i in range(shm_index.WAYS + 2):
        w.put(f"k{i}", "s0", i * 64, 64, 1, None)
    w.put("elsewhere", "disk", 0, 64, 1, None)
    found = [k for i in range(shm_index.WAYS + 2) if find(r, k := f"k{i}") is not None]
    assert len(found) == shm_index.WAYS and w.full == 2
    assert find(r, "elsewhere") is None
    w.close()


def test_a_closed_index_is_not_open_and_a_reader_cannot_write_it(index):
    r = reader_of(index)
    with pytest.raises(TypeError):
        r._buf[0:1] = b"x"   # mapped read-only
    with pytest.raises(PermissionError):
        mmap.mmap(index.readonly_fd, index.size, mmap.MAP_SHARED)
    assert r.open
    index.close()
    assert not r.open


def test_the_manifest_indexes_what_the_master_committed_and_never_a_seal(index):
    m = Manifest(index=index)
    m.set_epoch(EPOCH)
    r = reader_of(index)
    m.apply([ObjectRecord("c", "s0", 0, 100, 1, 5)], [])
    assert find(r, "c").version == 5
    # A writer's seal: held, announced, but not read by peers until the master commits it.
    m.reserve(EPOCH, Reservation("s", "s0", 4096, 100, 1e9))
    sealed = ObjectRecord("s", "s0", 4096, 100, 2, 6)
    m.seal(EPOCH, sealed)
    assert find(r, "s") is None
    m.confirm([sealed])   # a restarted master indexed it
    assert find(r, "s").version == 6
    m.apply([], [("c", 5)])
    assert find(r, "c") is None


def test_the_manifest_voids_entries_before_space_is_written_again(index):
    m = Manifest(index=index)
    m.set_epoch(EPOCH)
    r = reader_of(index)
    m.apply([ObjectRecord(k, "s0", i * 4096, 4096, None, 1) for i, k in
             enumerate(["a", "b", "c", "d"])], [])
    held = {k: find(r, k) for k in "abcd"}
    m.reserve(EPOCH, Reservation("w", "s0", 4000, 200, 1e9))   # a writer's RESERVE
    m.apply([], [], [Reservation("x", "s0", 8192, 64, 1e9)])   # the master's, streamed
    m.overwriting("s0", 12288, 4096)                            # a move's destination
    assert [r.still(held[k]) for k in "abcd"] == [False, False, False, False]
    assert all(find(r, k) is None for k in "abcd")


def test_a_held_read_is_served_only_for_its_version_at_its_place(index):
    """The node's check of a READ_HELD (net/data_port.py): the committed version at that
    offset, within the granted extent, never a seal nor another version at the same place;
    and a token held across a reservation over it is not unchanged."""
    m = Manifest(index=index)
    m.set_epoch(EPOCH)
    m.apply([ObjectRecord("a", "s0", 0, 3000, None, 5)], [])
    token, size = m.held("s0", 0, 4096, 5)   # granted a 4 KiB slot: the object is 3000 B
    assert size == 3000 and m.still_held(token)
    assert m.held("s0", 0, 3000, 5) is not None
    assert m.held("s0", 0, 4096, 4) is None      # another version
    assert m.held("s0", 0, 2048, 5) is None      # longer than the grant
    assert m.held("s1", 0, 4096, 5) is None      # another segment
    m.reserve(EPOCH, Reservation("w", "s0", 1024, 64, 1e9))   # its space is written again
    assert not m.still_held(token) and m.held("s0", 0, 4096, 5) is None
    m.apply([ObjectRecord("b", "s0", 0, 4096, None, 9)], [("a", 5)])   # another object there
    assert m.held("s0", 0, 4096, 5) is None and m.held("s0", 0, 4096, 9) is not None
    m.reserve(EPOCH, Reservation("s", "s0", 8192, 100, 1e9))
    m.seal(EPOCH, ObjectRecord("s", "s0", 8192, 100, 2, 11))
    assert m.held("s0", 8192, 100, 11) is None   # a seal the master may still refuse
    assert Manifest().held("s0", 0, 4096, 9) is None   # no index: nothing held


_OPS = st.lists(st.tuples(st.sampled_from(["commit", "remove", "reserve", "stream", "seal"]),
                          st.integers(0, 5), st.integers(0, 15), st.integers(1, 4)),
                max_size=60)


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_no_entry_ever_stands_over_space_reserved_since_its_commit(ops):
    """Random commits, removals, seals and reservations: every standing entry is the key's
    committed record (never a seal), and none overlaps space reserved after it stood."""
    w = IndexWriter(64)
    w.add_segment("s0")
    m = Manifest(index=w)
    m.set_epoch(EPOCH)
    r = reader_of(w)
    versions = iter(range(1, 10_000))
    held = {}   # key -> (entry, offset, end) when it was read
    for op, k, slot, blocks in ops:
        key, offset, size = f"k{k}", slot * 1024, blocks * 1024
        if op == "commit":
            m.apply([ObjectRecord(key, "s0", offset, size, None, next(versions))], [])
        elif op == "remove" and (rec := m.get(key)) is not None:
            m.apply([], [(key, rec.version)])
        elif op in ("reserve", "stream"):
            res = Reservation(key, "s0", offset, size, 1e9)
            m.reserve(EPOCH, res) if op == "reserve" else m.apply([], [], [res])
            for other, (entry, start, end) in list(held.items()):
                if start < offset + size and offset < end:
                    assert not r.still(entry), (other, start, end, offset, size)
                    del held[other]
        else:
            m.reserve(EPOCH, Reservation(key, "s0", offset, size, 1e9))
            m.seal(EPOCH, ObjectRecord(key, "s0", offset, size, None, next(versions)))
        for i in range(6):
            entry = find(r, f"k{i}")
            rec = m.get(f"k{i}")
            if entry is not None:
                assert rec is not None and f"k{i}" not in {s.key for s in m.sealed()}
                assert (entry.offset, entry.length, entry.version) == \
                    (rec.offset, rec.size, rec.version)
                held[f"k{i}"] = (entry, entry.offset, entry.offset + entry.length)
    w.close()
