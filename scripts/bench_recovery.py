"""Measure how long a master restart takes to lose nothing: a local cluster holds N objects,
the master is killed (SIGKILL) and started again on the same port, and a client reads until
every object is back, byte for byte.

    python3 scripts/bench_recovery.py --objects 20000 --heartbeat-interval 1s

Prints the time from the kill to the new master serving, and to all objects readable (the
nodes notice on their next heartbeat, mount again and re-announce their manifests).
"""

from __future__ import annotations

import argparse
import os
import time

from kvpool.client import KVClient
from kvpool.common.errors import MasterUnavailable
from kvpool.tools.cluster import LocalCluster

_BATCH = 2000


def measure(objects: int, value_bytes: int, heartbeat: str, segment_size: str) -> dict:
    """Kill and restart the master of a fresh cluster holding ``objects`` values; seconds."""
    keys = [f"recovery-{i}" for i in range(objects)]
    values = [os.urandom(value_bytes) for _ in range(objects)]
    with LocalCluster(nodes=2, segment_size=segment_size,
                      node_args=["--heartbeat-interval", heartbeat]) as cluster, \
            KVClient(cluster.master) as kv:
        load(kv, keys, values)
        killed = time.monotonic()
        cluster.restart_master()
        serving = time.monotonic()
        while not _all_back(kv, keys, values):
            time.sleep(0.02)
        done = time.monotonic()
    return {"objects": objects, "kill_to_serving_s": serving - killed,
            "kill_to_all_readable_s": done - killed}


def load(kv: KVClient, keys: list[str], values: list[bytes]) -> None:
    """Put every value, in batches; exit with the first failure."""
    for b in range(0, len(keys), _BATCH):
        failed = [r for r in kv.batch_put(keys[b:b + _BATCH], values[b:b + _BATCH]) if r]
        if failed:
            raise SystemExit(f"put failed: {failed[0]} (use a larger --segment-size)")


def _all_back(kv: KVClient, keys: list[str], values: list[bytes]) -> bool:
    for b in range(0, len(keys), _BATCH):
        try:
            got = kv.batch_get(keys[b:b + _BATCH])
        except MasterUnavailable:
            return False
        for k, g, v in zip(keys[b:b + _BATCH], got, values[b:b + _BATCH]):
            if isinstance(g, bytes) and g != v:
                raise SystemExit(f"wrong bytes for {k!r} after the restart")
            if not isinstance(g, bytes):
                return False
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python3 scripts/bench_recovery.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=20000, help="objects to store (20000)")
    p.add_argument("--value-bytes", type=int, default=4096, help="bytes per object (4096)")
    p.add_argument("--heartbeat-interval", default="1s", help="the nodes' heartbeat (1s)")
    p.add_argument("--segment-size", default="256MiB", help="per node (256MiB)")
    a = p.parse_args(argv)
    r = measure(a.objects, a.value_bytes, a.heartbeat_interval, a.segment_size)
    print(f"{r['objects']} objects: kill -9 -> new master serving {r['kill_to_serving_s']:.2f} s,"
          f" -> all readable byte for byte {r['kill_to_all_readable_s']:.2f} s")


if __name__ == "__main__":
    main()
