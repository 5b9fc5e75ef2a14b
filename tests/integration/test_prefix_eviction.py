"""Prefix-aware eviction in a real master: under pressure, stored prompts lose their tails and
keep their heads (a shared system prompt longest), so their cached prefix stays usable."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.client.blocks import TokenBlocks
from kvpool.common.hashing import HashSpec
from kvpool.master.allocator import PHASE_BYTES

from .conftest import run_cluster

BS = 16                  # tokens per block
BLOCK_BYTES = 64 << 10   # one block's KV
SLOTS = 16               # blocks a segment holds


@pytest.fixture
def small_cluster(tmp_path):
    """One node with one 16-block segment (and half a page: the first block starts there,
    master/allocator.py). A high watermark of 1.0 leaves eviction to the puts that need room,
    so what is evicted does not depend on when the master's tick runs."""
    yield from run_cluster(tmp_path, nodes=1,
                           segment_size=str(SLOTS * BLOCK_BYTES + PHASE_BYTES),
                           master_args=["--high-watermark", "1.0", "--low-watermark", "0.9"])


def kv_of(prompt: int, block: int) -> np.ndarray:
    return np.full(BLOCK_BYTES, (prompt * 31 + block) % 251, dtype=np.uint8)


def test_pressure_evicts_tails_and_keeps_the_shared_prefix(small_cluster):
    system = list(range(4 * BS))                          # 4 blocks every chat starts with
    a, b = system + [1] * (4 * BS), system + [2] * (4 * BS)
    others = [[100 + p] * (4 * BS) for p in range(2)]     # unrelated prompts, 4 blocks each
    # Without slots: a client's slots (held ahead, and not evictable) may take a quarter of
    # what puts started may hold; a batch of 8 blocks here needs all of it.
    with KVClient(small_cluster.master, put_slots=False) as kv:
        blocks = TokenBlocks(kv, HashSpec.of(BS, model="m"))
        assert blocks.put(a, [kv_of(1, i) for i in range(8)]) == [None] * 8
        assert blocks.put(b, [kv_of(2, i) for i in range(8)]) == [None] * 8   # 4 new
        assert blocks.put(others[0], [kv_of(3, i) for i in range(4)]) == [None] * 4
        assert [blocks.cached_prefix(p) for p in (a, b, others[0])] == [8, 8, 4]   # full

        # 4 more blocks: a's tail goes (its oldest leaf), block by block, down to the shared
        # prefix. Plain LRU would have taken the system prompt, the oldest blocks, first.
        assert blocks.put(others[1], [kv_of(4, i) for i in range(4)]) == [None] * 4
        assert [blocks.cached_prefix(p) for p in (a, b, *others)] == [4, 8, 4, 4]

        # Reading a's prefix back: the surviving head blocks, byte for byte.
        out = [np.zeros(BLOCK_BYTES, np.uint8) for _ in range(4)]
        assert blocks.get_prefix(a, out) == 4
        assert all((o == kv_of(1, i)).all() for i, o in enumerate(out))

        # Re-computing a's tail pushes out b's: the shared prefix, with a child again, stays.
        assert blocks.put(a, [kv_of(1, i) for i in range(8)]) == [None] * 8
        assert [blocks.cached_prefix(p) for p in (a, b, *others)] == [8, 4, 4, 4]


def test_after_a_master_restart_chains_are_still_evicted_from_their_tails(small_cluster):
    """The nodes' manifests carry each block's parent: a master restarted with an empty index
    links the announced chains again, so pressure still takes tails and keeps the shared
    prefix (announced as heads, plain LRU in announce order would take the system prompt)."""
    system = list(range(4 * BS))
    a, b = system + [1] * (4 * BS), system + [2] * (4 * BS)
    other = [103] * (4 * BS)
    with KVClient(small_cluster.master, put_slots=False) as kv:   # as above
        blocks = TokenBlocks(kv, HashSpec.of(BS, model="m"))
        assert blocks.put(a, [kv_of(1, i) for i in range(8)]) == [None] * 8
        assert blocks.put(b, [kv_of(2, i) for i in range(8)]) == [None] * 8
        assert blocks.put(other, [kv_of(3, i) for i in range(4)]) == [None] * 4
        small_cluster.restart_master()
        deadline = time.monotonic() + 60
        while [blocks.cached_prefix(p) for p in (a, b, other)] != [8, 8, 4]:
            assert time.monotonic() < deadline, "the announced blocks did not come back"
            time.sleep(0.1)
        time.sleep(1.5)   # the reads above lease the blocks (1 s): let the leases run out

        more = [104] * (4 * BS)
        assert blocks.put(more, [kv_of(4, i) for i in range(4)]) == [None] * 4
        assert [blocks.cached_prefix(p) for p in (a, b, other, more)] == [4, 8, 4, 4]
        out = [np.zeros(BLOCK_BYTES, np.uint8) for _ in range(8)]
        assert blocks.get_prefix(b, out) == 8   # the shared blocks are the ones a put
        assert all((o == kv_of(1 if i < 4 else 2, i)).all() for i, o in enumerate(out))


def test_a_hard_pin_survives_a_master_restart(small_cluster):
    """Hard pins are in the nodes' manifests too: after a restart the pinned block is still
    never evicted, though it is the least recently used."""
    keys = [f"plain-{i}" for i in range(SLOTS)]
    # Without slots: a node announces its records in offset order, which a restarted master
    # takes as their recency; slots (held ahead, filled in any order) would scramble that
    # here (1 run in 6 failed), and this test is about the pin, not about that order.
    with KVClient(small_cluster.master, put_slots=False) as kv:
        for i, k in enumerate(keys):   # one by one: announced (LRU) in this order
            assert kv.put(k, kv_of(9, i)) is None
        assert kv.pin(keys[0]) is None
        small_cluster.restart_master()
        deadline = time.monotonic() + 60
        while not all(kv.exists(k) for k in keys):
            assert time.monotonic() < deadline, "the announced objects did not come back"
            time.sleep(0.1)
        assert kv.put("new-0", kv_of(10, 0)) is None
        assert kv.put("new-1", kv_of(10, 1)) is None
        assert [kv.exists(k) for k in keys[:4]] == [True, False, False, True]
        assert (np.frombuffer(kv.get(keys[0]), np.uint8) == kv_of(9, 0)).all()
