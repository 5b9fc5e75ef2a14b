"""Same-host gets from the nodes' shm indexes (net/shm_index.py, client/local_reads.py) against a
real secure master and store nodes: served with no master call, never another object's bytes,
never a removed object's, never from a stopped node, and counted by the master."""

from __future__ import annotations

import signal
import time

import pytest
from kvpool.client import KVClient
from kvpool.common.errors import KVPoolError, ObjectNotFound
from kvpool.store_node.node import StoreNode

from .conftest import run_cluster

VALUE = 64 << 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from run_cluster(tmp_path_factory.mktemp("local-reads"), nodes=1,
                           segment_size="16MiB")


def value_of(key: str, size: int = VALUE) -> bytes:
    seed = key.encode().ljust(64, b".")
    return (seed * (size // len(seed) + 1))[:size]


def served_locally(client: KVClient, key: str, timeout_s: float = 5.0,
                   reads: str = "_local") -> bytes:
    """Get ``key`` until it is served with no master call: from the index (``reads``
    "_local"), or at its held place ("_held"); its commit reaches the node within ms."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = getattr(client, reads).served
        got = client.get(key)
        if getattr(client, reads).served > before:
            return got
        assert time.monotonic() < deadline, f"{key!r} was never served with no master call"
        time.sleep(0.01)


def test_a_committed_object_is_read_with_the_master_stopped(cluster):
    with KVClient(cluster.master, timeout_s=2.0) as c:
        c.put("still", value_of("still"))
        assert served_locally(c, "still") == value_of("still")
        master = cluster.master_proc.popen
        master.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert c.get("still") == value_of("still")
            assert time.monotonic() - started < 1.0
        finally:
            master.send_signal(signal.SIGCONT)
    with KVClient(cluster.master, local_reads=False) as plain:
        assert plain.get("still") == value_of("still")
        assert plain._local is None


def test_a_removed_key_is_never_read_from_the_index(cluster):
    with KVClient(cluster.master) as c:
        c.put("gone", value_of("gone"))
        served_locally(c, "gone")
        c.remove("gone")
        with pytest.raises(ObjectNotFound):
            c.get("gone")


#: Where each transport's gets with no master call are counted (client/local_reads.py).
READS = {"shm": "_local", "tcp": "_held"}


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_space_given_again_is_never_read_as_the_old_object(cluster, scheme):
    """A 16 MiB segment filled four times over: the reader reads keys old and new while the
    writer's puts evict the old ones and reuse their space (extents overlapping old ones at
    other offsets: sizes vary). Each read is the key's own bytes, or not found; some are
    served with no master call (tcp: at places the reader learned by reading them before).
    The keys read again are used again, so the master rarely evicts them: a key read once
    first and not again is the one that must go, and its held place be refused (tcp: the
    check at work)."""
    with KVClient(cluster.master, transports=[scheme]) as writer, \
            KVClient(cluster.master, transports=[scheme]) as reader:
        reads = getattr(reader, READS[scheme])
        keys: list[tuple[str, int]] = []
        served = 0
        first = f"reuse-{scheme}-first"
        writer.put(first, value_of(first))
        assert reader.get(first) == value_of(first)   # tcp: the reader holds its place
        for i in range(4 * (16 << 20) // VALUE):
            key = f"reuse-{scheme}-{i}"
            size = VALUE + (i % 7) * 4096
            writer.put(key, value_of(key, size))
            keys.append((key, size))
            if i % 10 == 5:   # read a recent key (a read leases it for a second)
                reader.get(keys[-3][0])
            if i % 10 or i < 250:
                continue
            for old, old_size in (keys[-8], keys[-88], keys[-248]):   # keys read before
                before = reads.served
                try:
                    got = reader.get(old)
                except ObjectNotFound:
                    continue
                assert got == value_of(old, old_size), old
                served += reads.served > before
        assert served > 0
        with pytest.raises(ObjectNotFound):
            reader.get(first)
        assert scheme == "shm" or reads.refused > 0


def test_the_same_key_of_two_tenants_is_read_locally_as_each_ones_own(cluster):
    def client(tenant: str) -> KVClient:
        return KVClient(cluster.master, credentials=str(cluster.credentials("client", tenant)))

    with client("tenant-a") as a, client("tenant-b") as b:
        a.put("same", b"A" * 4096)
        b.put("same", b"B" * 4096)
        assert served_locally(a, "same") == b"A" * 4096
        assert served_locally(b, "same") == b"B" * 4096
        assert a._local.tenant == "tenant-a"


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_gets_served_with_no_master_call_are_counted_by_the_master(cluster, scheme):
    with KVClient(cluster.master, transports=[scheme]) as c:
        reads = getattr(c, READS[scheme])
        c.put(f"counted-{scheme}", value_of("counted"))
        served_locally(c, f"counted-{scheme}", reads=READS[scheme])
        before, served = c.stats().hits, reads.served
        for _ in range(10):
            c.get(f"counted-{scheme}")
        assert reads.served - served == 10
        assert c.stats().hits - before == 10


def test_a_stopped_nodes_index_is_not_read(cluster):
    proc = cluster.add_node("short-lived")
    try:
        with KVClient(cluster.master) as c:
            keys = [f"doomed-{i}" for i in range(8)]
            for k in keys:   # placed on both nodes
                c.put(k, value_of(k))
            for k in keys:
                served_locally(c, k)
            proc.kill()   # a crash: its index is left as it was, and must not be read
            cluster.nodes.remove(proc)
            lost = 0
            for k in keys:
                before = c._local.served
                try:
                    assert c.get(k) == value_of(k)   # from the node still running
                except KVPoolError:
                    lost += 1
                    assert c._local.served == before
            assert lost > 0   # some keys were on the stopped node, and none read from it
    finally:
        if proc.alive():
            proc.kill()


def test_an_entry_changed_during_the_copy_is_not_trusted(bare_master):
    """The seqlock: between the client's lookup and its copy, the node voids the entry (as a
    writer's RESERVE of that space would) and the bytes change: the read is not trusted."""
    node = StoreNode(bare_master.master, [8 << 20], node_id="inproc", rdma_device=False,
                     scrub_bytes_per_s=0)
    node.start()
    try:
        with KVClient(bare_master.master) as c:
            c.put("raced", value_of("raced"))
            served_locally(c, "raced")
            rec = node.manifest.get("raced")
            shm = c._local._transport

            def overwritten_meanwhile(size: int) -> memoryview:
                node.manifest.overwriting(rec.segment_id, rec.offset, rec.size)
                node.segments[rec.segment_id].buffer[rec.offset:rec.offset + rec.size] = \
                    value_of("other", rec.size)
                return memoryview(bytearray(size))

            assert shm.read_local("raced", lambda size: memoryview(bytearray(size))) == rec.size
            assert shm.read_local("raced", overwritten_meanwhile) is None
            assert shm.read_local("raced", lambda size: memoryview(bytearray(size))) is None
    finally:
        node.stop()
