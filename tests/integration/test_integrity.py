"""Integrity on a real cluster: checksums taken at put, checked by verified reads; a damaged
replica (garbage written into its segment through the node's tcp data port) is dropped and
reported, and the read is served from the intact replica or refused, never returned."""

from __future__ import annotations

import os
import time

import pytest
from kvpool.client import KVClient
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.shm import SHMTransport
from kvpool.common.checksum import checksum
from kvpool.common.errors import CorruptObject, ObjectNotFound, TransportError
from kvpool.rpc.master_client import MasterClient


def damage(replica) -> None:
    """Overwrite a replica's bytes in its node's segment (a bit flip in RAM, a stray write):
    through shm, as this process is the node's uid (the tcp data port writes only extents
    granted to a pending put)."""
    t = SHMTransport()
    try:
        garbage = memoryview(bytearray(os.urandom(replica.extent.length)))
        [err] = t.write([IoOp(replica, garbage)])
        assert err is None, err
    finally:
        t.close()


def replicas_of(master: str, key: str):
    with MasterClient(master) as mc:
        [view] = mc.locate([key]).views()
    return view


def test_checksum_is_recorded_at_put(cluster):
    value = os.urandom(300_000)
    with KVClient(cluster.master) as kv:
        kv.put("k", value)
        assert replicas_of(cluster.master, "k").checksum == checksum(value)
        assert kv.get("k", verify=True) == value


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_large_batch_records_each_values_own_checksum(cluster, transport):
    # 12 MiB in all, so two threads share the work: over shm the copy and the checksum are one
    # pass, each thread taking half the values; over tcp a helper checksums while sending.
    values = [os.urandom((2 << 20) + 4096 * i) for i in range(6)]
    keys = [f"big-{transport}-{i}" for i in range(len(values))]
    with KVClient(cluster.master, transports=[transport]) as kv:
        assert kv.batch_put(keys, values) == [None] * len(values)
        with MasterClient(cluster.master) as mc:
            views = mc.locate(keys).views()
        assert [v.checksum for v in views] == [checksum(v) for v in values]
        assert kv.batch_get(keys, verify=True) == values


class _CopyDamagingShm(SHMTransport):
    """An shm transport whose copy goes wrong: the checksum it reports is not the bytes'."""

    def write_summed(self, ops):
        errors, sums = super().write_summed(ops)
        return errors, [None if c is None else c ^ 1 for c in sums]


def test_a_single_put_whose_seal_the_node_refuses_fails_and_leaves_nothing(cluster):
    """A single put sends PutEnd while the node checks its seal (client/kv_client.py): when
    the node refuses the seal (the bytes it holds are not the checksummed ones), the commit
    is taken back, so the put fails and no object with those bytes is served."""
    with KVClient(cluster.master, transports=[_CopyDamagingShm(timeout_s=5)]) as kv, \
            pytest.raises(TransportError, match="CHECKSUM_MISMATCH"):
        kv.put("damaged-copy", os.urandom(16384))
    with KVClient(cluster.master) as kv:
        with pytest.raises(ObjectNotFound):
            kv.get("damaged-copy")
        kv.put("after", b"x" * 4096)   # the space and the link are fine
        assert kv.get("after", verify=True) == b"x" * 4096


def test_damaged_replica_is_dropped_and_read_served_from_another(cluster):
    value = os.urandom(1 << 20)
    with KVClient(cluster.master, transports=["tcp"]) as kv:
        kv.put("k", value, replicas=2)
        view = replicas_of(cluster.master, "k")
        assert len(view.replicas) == 2
        # Damage the replica the client reads first, so verification must fall back.
        damage(view.replicas[0])
        damage_second = view.replicas[1]
        out = bytearray(len(value))
        assert kv.get_into("k", out, verify=True) == len(value)
        assert out == value
        # Dropped once its node re-checked the bytes (its next heartbeat): a reader's report
        # alone drops nothing (master/rechecks.py).
        assert _eventually(lambda: [r.extent for r in replicas_of(cluster.master, "k").replicas]
                           == [damage_second.extent])
        # The last replica damaged too: a typed error, never the bytes; then the key is gone.
        damage(damage_second)
        with pytest.raises(CorruptObject):
            kv.get("k", verify=True)
        assert _eventually(lambda: not kv.exists("k"))
        with pytest.raises(ObjectNotFound):
            kv.get("k")


def test_batch_verify_reports_per_key(cluster):
    values = [os.urandom(64 * 1024) for _ in range(4)]
    keys = [f"b{i}" for i in range(4)]
    with KVClient(cluster.master) as kv:
        assert kv.batch_put(keys, values) == [None] * 4
        damage(replicas_of(cluster.master, "b2").replicas[0])
        got = kv.batch_get(keys, verify=True)
        assert [g for i, g in enumerate(got) if i != 2] == values[:2] + values[3:]
        assert isinstance(got[2], CorruptObject)
        assert _eventually(lambda: kv.batch_exists(keys) == [True, True, False, True])


def _eventually(fn, timeout_s: float = 10.0) -> bool:
    """Whether ``fn()`` holds within ``timeout_s`` (a node re-checks on its next heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while not fn():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_scrubber_finds_damage_nobody_reads(tmp_path):
    """A node scrubbing fast finds a damaged object on its own and the master drops it."""
    from kvpool.tools.cluster import LocalCluster

    from .conftest import FAST_MASTER, FAST_NODE

    with LocalCluster(nodes=1, segment_size="64MiB", master_args=FAST_MASTER,
                      node_args=[*FAST_NODE, "--scrub-rate", "1GiB", "--scrub-interval", "100ms"],
                      log_dir=tmp_path / "logs") as c, KVClient(c.master) as kv:
        kv.batch_put(["intact", "damaged"], [os.urandom(1 << 16), os.urandom(1 << 16)])
        damage(replicas_of(c.master, "damaged").replicas[0])
        deadline = time.monotonic() + 30
        while kv.exists("damaged"):
            assert time.monotonic() < deadline, "the scrubber did not report the damage"
            time.sleep(0.05)
        assert kv.exists("intact")
