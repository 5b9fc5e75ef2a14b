"""Prefix-aware eviction in a real master: under pressure, stored prompts lose their tails and
keep their heads (a shared system prompt longest), so their cached prefix stays usable."""

from __future__ import annotations

import numpy as np
import pytest
from kvpool.client import KVClient
from kvpool.client.blocks import TokenBlocks
from kvpool.common.hashing import HashSpec

from .conftest import run_cluster

BS = 16                  # tokens per block
BLOCK_BYTES = 64 << 10   # one block's KV
SLOTS = 16               # blocks a segment holds


@pytest.fixture
def small_cluster(tmp_path):
    """One node with one 16-block segment. A high watermark of 1.0 leaves eviction to the puts
    that need room, so what is evicted does not depend on when the master's tick runs."""
    yield from run_cluster(tmp_path, nodes=1, segment_size=str(SLOTS * BLOCK_BYTES),
                           master_args=["--high-watermark", "1.0", "--low-watermark", "0.9"])


def kv_of(prompt: int, block: int) -> np.ndarray:
    return np.full(BLOCK_BYTES, (prompt * 31 + block) % 251, dtype=np.uint8)


def test_pressure_evicts_tails_and_keeps_the_shared_prefix(small_cluster):
    system = list(range(4 * BS))                          # 4 blocks every chat starts with
    a, b = system + [1] * (4 * BS), system + [2] * (4 * BS)
    others = [[100 + p] * (4 * BS) for p in range(2)]     # unrelated prompts, 4 blocks each
    with KVClient(small_cluster.master) as kv:
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
