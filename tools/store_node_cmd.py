"""``kvpool store-node``: run a store node that pools memory segments."""

from __future__ import annotations

import argparse
import contextlib

from kvpool.common.config import ConfigError, parse_size
from kvpool.tools.argtypes import (
    duration_type,
    log_arg,
    master_arg,
    port_type,
    size_or_off_type,
    size_type,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Run a store node: allocates DRAM segments (and, with --disk-path / --hbm-size, a disk "
        "or HBM tier that full tiers demote to), mounts them on the master, serves tcp and "
        "same-host shm, and registers the segments for one-sided RDMA where a device exists. "
        "Prints `store-node: NODE_ID ...` once mounted (before it, with --metrics-port, "
        "`metrics: HOST:PORT`: the probes answer while the node mounts).")
    master_arg(p)
    p.add_argument("--segment-size", type=size_type, action="append", metavar="SIZE",
                   help="size of one DRAM segment, e.g. 4GiB; repeat for several (default: one 4GiB)")
    p.add_argument("--hugepages", action="store_true",
                   help="put the DRAM segments in 2 MiB huge pages (fewer TLB misses on every "
                        "copy); reserve them first, as root: sysctl vm.nr_hugepages=N")
    p.add_argument("--host", default="127.0.0.1", help="address the data server listens on "
                   "(default: 127.0.0.1)")
    p.add_argument("--port", type=port_type, default=0, help="data server tcp port (default: 0 = any)")
    p.add_argument("--advertise-host", help="address clients dial, if not --host (e.g. the "
                   "node's LAN address when listening on 0.0.0.0)")
    p.add_argument("--metrics-port", type=port_type, metavar="PORT",
                   help="serve Prometheus metrics (/metrics) and probes (/healthz, /readyz) "
                        "over HTTP on this port of --host; 0 = any free port (default: off)")
    p.add_argument("--node-id", help="stable name of this node (default: the one its "
                   "credentials name, else HOSTNAME-RANDOM)")
    p.add_argument("--credentials", metavar="FILE",
                   help="this node's credentials file (ca, cert, key with OU=node; "
                        "SECURITY.md), or a directory of ca.crt, tls.crt and tls.key (as "
                        "cert-manager writes them); default: $KVPOOL_CREDENTIALS if it holds "
                        "a node's, else a node certificate from a local cluster (`kvpool up`) "
                        "of this user at --master, else none (plain text)")
    p.add_argument("--heartbeat-interval", type=duration_type, default=1.0, metavar="DURATION",
                   help="how often to heartbeat the master; keep well under its --node-ttl "
                        "(default: 1s)")
    p.add_argument("--data-tls", action="store_true",
                   help="serve the tcp data port over TLS with this node's certificate, so "
                        "values cross the network encrypted (clients with the cluster's "
                        "credentials follow; RDMA is then not offered to them; SECURITY.md)")
    p.add_argument("--no-shm", action="store_true",
                   help="do not offer the same-host shared-memory hand-off (tcp only)")
    p.add_argument("--max-connections", type=int, default=4096, metavar="N",
                   help="data connections (tcp and shm) at once; at the cap the tcp connection "
                        "idle longest is closed for a new one (default: 4096, lowered to fit "
                        "the fd limit)")
    p.add_argument("--idle-timeout", type=duration_type, default=120.0, metavar="DURATION",
                   help="close a tcp data connection idle this long, and end one whose frame "
                        "stalls this long (default: 120s)")
    p.add_argument("--shm-writer", action="append", default=[], metavar="uid:N|gid:N",
                   help="also trust this uid (or primary gid) with the shm hand-off's writable "
                        "fd; repeat for several (default: only this node's uid, and root)")
    p.add_argument("--shm-reader", action="append", default=[], metavar="uid:N|gid:N",
                   help="hand this uid (or primary gid) a read-only shm fd: it may read any "
                        "byte of the segments, and write none; repeat for several")
    p.add_argument("--scrub-rate", type=size_or_off_type, default=64 << 20, metavar="SIZE",
                   help="bytes per second the scrubber reads to re-check stored objects' "
                        "checksums; a damaged replica is dropped from the index (default: "
                        "64MiB; 0 = no scrubbing)")
    p.add_argument("--scrub-interval", type=duration_type, default=60.0, metavar="DURATION",
                   help="rest between two scrubbing passes (default: 60s)")
    p.add_argument("--disk-path", metavar="DIR",
                   help="add a disk tier: a file in DIR (created if missing) that DRAM demotes "
                        "its least valuable objects to instead of dropping them; its objects "
                        "survive a restart of the node (start it with the same DIR and size)")
    p.add_argument("--disk-size", type=size_type, metavar="SIZE",
                   help="size of the disk tier, e.g. 100GiB (reserved up front; required with "
                        "--disk-path)")
    p.add_argument("--hbm-size", type=size_type, metavar="SIZE",
                   help="add an HBM tier of this size on --gpu (needs CUDA and torch)")
    p.add_argument("--gpu", type=int, default=0, metavar="INDEX",
                   help="the GPU for --hbm-size (default: 0)")
    rd = p.add_mutually_exclusive_group()
    rd.add_argument("--rdma-device", metavar="NAME",
                    help="register the segments with this RDMA device (e.g. mlx5_0, rxe0; "
                         "`ibv_devices` lists them) so clients read and write them one-sided; "
                         "an error if it is missing. Default: the first device found, if any "
                         "(needs pyverbs: apt install python3-pyverbs)")
    rd.add_argument("--no-rdma", action="store_true", help="do not offer rdma even where a "
                    "device exists")
    log_arg(p)


def run(args: argparse.Namespace) -> int:
    from kvpool.common.logging import configure
    from kvpool.store_node.node import StoreNode
    from kvpool.tools.cluster import wait_for_signal
    configure(args.log_level, component="store-node", fmt=args.log_format)
    if (args.disk_path is None) != (args.disk_size is None):
        raise ConfigError("--disk-path and --disk-size go together: give both or neither")
    if args.hbm_size is not None:
        from kvpool.store_node.hbm import check_hbm
        check_hbm(args.gpu, args.hbm_size)   # a clear error where there is no GPU
    node = StoreNode(args.master, args.segment_size or [parse_size("4GiB")], host=args.host,
                     port=args.port, node_id=args.node_id,
                     heartbeat_interval_s=args.heartbeat_interval, shm=not args.no_shm,
                     advertise_host=args.advertise_host,
                     rdma_device=False if args.no_rdma else args.rdma_device,
                     scrub_bytes_per_s=args.scrub_rate, scrub_interval_s=args.scrub_interval,
                     disk_path=args.disk_path, disk_size=args.disk_size or 0,
                     hbm_size=args.hbm_size or 0, gpu=args.gpu, hugepages=args.hugepages,
                     data_limits=_data_limits(args), credentials=args.credentials,
                     data_tls=args.data_tls)
    with contextlib.ExitStack() as running:
        if args.metrics_port is not None:   # up first: /healthz answers while the node mounts
            from kvpool.common.metrics import MetricsServer, new_registry
            from kvpool.store_node.metrics import NodeCollector
            registry = new_registry()
            registry.register(NodeCollector(node))
            metrics = running.enter_context(
                MetricsServer(registry, node.not_ready, args.host, args.metrics_port))
            print(f"metrics: {metrics.address}", flush=True)
        node.start()
        running.callback(node.stop)   # before the metrics port closes
        rdma = f" rdma={node.endpoints.rdma_device}" if node.endpoints.rdma_device else ""
        print(f"store-node: {node.node_id} tcp={node.endpoints.tcp_endpoint}{rdma}", flush=True)
        wait_for_signal()
    return 0


def _data_limits(args: argparse.Namespace):
    from kvpool.store_node.data_server import DataLimits
    try:
        return DataLimits(max_connections=args.max_connections,
                          idle_timeout_s=args.idle_timeout,
                          shm_writers=tuple(args.shm_writer), shm_readers=tuple(args.shm_reader))
    except ValueError as e:
        raise ConfigError(str(e)) from None
