"""Network faults between "hosts" (network namespaces): a store node partitioned away, then
healed; a store node behind a link that drops 20% of its packets. Clients (this process, in the
root namespace) keep working from the other replicas and never read a wrong byte.

What "the node rejoins and reconciles" means, given node TTL semantics: once the master has
declared the partitioned node dead, its replicas left the index (objects with no other replica
went with them). When the partition heals, the node is told it is unknown, mounts again and
re-announces its manifest; the master takes back exactly the replicas of objects it still
indexes (same key, version, size, checksum) and refuses the rest (removed, evicted, or dropped
while the node was away), which the node forgets. So afterwards: the node serves again, each
surviving object that had a replica there lists it again and reads right from it, nothing
removed during the partition comes back, and every segment's allocated bytes equal the bytes of
the objects indexed there.
"""

from __future__ import annotations

import hashlib
import re
import time

import pytest
from kvpool.client.kv_client import KVClient
from kvpool.client.transport.base import IoOp
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.errors import KVPoolError
from kvpool.rpc.master_client import MasterClient

from .conftest import NODE_TTL_S, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

# A read or write to a node that answers nothing fails after this, and the client moves on to
# the next replica: the bound on how long a partition can stall one client call.
TCP_TIMEOUT_S = 1.5
OP_DEADLINE_S = 12.0      # no single client call may take longer, whatever the fault
VALUE_BYTES = 64 << 10


def value(key: str) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (VALUE_BYTES // len(seed) + 1))[:VALUE_BYTES]


def client(hosts) -> KVClient:
    return KVClient(hosts.master, transports=[TCPTransport(timeout_s=TCP_TIMEOUT_S)],
                    timeout_s=5.0)


def timed(fn, *args, **kw):
    start = time.monotonic()
    out = fn(*args, **kw)
    elapsed = time.monotonic() - start
    assert elapsed < OP_DEADLINE_S, f"{fn.__name__} took {elapsed:.1f} s"
    return out, elapsed


def put_retrying(kv: KVClient, key: str, replicas: int, deadline_s: float = 20.0) -> int:
    """Put, retrying typed failures (a replica on an unreachable node) until the deadline;
    returns the attempts it took. A put that fails is never half-stored (checked by reads)."""
    end = time.monotonic() + deadline_s
    attempts = 0
    while True:
        attempts += 1
        try:
            timed(kv.put, key, value(key), replicas=replicas)
            return attempts
        except KVPoolError as e:
            if time.monotonic() > end:
                raise AssertionError(f"put {key!r} kept failing: {e}") from e
            time.sleep(0.2)


def check_all(kv: KVClient, keys: list[str]) -> float:
    """Read every key (one batch), byte for byte; return the seconds the batch took."""
    got, elapsed = timed(kv.batch_get, keys)
    for key, g in zip(keys, got):
        assert not isinstance(g, KVPoolError), f"{key}: {g}"
        assert g == value(key), f"{key}: wrong bytes"
    return elapsed


def where(mc: MasterClient, keys: list[str]) -> dict[str, set[str]]:
    found = mc.locate(keys).views()
    return {k: {r.node.node_id for r in v.replicas} for k, v in zip(keys, found)
            if not isinstance(v, KVPoolError)}


def nodes_up(mc: MasterClient) -> int:
    return mc.stats().nodes


def assert_space_accounted(mc: MasterClient) -> None:
    for s in mc.stats(audit=True).segments:
        assert s.used_bytes == s.indexed_bytes, (s.segment.segment_id, s.used_bytes,
                                                 s.indexed_bytes)


@pytest.mark.parametrize("how", ["iptables", "link"])
def test_partitioned_node_is_routed_around_then_rejoins_and_reconciles(hosts, how):
    kv, mc = client(hosts), MasterClient(hosts.master, timeout_s=5.0, role="admin")   # audits: an admin
    try:
        keys = [f"pre-{i}" for i in range(36)]
        for k in keys:
            kv.put(k, value(k), replicas=2)
        placed = where(mc, keys)
        victim = max(hosts.names, key=lambda n: sum(n in p for p in placed.values()))
        on_victim = [k for k in keys if victim in placed[k]]
        assert on_victim

        hosts.partition(victim, how)
        cut = time.monotonic()
        # At once, while the master still hands out the victim's replicas: reads fall back.
        first = check_all(kv, keys)
        # Keys whose first replica is the victim: the client remembers the victim failed and
        # reads the other replica first, so these calls no longer pay the tcp timeout.
        found = mc.locate(on_victim).views()
        first_there = [o.key for o in found if not isinstance(o, KVPoolError)
                       and o.replicas[0].node.node_id == victim]
        single = max((timed(kv.get, k)[1] for k in first_there[:5]), default=0.0)
        assert single < TCP_TIMEOUT_S, single
        # Puts: until the master notices, one that lands on the victim fails (typed, bounded)
        # and is retried; nothing waits forever.
        new = [f"during-{i}" for i in range(12)]
        attempts = [put_retrying(kv, k, replicas=2) for k in new]
        wait_for(lambda: nodes_up(mc) == 2, NODE_TTL_S + 10, "victim declared dead")
        detect_s = time.monotonic() - cut
        removed = on_victim[:4]
        assert kv.batch_remove(removed) == [None] * len(removed)
        kept = [k for k in keys if k not in removed]
        after = check_all(kv, kept + new)
        assert all(victim not in p for p in where(mc, kept + new).values())

        hosts.heal(victim)
        healed = time.monotonic()
        back = [k for k in on_victim if k not in removed]
        wait_for(lambda: nodes_up(mc) == 3
                 and all(victim in where(mc, [k]).get(k, ()) for k in back),
                 30, "victim back with its replicas")
        rejoin_s = time.monotonic() - healed
        # Reconciled: its replicas are indexed again and read right from the victim itself.
        tcp = TCPTransport(timeout_s=TCP_TIMEOUT_S)
        try:
            found = mc.locate(back).views()
            for obj in found:
                [replica] = [r for r in obj.replicas if r.node.node_id == victim]
                buf = bytearray(obj.size)
                assert tcp.read([IoOp(replica, buf)]) == [None]
                assert bytes(buf) == value(obj.key), f"{obj.key}: wrong bytes on {victim}"
        finally:
            tcp.close()
        assert kv.batch_exists(removed) == [False] * len(removed)   # removals stay removed
        # The node re-announced its manifest; the master took back exactly the still-indexed.
        announced = re.findall(r"objects_reannounced\b.*?\bindexed=(\d+)",
                               (hosts.log_dir / f"{victim}.log").read_text())
        assert announced and int(announced[-1]) == len(back), announced
        check_all(kv, kept + new)
        assert_space_accounted(mc)
        # And it takes new objects again: three replicas need all three nodes.
        put_retrying(kv, "after-heal", replicas=3)
        assert victim in where(mc, ["after-heal"])["after-heal"]
        print(f"\npartition[{how}] of {victim}: first batch read {first:.2f} s "
              f"({len(keys)} keys, {len(on_victim)} with a replica there), slowest single "
              f"get {single:.2f} s, puts during it {sum(attempts)} attempts for {len(new)} "
              f"objects, declared dead after {detect_s:.1f} s, reads then {after:.2f} s, "
              f"rejoined with {len(back)} replicas {rejoin_s:.1f} s after the heal")
    finally:
        kv.close()
        mc.close()


def test_twenty_percent_packet_loss_on_one_node(hosts):
    kv, mc = client(hosts), MasterClient(hosts.master, timeout_s=5.0, role="admin")   # audits: an admin
    try:
        victim = hosts.names[0]
        hosts.lossy(victim, 0.2)
        start = time.monotonic()
        keys = [f"lossy-{i}" for i in range(40)]
        attempts = [put_retrying(kv, k, replicas=2) for k in keys]
        put_s = time.monotonic() - start
        on_victim = [k for k, p in where(mc, keys).items() if victim in p]
        reads = 0
        slowest = 0.0
        start = time.monotonic()
        for _ in range(3):
            slowest = max(slowest, check_all(kv, keys))
            for k in keys:
                got, took = timed(kv.get, k)
                assert got == value(k), f"{k}: wrong bytes"
                slowest = max(slowest, took)
            reads += 2 * len(keys)
        read_s = time.monotonic() - start
        assert kv.batch_remove(keys[:10]) == [None] * 10
        assert kv.batch_exists(keys[:10]) == [False] * 10
        hosts.heal(victim)
        wait_for(lambda: nodes_up(mc) == 3, NODE_TTL_S + 15, "all nodes up after the loss")
        check_all(kv, keys[10:])
        assert_space_accounted(mc)
        remounts = (hosts.log_dir / f"{victim}.log").read_text().count(
            "master_forgot_node_remounting")
        print(f"\n20% loss on {victim}: {len(keys)} puts in {put_s:.1f} s ({sum(attempts)} "
              f"attempts; {len(on_victim)} objects with a replica there), {reads} reads in "
              f"{read_s:.1f} s, slowest call {slowest:.2f} s, zero wrong bytes; the node was "
              f"declared dead and re-mounted {remounts} times")
    finally:
        kv.close()
        mc.close()
