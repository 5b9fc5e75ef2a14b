"""``kvpool up``: a local cluster (a master and store nodes) on this host until Ctrl-C."""

from __future__ import annotations

import argparse
import sys

from kvpool.common import security
from kvpool.common.config import ConfigError, format_size, parse_size
from kvpool.tools.argtypes import count_type, port_type, size_type
from kvpool.tools.cluster import ClusterError, LocalCluster, wait_for_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Run a master and store nodes on this host until Ctrl-C. "
                     "Prints `master: HOST:PORT`.")
    p.add_argument("--nodes", type=count_type, default=2, help="store nodes to start (default: 2)")
    p.add_argument("--segment-size", type=size_type, default=parse_size("1GiB"), metavar="SIZE",
                   help="DRAM segment per node (default: 1GiB)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    p.add_argument("--port", type=port_type, default=0, help="master port (default: 0 = any free port)")
    p.add_argument("--disk-size", type=size_type, metavar="SIZE",
                   help="give every node a disk tier of this size, e.g. 10GiB (reserved up "
                        "front), that full DRAM demotes to instead of dropping (default: none)")
    p.add_argument("--disk-path", metavar="DIR",
                   help="with --disk-size: keep each node's disk tier in DIR/NODE, so a "
                        "cluster started again on DIR finds its objects (default: a temporary "
                        "directory, removed on exit)")
    p.add_argument("--metrics", action="store_true",
                   help="every process serves Prometheus metrics and probes over HTTP on a "
                        "free port (see master --metrics-port); their addresses are printed")
    p.add_argument("--credentials-dir", metavar="DIR",
                   help="make the cluster's CA and credentials here, kept (default: a "
                        "temporary directory, removed on exit); clients of this user find "
                        "them by the master's address, others through KVPOOL_CREDENTIALS")
    p.add_argument("--insecure", action="store_true",
                   help="no credentials: plain text, every caller trusted (SECURITY.md)")
    p.add_argument("--hugepages", action="store_true",
                   help="the nodes' DRAM segments in reserved 2 MiB huge pages (see "
                        "store-node --hugepages)")


def run(args: argparse.Namespace) -> int:
    if args.disk_path is not None and args.disk_size is None:
        raise ConfigError("--disk-path needs --disk-size (the size of each node's disk tier)")
    cluster = LocalCluster(nodes=args.nodes, segment_size=str(args.segment_size), host=args.host,
                           port=args.port,
                           disk_size=str(args.disk_size) if args.disk_size else None,
                           disk_path=args.disk_path,
                           node_args=["--hugepages"] if args.hugepages else [],
                           metrics=args.metrics, secure=not args.insecure,
                           credentials_dir=args.credentials_dir)
    try:
        cluster.start()
    except (ClusterError, OSError) as e:   # the message carries the process's log tail
        print(f"kvpool up: error: {e}", file=sys.stderr)
        return 1
    try:
        print(f"master: {cluster.master}", flush=True)
        for name, address in cluster.metrics_addresses.items():
            print(f"metrics of {name}: http://{address}/metrics", flush=True)
        disk = (f" + a {format_size(args.disk_size)} disk tier in "
                f"{cluster.disk_dir}" if args.disk_size else "")
        print(f"{args.nodes} store nodes, {format_size(args.segment_size)} DRAM each{disk}. "
              f"Try: kvpool stat --master {cluster.master}   (Ctrl-C stops the cluster)",
              flush=True)
        if cluster.client_credentials is not None:
            # This user's processes find them by the master's address; others need this.
            print(f"{security.ENV}={cluster.client_credentials}", flush=True)
        wait_for_signal()
        print("stopping...", flush=True)
    finally:
        cluster.stop()
    return 0
