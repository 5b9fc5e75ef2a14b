"""A store node with a disk tier under a real master: DRAM past its watermark demotes to disk
instead of dropping, everything reads back byte for byte from wherever it went, a disk block
read twice comes back up, and a restarted node keeps its disk-tier objects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from kvpool.client import KVClient

from .conftest import run_cluster

BLOCK = 256 << 10          # bytes per object
DRAM = 16 * BLOCK          # one 4 MiB DRAM segment: 16 blocks
DISK = "64MiB"


def value(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def tiers(kv: KVClient) -> dict[str, tuple[int, int]]:
    """tier -> (objects, used bytes), over the whole cluster."""
    out: dict[str, list[int]] = {}
    for g in kv.stats().segments:
        t = ("dram", "hbm", "disk")[g.segment.tier]
        row = out.setdefault(t, [0, 0])
        row[0] += g.objects
        row[1] += g.used_bytes
    return {t: (o, u) for t, (o, u) in out.items()}


def tier_of(kv: KVClient, key: str) -> str:
    """Where the master says ``key`` is (a read for the promotion rule: 'read once')."""
    views = kv._master.locate([key]).views()
    return views[0].replicas[0].tier


def wait_for(pred, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


@pytest.fixture
def disk_cluster(tmp_path):
    """A master and no nodes yet; tests add nodes with a disk tier in tmp_path."""
    yield from run_cluster(tmp_path, nodes=0, segment_size=str(DRAM),
                           master_args=["--high-watermark", "0.75", "--low-watermark", "0.5",
                                        "--put-timeout", "10s"])


def add_disk_node(cluster, tmp_path, name: str = "d0"):
    return cluster.add_node(name, ["--disk-path", str(tmp_path / f"disk-{name}"),
                                   "--disk-size", DISK])


def test_dram_past_its_watermark_demotes_and_everything_reads_back(disk_cluster, tmp_path):
    add_disk_node(disk_cluster, tmp_path)
    n = 48   # three times what DRAM holds
    with KVClient(disk_cluster.master) as kv:
        for i in range(n):   # one by one: DRAM fills, the master demotes between puts
            kv.put(f"k{i}", value(i))
        # DRAM settles under its high watermark; puts that found it full went to disk.
        wait_for(lambda: tiers(kv)["dram"][1] <= 0.75 * DRAM)
        stats = kv.stats()
        assert stats.evictions == 0            # nothing was lost
        assert stats.objects == n
        assert stats.demotions > 0, stats
        assert tiers(kv)["disk"][0] >= n - 16
        # Every object, byte for byte, from DRAM or disk (disk replicas over tcp).
        got = kv.batch_get([f"k{i}" for i in range(n)], verify=True)
        assert [g == value(i) for i, g in enumerate(got)] == [True] * n
    # `kvpool stat` shows usage per tier per node, and the demotions.
    out = subprocess.run([sys.executable, "-m", "kvpool", "stat", "--master", disk_cluster.master],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "demotions" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("d0 ")]
    assert {r[1] for r in rows} >= {"dram", "disk"}, out


def test_a_disk_block_read_twice_is_promoted(disk_cluster, tmp_path):
    add_disk_node(disk_cluster, tmp_path)
    with KVClient(disk_cluster.master) as kv:
        for i in range(14):
            kv.put(f"k{i}", value(i))
        wait_for(lambda: tiers(kv).get("disk", (0, 0))[0] >= 4)
        # Make room in DRAM below its high watermark, so a promotion has somewhere to go.
        on_disk = [f"k{i}" for i in range(14) if tier_of(kv, f"k{i}") == "disk"]   # read 1
        kv.batch_remove([k for k in (f"k{i}" for i in range(14)) if k not in on_disk])
        time.sleep(1.5)   # their space is free once the leases of read 1 run out (1s)
        key = on_disk[0]
        assert kv.get(key) == value(int(key[1:]))   # read 2, within the window: promoted
        wait_for(lambda: kv.stats().promotions >= 1)
        assert tier_of(kv, key) == "dram"
        assert kv.get(key, verify=True) == value(int(key[1:]))


def test_node_restart_keeps_its_disk_tier(disk_cluster, tmp_path):
    node = add_disk_node(disk_cluster, tmp_path)
    n = 40
    with KVClient(disk_cluster.master) as kv:
        for i in range(n):
            kv.put(f"k{i}", value(i))
        wait_for(lambda: tiers(kv)["dram"][1] <= 0.75 * DRAM)
        on_disk = sorted(k for k in (f"k{i}" for i in range(n)) if tier_of(kv, k) == "disk")
        assert len(on_disk) >= n - 16
        time.sleep(0.5)   # the manifest stream delivers the last demotions' records
        assert node.terminate() == 0
        disk_cluster.nodes.remove(node)
        # DRAM objects went with the node; the disk tier's are back once it re-announces.
        add_disk_node(disk_cluster, tmp_path)
        wait_for(lambda: all(kv.batch_exists(on_disk)))
        got = kv.batch_get(on_disk, verify=True)
        assert [g == value(int(k[1:])) for k, g in zip(on_disk, got)] == [True] * len(on_disk)
        assert kv.stats().objects == len(on_disk)


def test_a_restarted_node_drops_its_disk_chains_tail_first(disk_cluster, tmp_path):
    """A chain's blocks keep their parent in the disk tier's manifest log: after the node
    restarts, the disk still drops the chain from its tail, even a tail read last."""
    args = ["--disk-path", str(tmp_path / "disk-c"), "--disk-size", str(8 * BLOCK)]
    node = disk_cluster.add_node("c", args)
    chain = [f"c{i}" for i in range(14)]
    with KVClient(disk_cluster.master) as kv:
        for i, k in enumerate(chain):   # 14/16 > 0.75: down to 8 in DRAM, the tail first
            kv.put(k, value(i), parent=chain[i - 1] if i else None)
        wait_for(lambda: tiers(kv).get("disk", (0, 0))[0] == 6)
        time.sleep(0.5)   # the last demotions' records reach the node's manifest
        assert node.terminate() == 0
        disk_cluster.nodes.remove(node)
        disk_cluster.add_node("c", args)   # DRAM's blocks are gone; the disk's come back
        on_disk = wait_for(lambda: [k for k, e in zip(chain, kv.batch_exists(chain)) if e]
                           if tiers(kv).get("disk", (0, 0))[0] == 6 else None)
        assert on_disk == chain[8:]
        assert kv.get(chain[-1]) == value(13)   # the tail is the newest read on disk now
        time.sleep(1.5)   # its lease (1 s) runs out: it may be dropped
        for i in range(16):   # DRAM fills and demotes: the disk (6/8) must drop blocks
            kv.put(f"x{i}", value(100 + i))
        wait_for(lambda: not all(kv.batch_exists(on_disk)))
        kept = [k for k, e in zip(on_disk, kv.batch_exists(on_disk)) if e]
        assert len(kept) < len(on_disk) and kept == on_disk[:len(kept)], kept   # no holes
        assert kv.batch_get(kept, verify=True) == [value(int(k[1:])) for k in kept]


@pytest.mark.parametrize("args, message", [
    (["--disk-path", "{tmp}/nope/deeper", "--disk-size", "1MiB"], "parent directory"),
    (["--disk-path", "{tmp}/file", "--disk-size", "1MiB"], "not a directory"),
    (["--disk-path", "{tmp}/big", "--disk-size", "1000TiB"], "does not fit"),
    (["--disk-path", "{tmp}/x"], "go together"),
    (["--hbm-size", "1GiB"], "--hbm-size"),
])
def test_bad_tier_arguments_are_clear_errors(tmp_path, args, message):
    (tmp_path / "file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = subprocess.run([sys.executable, "-m", "kvpool", "store-node", "--master",
                        "127.0.0.1:1", "--segment-size", "1MiB", *argv],
                       capture_output=True, text=True, timeout=60, check=False,
                       env={**os.environ, "KVPOOL_MASTER": ""})
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_pins_through_the_client(disk_cluster, tmp_path):
    add_disk_node(disk_cluster, tmp_path)
    from kvpool.common.errors import NoSpace, ObjectNotFound
    with KVClient(disk_cluster.master) as kv:
        kv.put("hard", value(1), pin=True)
        kv.put("soft", value(2), pin=30.0)
        with pytest.raises(ObjectNotFound):
            kv.pin("missing")
        # The default quota: hard pins hold at most half the cluster (4 + 64 MiB here).
        keys = [f"p{i}" for i in range(160)]
        for lo in range(0, 160, 40):   # 40 MiB in one batch would pass --max-pending (0.5)
            assert kv.batch_put(keys[lo:lo + 40],
                                [value(i) for i in range(lo, lo + 40)]) == [None] * 40
        errors = kv.batch_pin(keys)
        assert any(isinstance(e, NoSpace) for e in errors)
        pinned = [k for k, e in zip(keys, errors) if e is None]
        assert 120 <= len(pinned) < 160
        assert kv.batch_unpin(pinned) == [None] * len(pinned)
        kv.unpin("hard")
        assert kv.get("hard") == value(1)


def test_bench_disk_tier_prints_its_figures(tmp_path):
    out = tmp_path / "disk.json"
    r = subprocess.run([sys.executable, "-m", "kvpool", "bench", "--disk-tier", "--disk-bytes",
                        "16MiB", "--block-size", "1MiB", "--repeats", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=170, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plain file" in r.stdout and "demotion DRAM -> disk" in r.stdout
    figures = json.loads(out.read_text())
    assert figures["bytes_identical"] is True
    assert figures["objects_on_disk"] > 0
    for name in ("demotion_gbps", "kvpool_cold_gbps", "kvpool_warm_gbps", "file_cold_gbps",
                 "file_warm_gbps"):
        assert figures[name] > 0, name


def test_master_restart_keeps_both_tiers(disk_cluster, tmp_path):
    add_disk_node(disk_cluster, tmp_path)
    n = 40
    keys = [f"k{i}" for i in range(n)]
    with KVClient(disk_cluster.master) as kv:
        for i, k in enumerate(keys):
            kv.put(k, value(i))
        wait_for(lambda: tiers(kv)["dram"][1] <= 0.75 * DRAM)
        time.sleep(0.5)   # the last demotions' records reach the node's manifest
        disk_cluster.restart_master()
        wait_for(lambda: all(kv.batch_exists(keys)))
        got = kv.batch_get(keys, verify=True)
        assert [g == value(i) for i, g in enumerate(got)] == [True] * n
        assert tiers(kv)["disk"][0] >= n - 16
