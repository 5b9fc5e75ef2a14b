"""How far two local clusters' single calls differ, and what each process is preempted per
call: the measurement behind `kvpool bench --cluster-pairs` and README "Security's cost".

Starts ``--pairs`` pairs of one-node clusters (A and B: both plain, both secure, or A secure
and B plain with ``--secure-vs-plain``), times single puts and gets of each size on both as
`kvpool bench --compare-insecure` does (a client process per cluster, calls in turns), and
prints A/B per pair (pairs start A and B first in turn); with ``--pin-servers`` each
cluster's master and node run on the last CPU (`sched_setaffinity`), clients anywhere.
Then, per process kind, the nonvoluntary context switches per call
(``/proc/<pid>/status``): on a small machine the client, the master and the node all poll
for their next message, and preempt each other.

    python3 scripts/cluster_spread.py [--transport shm|tcp] [--pairs 3] [--secure-vs-plain]
                                      [--pin-servers] [--sizes 64KiB,1MiB] [--calls 100]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile

from kvpool.tools import bench_kvpool as w
from kvpool.tools.argtypes import count_type, size_type
from kvpool.tools.cluster import LocalCluster


def _switches(pid: int) -> int:
    """Nonvoluntary context switches of every thread of ``pid`` so far."""
    total = 0
    for status in glob.glob(f"/proc/{pid}/task/*/status"):
        try:
            with open(status) as f:
                total += sum(int(line.split()[1]) for line in f
                             if line.startswith("nonvoluntary_ctxt_switches"))
        except OSError:   # a thread that ended meanwhile
            pass
    return total


def _pin(pid: int, cpus: set[int]) -> None:
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            os.sched_setaffinity(int(task.rsplit("/", 1)[1]), cpus)
        except OSError:
            pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    p.add_argument("--pairs", type=count_type, default=3)
    p.add_argument("--secure-vs-plain", action="store_true",
                   help="A secure, B plain (default: both plain)")
    p.add_argument("--secure", action="store_true", help="both secure")
    p.add_argument("--pin-servers", action="store_true",
                   help="each cluster's master and node on the last CPU")
    p.add_argument("--sizes", default="64KiB,1MiB",
                   help="single-value sizes, comma-separated (default: 64KiB,1MiB)")
    p.add_argument("--calls", type=count_type, default=100, help="calls per repeat (100)")
    args = p.parse_args()
    sizes = [size_type(s) for s in args.sizes.split(",") if s.strip()]
    secure = {"A": args.secure or args.secure_vs_plain, "B": args.secure}
    last_cpu = {max(os.sched_getaffinity(0))}
    switches: dict[str, list[float]] = {}
    for pair in range(args.pairs):
        with tempfile.TemporaryDirectory(prefix="kvpool-spread-") as logs:
            clusters = {s: LocalCluster(nodes=1, segment_size="1GiB", log_dir=f"{logs}/{s}",
                                        secure=secure[s]) for s in ("A", "B")}
            clients = {}
            try:
                # The cluster started first ran slower in session 26's runs: each pair starts
                # the other one first, and says which.
                first = "AB"[pair % 2]
                for s in sorted(clusters, key=lambda s: s != first):
                    clusters[s].start()
                servers = {s: [c.master_proc.popen.pid] + [n.popen.pid for n in c.nodes]
                           for s, c in clusters.items()}
                if args.pin_servers:
                    for pids in servers.values():
                        for pid in pids:
                            _pin(pid, last_cpu)
                for s, c in clusters.items():
                    clients[s] = w.connect(c.master, args.transport, spawned=True)
                    if not clients[s].reachable("probe"):
                        print(f"cluster {s}: no node reachable over {args.transport}",
                              file=sys.stderr)
                        return 1
                    clients[s].prefaulted(60.0)
                kinds = {"client": [cl._proc.pid for cl in clients.values()],
                         "master": [pids[0] for pids in servers.values()],
                         "node": [pid for pids in servers.values() for pid in pids[1:]]}
                before = {k: sum(map(_switches, pids)) for k, pids in kinds.items()}
                out, calls = [], 0
                for i, size in enumerate(sizes):
                    shape = w.Shape("single", size, 1, args.calls)
                    figures = {(f.system, f.op): f for f in w.kvpool_figures(
                        clients, shape, 3, w.random_rows(1, size, seed=i),
                        f"spread-{pair}-{size}")}
                    calls += 2 * 2 * 3 * args.calls   # put and get, on both, 3 repeats
                    for op in ("put", "get"):
                        a, b = figures[("A", op)].p50_ms, figures[("B", op)].p50_ms
                        out.append(f"{op} {size >> 10} KiB {a:.3f} / {b:.3f} = {a / b:.2f}")
                for k, pids in kinds.items():
                    switches.setdefault(k, []).append(
                        (sum(map(_switches, pids)) - before[k]) / calls)
                print(f"pair {pair + 1} ({first} started first): A / B p50 ms: "
                      + " | ".join(out), flush=True)
            finally:
                for cl in clients.values():
                    cl.close()
                for c in clusters.values():
                    c.stop()
    print("nonvoluntary switches per call, per process (median of the pairs): " + ", ".join(
        f"{k} {statistics.median(v):.2f}" for k, v in switches.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
