"""The ``kvpool`` command line: run a master, a store node, a whole local cluster, inspect it."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading

from kvpool.common.config import (
    EVICTION_POLICIES,
    ConfigError,
    MasterConfig,
    format_size,
    load,
    parse_size,
)
from kvpool.common.errors import KVPoolError
from kvpool.tools import bench, kv_events_cmd, replay, soak
from kvpool.tools.argtypes import (
    count_type,
    duration_type,
    fraction_type,
    port_type,
    size_or_off_type,
    size_type,
)

DEFAULT_MASTER_PORT = 50051


def _master_arg(p: argparse.ArgumentParser, required: bool = True) -> None:
    env = os.environ.get("KVPOOL_MASTER")
    p.add_argument("--master", default=env, required=required and env is None, metavar="HOST:PORT",
                   help="the master's address (default: $KVPOOL_MASTER); with standby masters, "
                        "their list HOST:PORT,HOST:PORT,... or the etcd they elect on, "
                        "etcd://HOST:PORT[/CLUSTER]: the leader is found and followed")


def _log_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity on stderr (default: info)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool",
        description="kvpool: a cluster-wide KV-cache store for LLM serving. A master indexes KV "
                    "blocks; store nodes pool DRAM segments; engines put and get blocks by hash.",
        epilog="Start here: `kvpool demo` runs a local cluster and a shared-prefix workload; "
               "`kvpool up` runs a local cluster until Ctrl-C.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser("master", help="run the master (global index, allocator, leases, eviction)",
                       description="Run the master. Prints `master: HOST:PORT` once serving.")
    m.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; "
                   "0.0.0.0 for a multi-host cluster)")
    m.add_argument("--port", type=port_type, default=DEFAULT_MASTER_PORT,
                   help=f"gRPC port (default: {DEFAULT_MASTER_PORT}; 0 = any free port)")
    m.add_argument("--lookup-port", type=port_type, default=0, metavar="PORT",
                   help="also answer lookups (GetReplicas, the master call of every read) here, "
                        "over plain tcp: a few times cheaper than gRPC, and named in gRPC answers, "
                        "so clients find it (default: 0 = any free port; open it to clients "
                        "beside --port, or they keep using gRPC)")
    m.add_argument("--no-lookup-port", action="store_true",
                   help="answer lookups over gRPC only")
    m.add_argument("--config", metavar="FILE", help="YAML file of master settings (the long "
                   "option names with _ for -, e.g. put_timeout_s: 30s); flags override it")
    m.add_argument("--put-timeout", type=duration_type, metavar="DURATION",
                   help="reclaim a put not completed within this (default: 30s)")
    m.add_argument("--lease-ttl", type=duration_type, metavar="DURATION",
                   help="protect an object from eviction/removal this long after a read is "
                        "granted (default: 5s)")
    m.add_argument("--node-ttl", type=duration_type, metavar="DURATION",
                   help="declare a store node dead after this long without a heartbeat (default: 10s)")
    m.add_argument("--quarantine", type=duration_type, metavar="DURATION",
                   help="keep space of a reclaimed put unused this long (default: 30s)")
    m.add_argument("--high-watermark", type=fraction_type, metavar="FRACTION",
                   help="evict when a segment is fuller than this (default: 0.95)")
    m.add_argument("--low-watermark", type=fraction_type, metavar="FRACTION",
                   help="evict down to this (default: 0.85)")
    m.add_argument("--replicas", type=count_type, help="copies per object unless a client asks "
                   "otherwise (default: 1)")
    m.add_argument("--promote-window", type=duration_type, metavar="DURATION",
                   help="promote a disk-tier object back to DRAM when it is read again within "
                        "this long of its previous read (default: 60s)")
    m.add_argument("--pin-quota", type=fraction_type, metavar="FRACTION",
                   help="the share of the cluster's capacity that hard pins (never evicted) "
                        "may hold (default: 0.5)")
    m.add_argument("--eviction", choices=EVICTION_POLICIES,
                   help="what a full segment gives up first: 'prefix' evicts KV prefix chains "
                        "from the tail (blocks name their parent; shared prefixes go last, plain "
                        "LRU for objects without one), 'lru' is plain least-recently-used and "
                        "indexes each object in ~170 fewer bytes (default: prefix)")
    m.add_argument("--ha", metavar="etcd://HOST:PORT[,HOST:PORT][/CLUSTER]",
                   help="run as one of several standby masters electing a leader on etcd "
                        "(CLUSTER names the election, default 'default'); standbys refuse "
                        "calls, naming the leader; clients use the same URL as --master")
    m.add_argument("--advertise", metavar="HOST[:PORT]",
                   help="with --ha: the address clients and nodes dial to reach this master "
                        "(default: --host and the bound port; required with --host 0.0.0.0)")
    m.add_argument("--ha-lease-ttl", type=duration_type, default=5.0, metavar="DURATION",
                   help="with --ha: the leader's etcd lease; a dead leader is replaced within "
                        "about this long (default: 5s; etcd's minimum is 2s)")
    _log_arg(m)

    n = sub.add_parser("store-node", help="run a store node that pools memory segments",
                       description="Run a store node: allocates DRAM segments (and, with "
                                   "--disk-path / --hbm-size, a disk or HBM tier that full "
                                   "tiers demote to), mounts them on the "
                                   "master, serves tcp and same-host shm, and registers the "
                                   "segments for one-sided RDMA where a device exists. Prints "
                                   "`store-node: NODE_ID` once mounted.")
    _master_arg(n)
    n.add_argument("--segment-size", type=size_type, action="append", metavar="SIZE",
                   help="size of one DRAM segment, e.g. 4GiB; repeat for several (default: one 4GiB)")
    n.add_argument("--hugepages", action="store_true",
                   help="put the DRAM segments in 2 MiB huge pages (fewer TLB misses on every "
                        "copy); reserve them first, as root: sysctl vm.nr_hugepages=N")
    n.add_argument("--host", default="127.0.0.1", help="address the data server listens on "
                   "(default: 127.0.0.1)")
    n.add_argument("--port", type=port_type, default=0, help="data server tcp port (default: 0 = any)")
    n.add_argument("--advertise-host", help="address clients dial, if not --host (e.g. the "
                   "node's LAN address when listening on 0.0.0.0)")
    n.add_argument("--node-id", help="stable name of this node (default: HOSTNAME-RANDOM)")
    n.add_argument("--heartbeat-interval", type=duration_type, default=1.0, metavar="DURATION",
                   help="how often to heartbeat the master; keep well under its --node-ttl "
                        "(default: 1s)")
    n.add_argument("--no-shm", action="store_true",
                   help="do not offer the same-host shared-memory hand-off (tcp only)")
    n.add_argument("--scrub-rate", type=size_or_off_type, default=64 << 20, metavar="SIZE",
                   help="bytes per second the scrubber reads to re-check stored objects' "
                        "checksums; a damaged replica is dropped from the index (default: "
                        "64MiB; 0 = no scrubbing)")
    n.add_argument("--scrub-interval", type=duration_type, default=60.0, metavar="DURATION",
                   help="rest between two scrubbing passes (default: 60s)")
    n.add_argument("--disk-path", metavar="DIR",
                   help="add a disk tier: a file in DIR (created if missing) that DRAM demotes "
                        "its least valuable objects to instead of dropping them; its objects "
                        "survive a restart of the node (start it with the same DIR and size)")
    n.add_argument("--disk-size", type=size_type, metavar="SIZE",
                   help="size of the disk tier, e.g. 100GiB (reserved up front; required with "
                        "--disk-path)")
    n.add_argument("--hbm-size", type=size_type, metavar="SIZE",
                   help="add an HBM tier of this size on --gpu (needs CUDA and torch)")
    n.add_argument("--gpu", type=int, default=0, metavar="INDEX",
                   help="the GPU for --hbm-size (default: 0)")
    rd = n.add_mutually_exclusive_group()
    rd.add_argument("--rdma-device", metavar="NAME",
                    help="register the segments with this RDMA device (e.g. mlx5_0, rxe0; "
                         "`ibv_devices` lists them) so clients read and write them one-sided; "
                         "an error if it is missing. Default: the first device found, if any "
                         "(needs pyverbs: apt install python3-pyverbs)")
    rd.add_argument("--no-rdma", action="store_true", help="do not offer rdma even where a "
                    "device exists")
    _log_arg(n)

    u = sub.add_parser("up", help="run a local cluster (a master and store nodes) until Ctrl-C",
                       description="Run a master and store nodes on this host until Ctrl-C. "
                                   "Prints `master: HOST:PORT`.")
    u.add_argument("--nodes", type=count_type, default=2, help="store nodes to start (default: 2)")
    u.add_argument("--segment-size", type=size_type, default=parse_size("1GiB"), metavar="SIZE",
                   help="DRAM segment per node (default: 1GiB)")
    u.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    u.add_argument("--port", type=port_type, default=0, help="master port (default: 0 = any free port)")
    u.add_argument("--disk-size", type=size_type, metavar="SIZE",
                   help="give every node a disk tier of this size, e.g. 10GiB (reserved up "
                        "front), that full DRAM demotes to instead of dropping (default: none)")
    u.add_argument("--disk-path", metavar="DIR",
                   help="with --disk-size: keep each node's disk tier in DIR/NODE, so a "
                        "cluster started again on DIR finds its objects (default: a temporary "
                        "directory, removed on exit)")
    u.add_argument("--hugepages", action="store_true",
                   help="the nodes' DRAM segments in reserved 2 MiB huge pages (see "
                        "store-node --hugepages)")

    s = sub.add_parser("stat", help="show segments, usage, objects, hits and misses",
                       description="Print the cluster's state as the master sees it.")
    _master_arg(s)

    d = sub.add_parser("demo", help="a shared-prefix serving workload on a local cluster",
                       description="Start a local cluster (unless --master is given), run several "
                                   "simulated serving instances that share prompt prefixes "
                                   "through kvpool with Llama-3-8B-sized KV blocks, print hits, "
                                   "prefill tokens saved, bytes moved and GB/s, then stop.")
    _master_arg(d, required=False)
    d.add_argument("--instances", type=count_type, default=4, help="serving instances (processes) "
                   "(default: 4)")
    d.add_argument("--requests", type=count_type, default=12, help="requests per instance (default: 12)")
    d.add_argument("--prefixes", type=count_type, default=3,
                   help="distinct shared system prompts (default: 3)")
    d.add_argument("--prefix-tokens", type=count_type, default=1024,
                   help="tokens in each shared prefix (default: 1024)")
    d.add_argument("--block-bytes", type=size_type, default=parse_size("2MiB"), metavar="SIZE",
                   help="KV bytes per 16-token block (default: 2MiB, Llama-3-8B in bf16)")
    d.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")

    bench.add_parser(sub)
    replay.add_parser(sub)
    kv_events_cmd.add_parser(sub)
    soak.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"master": _cmd_master, "store-node": _cmd_store_node, "up": _cmd_up,
                "stat": _cmd_stat, "demo": _cmd_demo, "bench": bench.run,
                "replay": replay.run, "kv-events": kv_events_cmd.run,
                "soak": soak.run}[args.command](args)
    except (KVPoolError, ConfigError, OSError) as e:
        print(f"kvpool {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _cmd_master(args) -> int:
    from kvpool.common.logging import configure
    from kvpool.master.server import serve
    configure(args.log_level, component="master")
    config = load(MasterConfig, args.config, put_timeout_s=args.put_timeout,
                  lease_ttl_s=args.lease_ttl, node_ttl_s=args.node_ttl,
                  quarantine_s=args.quarantine, high_watermark=args.high_watermark,
                  low_watermark=args.low_watermark, default_replicas=args.replicas,
                  eviction=args.eviction, promote_window_s=args.promote_window,
                  pin_quota_fraction=args.pin_quota)
    announce = lambda addr: print(f"master: {addr}", flush=True)
    lookup_port = None if args.no_lookup_port else args.lookup_port
    if args.ha:
        from kvpool.common.addresses import parse_etcd_url
        from kvpool.master.ha import serve_ha
        url = parse_etcd_url(args.ha)
        asyncio.run(serve_ha(config, args.host, args.port, url, advertise=args.advertise,
                             lease_ttl_s=max(1, round(args.ha_lease_ttl)), on_started=announce,
                             lookup_port=lookup_port))
        return 0
    if args.advertise:
        raise ConfigError("--advertise is for standby masters: give --ha etcd://HOST:PORT too")
    asyncio.run(serve(config, args.host, args.port, on_started=announce,
                      lookup_port=lookup_port))
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def _cmd_store_node(args) -> int:
    from kvpool.common.logging import configure
    from kvpool.store_node.node import StoreNode
    configure(args.log_level, component="store-node")
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
                     hbm_size=args.hbm_size or 0, gpu=args.gpu, hugepages=args.hugepages)
    node.start()
    rdma = f" rdma={node.endpoints.rdma_device}" if node.endpoints.rdma_device else ""
    print(f"store-node: {node.node_id} tcp={node.endpoints.tcp_endpoint}{rdma}", flush=True)
    try:
        _wait_for_signal()
    finally:
        node.stop()
    return 0


def _cmd_up(args) -> int:
    from kvpool.tools.cluster import ClusterError, LocalCluster
    if args.disk_path is not None and args.disk_size is None:
        raise ConfigError("--disk-path needs --disk-size (the size of each node's disk tier)")
    cluster = LocalCluster(nodes=args.nodes, segment_size=str(args.segment_size), host=args.host,
                           port=args.port,
                           disk_size=str(args.disk_size) if args.disk_size else None,
                           disk_path=args.disk_path,
                           node_args=["--hugepages"] if args.hugepages else [])
    try:
        cluster.start()
    except (ClusterError, OSError) as e:   # the message carries the process's log tail
        print(f"kvpool up: error: {e}", file=sys.stderr)
        return 1
    try:
        print(f"master: {cluster.master}", flush=True)
        disk = (f" + a {format_size(args.disk_size)} disk tier in "
                f"{cluster.disk_dir}" if args.disk_size else "")
        print(f"{args.nodes} store nodes, {format_size(args.segment_size)} DRAM each{disk}. "
              f"Try: kvpool stat --master {cluster.master}   (Ctrl-C stops the cluster)",
              flush=True)
        _wait_for_signal()
        print("stopping...", flush=True)
    finally:
        cluster.stop()
    return 0


def _cmd_stat(args) -> int:
    from kvpool.rpc.master_client import MasterClient
    mc = MasterClient(args.master, timeout_s=5.0, retries=1)
    try:
        s = mc.stats()
    finally:
        mc.close()
    total = sum(g.segment.size_bytes for g in s.segments)
    used = sum(g.used_bytes for g in s.segments)
    lookups = s.hits + s.misses
    print(f"master {args.master}: {s.nodes} nodes, {len(s.segments)} segments, "
          f"{format_size(used)} used of {format_size(total)}")
    print(f"objects {s.objects} (+{s.pending_objects} pending), hits {s.hits}, misses {s.misses}"
          + (f" (hit rate {s.hits / lookups:.1%})" if lookups else "") + f", evictions {s.evictions}"
          + f", demotions {s.demotions}, promotions {s.promotions}")
    if s.segments:
        print(f"\n{'node':<20} {'segment':<36} {'size':>10} {'used':>10} {'quar.':>10} {'objects':>8}")
        for g in sorted(s.segments, key=lambda g: (g.node_id, g.segment.segment_id)):
            print(f"{g.node_id:<20} {g.segment.segment_id:<36} {format_size(g.segment.size_bytes):>10}"
                  f" {format_size(g.used_bytes):>10} {format_size(g.quarantined_bytes):>10}"
                  f" {g.objects:>8}")
        _print_tiers(s.segments)
        _print_node_transports(s.segments)
    return 0


def _print_tiers(segments) -> None:
    """Usage per tier per node (a node demotes from a full tier to the next one down)."""
    from kvpool.common.types import TIERS
    from kvpool.rpc.wire import segment_from_pb
    rows: dict[tuple[str, str], list[int]] = {}
    for g in segments:
        row = rows.setdefault((g.node_id, segment_from_pb(g.segment).tier), [0, 0, 0])
        row[0] += g.segment.size_bytes
        row[1] += g.used_bytes
        row[2] += g.objects
    print(f"\n{'node':<20} {'tier':<6} {'size':>10} {'used':>10} {'use%':>6} {'objects':>8}")
    for (node_id, tier), (size, used, objects) in sorted(
            rows.items(), key=lambda kv: (kv[0][0], TIERS.index(kv[0][1]))):
        print(f"{node_id:<20} {tier:<6} {format_size(size):>10} {format_size(used):>10} "
              f"{used / size:>6.1%} {objects:>8}")


def _print_node_transports(segments) -> None:
    """One line per node: the transports it offers (clients pick shm, then rdma, then tcp)."""
    nodes = {g.node_id: g.node for g in segments if g.HasField("node")}
    if not nodes:
        return
    print(f"\n{'node':<20} transports")
    for node_id, n in sorted(nodes.items()):
        offered = [f"tcp {n.tcp_endpoint}"] if n.tcp_endpoint else []
        if n.shm_endpoint:
            offered.append("shm (same host)")
        if n.rdma_device:
            offered.append(f"rdma {n.rdma_device} port {n.rdma_port} gid {n.rdma_gid}")
        print(f"{node_id:<20} {', '.join(offered) or 'none'}")


def _cmd_demo(args) -> int:
    from kvpool.tools.demo import run_demo
    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
