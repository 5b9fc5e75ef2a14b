"""Back-pressure on a real cluster: a put that cannot be placed, even after eviction, fails
with NoSpace saying how much was asked and how much room the cluster has; a batch says which
of its keys were stored, and those (and only those) are readable."""

from __future__ import annotations

import numpy as np
from kvpool.client import KVClient
from kvpool.common.errors import NoSpace, ObjectNotFound

MIB = 1 << 20


def test_batch_put_over_capacity_says_which_keys_were_stored(cluster):
    # 2 nodes x 64 MiB; one batch of 40 x 4 MiB: its objects are all PENDING together, so
    # nothing in it can be evicted to make room for the rest; and PENDING puts may hold half
    # the capacity (max_pending_fraction 0.5): 16 are placed, the rest refused saying so.
    keys = [f"big-{i}" for i in range(40)]
    values = [np.full(4 * MIB, i, dtype=np.uint8) for i in range(40)]
    with KVClient(cluster.master) as kv:
        results = kv.batch_put(keys, values)
        stored = [k for k, r in zip(keys, results) if r is None]
        refused = [r for r in results if r is not None]
        assert len(stored) == 16, results
        assert all(type(r) is NoSpace for r in refused), refused
        msg = str(refused[0])
        assert f"{4 * MIB} bytes" in msg and f"of {128 * MIB} bytes free" in msg, msg
        assert "max_pending_fraction 0.5" in msg, msg
        refused_keys = [k for k, r in zip(keys, results) if r is not None]
        assert not any(kv.batch_exists(refused_keys))
        # The stored ones are readable, exact, until the watermark evicts some of them (the
        # cluster is full to the last byte).
        got = kv.batch_get(stored)
        assert all(g == values[keys.index(k)].tobytes() or isinstance(g, ObjectNotFound)
                   for k, g in zip(stored, got))
        assert any(isinstance(g, bytes) for g in got)
