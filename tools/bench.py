"""``kvpool bench``: kvpool's throughput and latency beside the physical limits and Redis.

One run measures, on the same bytes and this machine:

- kvpool put / get per transport (shm, tcp; rdma where a device exists) for single values
  (64 KiB, 1 MiB, 4 MiB), a prompt batch (256 x 2 MiB: a 4K-token Llama-3-8B prompt) and a
  small batch (512 x 64 KiB), with the client (this process) and the store node in different
  processes;
- the baselines: numpy memcpy into a preallocated buffer, raw loopback TCP between two
  processes, and Redis (a private redis-server, persistence off, pipelined redis-py + hiredis);
- the master: batched put (PutStart + PutEnd) and lookup (GetReplicas) objects/s, and its
  memory per indexed object (RSS growth over ``--master-objects``).

Every figure is the median of ``--repeats`` repeats. It prints a table with the ratios and the
targets, and writes ``--json FILE`` and PNG plots. Everything it starts (a local cluster, the raw
tcp peer, redis-server) is stopped when it ends, however it ends.
"""

from __future__ import annotations

import argparse
import sys

from kvpool.tools.argtypes import count_type, size_type

QUICK = {"repeats": 3, "single_calls": 64, "master_objects": 1_000_000, "master_lookups": 100_000}
FULL = {"repeats": 5, "single_calls": 200, "master_objects": 1_000_000, "master_lookups": 300_000}
DEFAULT_SIZES = "64KiB,1MiB,4MiB"


def _sizes(text: str) -> list[int]:
    return [size_type(part) for part in text.split(",") if part.strip()]


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.description = __doc__.split("\n\n", 1)[1]
    b.formatter_class = argparse.RawDescriptionHelpFormatter
    b.epilog = ("Examples:\n  kvpool bench --quick --json bench.json   (under 5 minutes)\n"
                "  kvpool bench --json bench.json --plots plots/\n"
                "  kvpool bench --master HOST:PORT --no-master-bench   (an existing cluster)\n"
                "  kvpool bench --quick --compare-insecure --no-master-bench   (security's cost)")
    b.add_argument("--master", metavar="HOST:PORT", help="bench an existing cluster instead of "
                   "starting a local one (its master's memory is then not measured)")
    b.add_argument("--quick", action="store_true", help="3 repeats, 64 calls per single-value "
                   "figure, 100k master lookups: under 5 minutes on a 2-core machine")
    b.add_argument("--json", metavar="FILE", help="write every figure, ratio and target as JSON")
    b.add_argument("--plots", metavar="DIR", help="write PNG plots here (default: beside --json)")
    b.add_argument("--transports", default="shm,tcp,rdma", metavar="LIST",
                   help="kvpool transports to bench; one that cannot run here (rdma without a "
                        "device) is reported as skipped (default: shm,tcp,rdma)")
    b.add_argument("--sizes", type=_sizes, default=None, metavar="LIST",
                   help=f"single-value sizes (default: {DEFAULT_SIZES})")
    b.add_argument("--prompt-blocks", type=count_type, default=256, metavar="N",
                   help="blocks in the prompt batch (default: 256)")
    b.add_argument("--block-size", type=_sizes, default=None, metavar="SIZE",
                   help="bytes per prompt block (default: 2MiB, Llama-3-8B bf16, 16 tokens)")
    b.add_argument("--small-blocks", type=count_type, default=512, metavar="N",
                   help="values in the small batch (default: 512)")
    b.add_argument("--small-size", type=_sizes, default=None, metavar="SIZE",
                   help="bytes per small-batch value (default: 64KiB)")
    b.add_argument("--repeats", type=count_type, metavar="N",
                   help="repeats per figure; the median is reported (default: 3 quick, 5 full)")
    b.add_argument("--single-calls", type=count_type, metavar="N",
                   help="single-value calls per repeat (default: 64 quick, 200 full)")
    b.add_argument("--master-objects", type=count_type, metavar="N",
                   help="objects indexed for the master figures (default: 1000000)")
    b.add_argument("--master-batch", type=count_type, default=256, metavar="N",
                   help="keys per master RPC (default: 256, one prompt's blocks)")
    b.add_argument("--master-clients", type=count_type, default=2, metavar="N",
                   help="client processes that also look up and put at once, keeping the "
                        "master busy (its capacity, beside one client's call-after-call "
                        "rate; default: 2; 1: only the one client)")
    b.add_argument("--no-master-bench", action="store_true", help="skip the master figures")
    b.add_argument("--no-redis", action="store_true", help="skip the Redis baseline")
    b.add_argument("--metrics", action="store_true",
                   help="run the local cluster's master and node with --metrics-port (to "
                        "measure what metrics cost: compare with a run without)")
    b.add_argument("--data-tls", action="store_true",
                   help="the local cluster's node serves its tcp data port over TLS "
                        "(store-node --data-tls: to measure what it costs, compare with a run "
                        "without)")
    b.add_argument("--insecure", action="store_true",
                   help="run the local cluster without credentials (plain text; to measure "
                        "what security costs: compare with a run without)")
    b.add_argument("--compare-insecure", action="store_true",
                   help="kvpool's figures on a secure and a plain local cluster in the same "
                        "run, a workload on each in turn: every data-path ratio both ways, "
                        "and secure/plain against the 10%% bound (security's cost)")
    b.add_argument("--cluster-pairs", type=count_type, default=2, metavar="N",
                   help="with --compare-insecure: time each system on N clusters, a secure "
                        "and a plain one started together N times, each kind first in turn; "
                        "each figure the median of the N clusters' (default: 2). Two identical "
                        "clusters can differ by 30%% here for as long as they run (README, "
                        "Benchmark): more pairs take that out")
    b.add_argument("--disk-tier", action="store_true",
                   help="instead: the disk tier's demotion and read GB/s beside a plain "
                        "sequential file read of the same bytes (tools/bench_disk.py)")
    b.add_argument("--disk-bytes", type=size_type, default=256 << 20, metavar="SIZE",
                   help="with --disk-tier: bytes put, about half of them demoted (default: "
                        "256MiB)")
    b.add_argument("--compat", action="store_true",
                   help="instead: the Mooncake-API compat layer's batch_put_from / "
                        "batch_get_into beside kvpool's native batch calls and Mooncake's own "
                        "client, on shm and tcp (tools/bench_compat.py; target: within 10%%)")
    b.add_argument("--peers", default="", metavar="LIST",
                   help="more systems to compare, where installed: 'mooncake' = Mooncake Store "
                        "over its tcp transport (a master and a segment holder started here) "
                        "and over its same-host path (beside shm); its single calls take "
                        "turns with kvpool's (pip install mooncake-transfer-engine-non-cuda)")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print the table; 0 on success."""
    if args.disk_tier:
        from kvpool.tools.bench_disk import run_disk_bench
        result = run_disk_bench(args.disk_bytes, (args.block_size or [2 << 20])[0],
                                args.repeats or 3, json_path=args.json)
        return 0 if result["bytes_identical"] else 1
    if args.compat:
        from kvpool.tools.bench_compat import run_compat_bench
        return run_compat_bench(master=args.master, repeats=args.repeats or 9,
                                transports=tuple(t for t in args.transports.split(",")
                                                 if t.strip() in ("shm", "tcp")),
                                json_path=args.json)
    if args.compare_insecure and (args.master or args.insecure):
        print("kvpool bench: error: --compare-insecure starts its own secure and plain "
              "clusters: not with --master or --insecure", file=sys.stderr)
        return 2
    if args.data_tls and (args.master or args.insecure):
        print("kvpool bench: error: --data-tls starts a secure local cluster whose node serves "
              "TLS: not with --master or --insecure", file=sys.stderr)
        return 2
    from kvpool.tools.bench_run import BenchConfig, run_bench
    preset = QUICK if args.quick else FULL
    block = (args.block_size or [2 << 20])[0]
    small = (args.small_size or [64 << 10])[0]
    config = BenchConfig(
        quick=args.quick,
        transports=tuple(t.strip() for t in args.transports.split(",") if t.strip()),
        sizes=tuple(args.sizes or _sizes(DEFAULT_SIZES)),
        prompt_blocks=args.prompt_blocks, block_bytes=block,
        small_blocks=args.small_blocks, small_bytes=small,
        repeats=args.repeats or preset["repeats"],
        single_calls=args.single_calls or preset["single_calls"],
        master_objects=0 if args.no_master_bench else
        (args.master_objects or preset["master_objects"]),
        master_batch=args.master_batch, master_lookups=preset["master_lookups"],
        master_clients=args.master_clients,
        redis=not args.no_redis,
        peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
        metrics=args.metrics, insecure=args.insecure, compare_insecure=args.compare_insecure,
        data_tls=args.data_tls,
        cluster_pairs=args.cluster_pairs)
    bad = set(config.transports) - {"shm", "tcp", "rdma"}
    if bad:
        print(f"kvpool bench: error: unknown transport(s) {sorted(bad)}; known: shm, tcp, rdma",
              file=sys.stderr)
        return 2
    return run_bench(config, master=args.master, json_path=args.json, plots_dir=args.plots)
