"""Single puts into slots (client/slots.py) on a real cluster: one round trip a put, the
guarantees of a sealed put kept (an acknowledged put survives a master kill -9), a duplicate
put refused without the node forgetting the stored object, slots revoked at close."""

from __future__ import annotations

import os
import time

import pytest
from kvpool.client import KVClient
from kvpool.common.errors import AlreadyExists

from .conftest import run_cluster
from .test_master_restart import read_all_when_back

WAIT_S = 30.0   # a bound for the test to give up, not a performance target


@pytest.fixture
def one_node(tmp_path):
    """One node, so that a duplicate's slot lies on the node holding the stored object; puts
    reclaimed after 30 s, so that slots outlast any slowness of this host."""
    yield from run_cluster(tmp_path, nodes=1, master_args=["--put-timeout", "30s"])


def fill_slots(kv: KVClient, prefix: str, n: int, size: int) -> dict[str, bytes]:
    """Put ``n`` values one at a time until the slots took them (the first puts of a size
    go the usual way while the slots are made)."""
    values = {}
    deadline = time.monotonic() + WAIT_S
    used = kv._slots.used
    while kv._slots.used - used < n:
        assert time.monotonic() < deadline, "no slot was made"
        key = f"{prefix}-{len(values)}"
        values[key] = os.urandom(size)
        kv.put(key, values[key])
    return values


def test_single_puts_fill_slots_and_slots_left_are_revoked_at_close(one_node):
    with KVClient(one_node.master, transports=["shm"]) as kv:
        values = fill_slots(kv, "k", 40, 60_000)
        assert kv.batch_get(list(values), verify=True) == list(values.values())
        stats = kv.stats()
        assert stats.objects == len(values)
        assert stats.pending_objects > 0     # the slots held for the next puts
        # A slot's tail is freed when it is filled: 60,000 bytes take 60,032, not 64 KiB.
        used = sum(s.used_bytes for s in stats.segments)
        assert used == len(values) * 60_032 + stats.pending_objects * (64 << 10)
    with KVClient(one_node.master, put_slots=False) as kv:
        assert kv.stats().pending_objects == 0


def test_a_duplicate_put_through_a_slot_keeps_the_stored_object_across_a_master_kill(one_node):
    with KVClient(one_node.master, transports=["shm"]) as kv:
        first = fill_slots(kv, "k", 4, 4096)
        for key in first:
            with pytest.raises(AlreadyExists):
                kv.put(key, os.urandom(4096))
        assert kv._slots.used >= 8   # the duplicates went through slots too
        one_node.restart_master()
        # The node kept every stored record (a slot's seal of a key it holds is refused):
        # the restarted master indexes the first values again.
        read_all_when_back(kv, first)


def test_puts_into_slots_survive_a_master_kill_and_puts_go_on_after_it(one_node):
    with KVClient(one_node.master, transports=["shm"]) as kv:
        values = fill_slots(kv, "before", 50, 16 << 10)
        one_node.restart_master()   # right after the last put was acknowledged
        read_all_when_back(kv, values)
        # The slots of the killed master are refused: puts go the usual way, then fill
        # slots of the new one.
        after = fill_slots(kv, "after", 10, 16 << 10)
        assert kv.batch_get(list(after), verify=True) == list(after.values())
