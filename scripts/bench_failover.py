"""Measure a failover between standby masters: a local cluster of 3 masters electing on a real
etcd (a throwaway one on free ports) and 2 store nodes holds N objects; the leader is killed
(SIGKILL) and a client, given only the etcd URL, retries until a put succeeds (the new leader
serves) and reads until every object is back byte for byte (the index is rebuilt from the
nodes). Median of --runs runs; the baseline is one master killed and restarted in place
(scripts/bench_recovery.py), measured in the same run.

    python3 scripts/bench_failover.py --objects 20000 --runs 3 --lease-ttl 2s

Needs the etcd binary (Debian: apt-get install etcd-server).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import bench_recovery  # beside this script: run it by path, python3 scripts/bench_failover.py
from bench_recovery import _all_back, load
from etcd_server import EtcdServer, etcd_binary
from kvpool.client import KVClient
from kvpool.common.errors import KVPoolError
from kvpool.tools.argtypes import duration_type
from kvpool.tools.cluster import LocalCluster

GIVE_UP_S = 120.0


def measure(etcd_url: str, objects: int, value_bytes: int, heartbeat: str, segment_size: str,
            lease_ttl_s: float) -> dict:
    """Kill the leader of a fresh HA cluster holding ``objects`` values; seconds."""
    keys = [f"failover-{i}" for i in range(objects)]
    values = [os.urandom(value_bytes) for _ in range(objects)]
    with tempfile.TemporaryDirectory(prefix="kvpool-failover-") as logs, \
            LocalCluster(nodes=2, segment_size=segment_size, masters=3, ha=etcd_url,
                         master_args=["--ha-lease-ttl", f"{lease_ttl_s}s"],
                         node_args=["--heartbeat-interval", heartbeat], log_dir=logs) as cluster, \
            KVClient(cluster.master) as kv:
        load(kv, keys, values)
        killed = time.monotonic()
        cluster.kill_leader()
        while True:
            try:
                kv.put(f"probe-{time.monotonic()}", b"p" * 64)
                break
            except KVPoolError:
                if time.monotonic() - killed > GIVE_UP_S:
                    raise SystemExit(f"no leader served within {GIVE_UP_S:.0f}s") from None
                time.sleep(0.01)
        serving = time.monotonic()
        while not _all_back(kv, keys, values):
            if time.monotonic() - killed > GIVE_UP_S:
                raise SystemExit(f"objects not all back within {GIVE_UP_S:.0f}s")
            time.sleep(0.02)
        done = time.monotonic()
    return {"kill_to_first_put_s": serving - killed, "kill_to_all_readable_s": done - killed}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python3 scripts/bench_failover.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=20000, help="objects to store (20000)")
    p.add_argument("--value-bytes", type=int, default=4096, help="bytes per object (4096)")
    p.add_argument("--runs", type=int, default=3, help="failovers to measure (3)")
    p.add_argument("--lease-ttl", type=duration_type, default=2.0,
                   help="the leader's etcd lease (2s, etcd's minimum)")
    p.add_argument("--heartbeat-interval", default="200ms", help="the nodes' heartbeat (200ms)")
    p.add_argument("--segment-size", default="256MiB", help="per node (256MiB)")
    a = p.parse_args(argv)
    if etcd_binary() is None:
        raise SystemExit("no etcd binary: apt-get install etcd-server")
    runs = []
    with EtcdServer() as etcd:
        for i in range(a.runs):
            r = measure(f"{etcd.url}/bench-{i}", a.objects, a.value_bytes,
                        a.heartbeat_interval, a.segment_size, a.lease_ttl)
            runs.append(r)
            print(f"run {i + 1}/{a.runs}: leader kill -9 -> first put "
                  f"{r['kill_to_first_put_s']:.2f} s, -> all readable "
                  f"{r['kill_to_all_readable_s']:.2f} s", flush=True)
    base = bench_recovery.measure(a.objects, a.value_bytes, a.heartbeat_interval, a.segment_size)
    first = statistics.median(r["kill_to_first_put_s"] for r in runs)
    full = statistics.median(r["kill_to_all_readable_s"] for r in runs)
    print(f"{a.objects} objects, etcd lease {a.lease_ttl:g} s, median of {a.runs}: "
          f"leader kill -9 -> first successful put {first:.2f} s, -> index rebuilt (all "
          f"readable byte for byte) {full:.2f} s")
    print(f"baseline, one master killed and restarted in place: serving "
          f"{base['kill_to_serving_s']:.2f} s, all readable {base['kill_to_all_readable_s']:.2f} s"
          f" (failover / restart: {full / base['kill_to_all_readable_s']:.2f}x)")


if __name__ == "__main__":
    main()
