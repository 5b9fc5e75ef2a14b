"""Single puts, and small batches, into slots (client/slots.py) on a real cluster: one round
trip a put, the guarantees of a sealed put kept (an acknowledged put survives a master kill
-9), a duplicate put refused without the node forgetting the stored object, slots revoked at
close."""

from __future__ import annotations

import os
import time

import pytest
from kvpool.client import KVClient
from kvpool.client.kv_client import SLOT_BATCH_MAX
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.errors import AlreadyExists
from kvpool.net.data_port import PutRecord
from kvpool.rpc.master_client import MasterClient

from .conftest import run_cluster
from .test_master_restart import read_all_when_back

WAIT_S = 30.0   # a bound for the test to give up, not a performance target


@pytest.fixture
def one_node(tmp_path):
    """One node, so that a duplicate's slot lies on the node holding the stored object; puts
    reclaimed after 30 s, so that slots outlast any slowness of this host."""
    yield from run_cluster(tmp_path, nodes=1, master_args=["--put-timeout", "30s"])


def fill_slots_in_batches(kv: KVClient, prefix: str, n: int, size: int, batch: int
                          ) -> dict[str, bytes]:
    """Put ``batch`` values a call until ``n`` calls went through slots whole."""
    values: dict[str, bytes] = {}
    deadline = time.monotonic() + WAIT_S
    whole = 0
    while whole < n:
        assert time.monotonic() < deadline, "no batch went into slots"
        keys = [f"{prefix}-{len(values) + i}" for i in range(batch)]
        new = {k: os.urandom(size) for k in keys}
        used = kv._slots.used
        assert kv.batch_put(keys, list(new.values())) == [None] * batch
        whole += kv._slots.used - used == batch
        values.update(new)
    return values


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


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_single_puts_fill_slots_and_slots_left_are_revoked_at_close(one_node, scheme):
    with KVClient(one_node.master, transports=[scheme]) as kv:
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


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_a_duplicate_put_through_a_slot_keeps_the_stored_object_across_a_master_kill(
        one_node, scheme):
    with KVClient(one_node.master, transports=[scheme]) as kv:
        first = fill_slots(kv, "k", 4, 4096)
        for key in first:
            with pytest.raises(AlreadyExists):
                kv.put(key, os.urandom(4096))
        assert kv._slots.used >= 8   # the duplicates went through slots too
        one_node.restart_master()
        # The node kept every stored record (a slot's seal of a key it holds is refused):
        # the restarted master indexes the first values again.
        read_all_when_back(kv, first)


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_puts_into_slots_survive_a_master_kill_and_puts_go_on_after_it(one_node, scheme):
    with KVClient(one_node.master, transports=[scheme]) as kv:
        values = fill_slots(kv, "before", 50, 16 << 10)
        one_node.restart_master()   # right after the last put was acknowledged
        read_all_when_back(kv, values)
        # The slots of the killed master are refused: puts go the usual way, then fill
        # slots of the new one.
        after = fill_slots(kv, "after", 10, 16 << 10)
        assert kv.batch_get(list(after), verify=True) == list(after.values())


def test_on_tcp_a_slot_takes_only_a_shorter_write_and_a_key_of_its_tenant(one_node):
    """A slot's grants name its placeholder and whole extent; the node that holds the slot's
    reservation takes them for a write no longer than the slot, sealed under a key of the
    placeholder's tenant only (store_node/data_server.py ``_slot_denied``)."""
    placeholder = "kvpool.slot.test.0"
    with MasterClient(one_node.master) as mc:
        [where], _, grant = mc.put_start_grant([placeholder], [8192], replicas=1, slots=True)
    [slot] = where
    record = PutRecord(placeholder, grant.versions[0], grant.epoch, grant.hold_s)
    value = os.urandom(5000)

    def into_slot(n: int, key: str):
        op = IoOp(slot.at(slot.extent.offset, n, slot.grant), memoryview(value + bytes(8192))[:n])
        [error], _ = tcp.write_sealed([op], [PutRecord(key, record.version, record.epoch,
                                                       record.hold_s)], reserved=True)
        return error

    tcp = TCPTransport()
    try:
        # Before the slot is reserved here, its grant covers only the whole extent.
        assert "DENIED" in str(into_slot(len(value), "mine"))
        assert tcp.reserve([IoOp(slot, memoryview(b""))], [record]) == [None]
        assert "DENIED" in str(into_slot(8192 + 64, "mine"))              # longer than the slot
        assert "not a key of the slot's tenant" in str(into_slot(len(value), "\x1dother\x1dk"))
        # That write landed (its grant is spent) and its seal was refused.
        assert "spent" in str(into_slot(len(value), "mine"))
    finally:
        tcp.close()
    with KVClient(one_node.master) as kv:
        assert kv.batch_exists(["mine", "k"]) == [False, False]


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_small_batches_fill_slots_and_survive_a_master_kill(one_node, scheme):
    with KVClient(one_node.master, transports=[scheme]) as kv:
        values = fill_slots_in_batches(kv, "b", 6, 20_000, SLOT_BATCH_MAX)
        assert kv.batch_get(list(values), verify=True) == list(values.values())
        one_node.restart_master()   # right after the last batch was acknowledged
        read_all_when_back(kv, values)


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_a_batch_in_slots_answers_each_key_its_own(one_node, scheme):
    """A stored key among the batch's is refused alone, its stored bytes kept; a key given
    twice goes the usual way (refused the second time); the others are stored."""
    with KVClient(one_node.master, transports=[scheme]) as kv:
        stored = fill_slots_in_batches(kv, "s", 2, 4096, 4)
        old = next(iter(stored))
        deadline = time.monotonic() + WAIT_S
        while True:   # until a batch with the stored key in it went through slots whole
            assert time.monotonic() < deadline, "no batch went into slots"
            keys = [f"n-{time.monotonic_ns()}-{i}" for i in range(3)]
            new = [os.urandom(4096) for _ in keys]
            used = kv._slots.used
            results = kv.batch_put([*keys, old], [*new, os.urandom(4096)])
            if kv._slots.used - used == 4:
                break
        assert results[:3] == [None] * 3 and isinstance(results[3], AlreadyExists)
        assert kv.batch_get([*keys, old], verify=True) == [*new, stored[old]]
        twice = kv.batch_put(["t", "t"], [b"one", b"two"])
        assert twice[0] is None and isinstance(twice[1], AlreadyExists)
        assert kv.get("t") == b"one"
