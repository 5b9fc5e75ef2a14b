"""Where a single put's (and get's) time goes: one local cluster (one node), one client, values
of one size put one at a time, each phase of the client's put timed on the way (PutStart, the
node's RESERVE, the copy, SEAL with PutEnd overlapped inside it, PutEnd alone), then of its
get (with no master call unless --no-local-reads: over shm a read from the node's shm index,
over tcp a READ_HELD at the place the put's PutStart named; else GetReplicas, the node's READ:
each key read once, so each lookup opens a lease), the master's
own time per call (its /metrics), so that what is left of a phase is wire, wake-ups and the
other end's framing; and the CPU each process spent per call (on two cores a single put keeps
them all busy). Secure (mutual TLS, grants) unless --insecure.

    python3 scripts/put_phases.py [--transport shm|tcp] [--size 64KiB] [--calls 1000]
                                  [--batch N] [--insecure] [--no-slots] [--no-local-reads]

--batch N times batch_put and batch_get_into of N values (the rows of one array) per call
instead: a batch of more than 4 keys is not sealed, so its phases are PutStart (answered once
the node applied the reservations), the copy, PutEnd (once the node applied the commits).

The phases are timed by wrapping the client's own methods (a diagnostic, not the bench: each
wrapper adds ~1 us). Single puts fill slots reserved ahead (client/slots.py) unless
--no-slots: the slot helper's PutStart and RESERVE calls are listed apart, as they are outside
any put; `kvpool bench` gives the figures the targets are measured by.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import threading
import time
import urllib.request

import numpy as np

from kvpool.client import KVClient
from kvpool.tools.argtypes import count_type, size_type
from kvpool.tools.cluster import LocalCluster


HELPER = " [slot helper, ahead of puts]"
LOCAL = "read from the node's shm index (no master call)"
HELD = "READ_HELD where the put was (node round trip, no master call)"
HITS = " [hits, background]"


def _wrap(cls_or_obj, name: str, label, times: dict[str, list[float]]) -> None:
    """Time every call of ``name`` under ``label(args, kwargs)`` (a name, or a function of the
    call's arguments)."""
    f = getattr(cls_or_obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            what = label(args, kwargs) if callable(label) else label
            if threading.current_thread().name == "kvpool-slots":
                what += HELPER   # making slots ahead (client/slots.py), outside any put
            elif threading.current_thread().name == "kvpool-local-hits":
                what += HITS     # local reads' hits told to the master, outside any get
            times[what].append(time.perf_counter() - t)
    setattr(cls_or_obj, name, timed)


def _master_means(address: str) -> dict[str, float]:
    """Mean seconds the master spent per call, by method (kvpool_master_rpc_seconds)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    parts: dict[str, dict[str, float]] = {}
    for m in re.finditer(r'^kvpool_master_rpc_seconds_(sum|count)\{method="(\w+)"\} (\S+)$',
                         text, re.M):
        parts.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
    return {k: v["sum"] / v["count"] for k, v in parts.items() if v.get("count")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    p.add_argument("--size", type=size_type, default=64 << 10, help="value size (64KiB)")
    p.add_argument("--calls", type=count_type, default=1000, help="puts, then as many gets")
    p.add_argument("--batch", type=count_type, default=1,
                   help="values per call (batch_put, batch_get_into); 1: put and get")
    p.add_argument("--insecure", action="store_true", help="a plain-text cluster")
    p.add_argument("--no-slots", action="store_true",
                   help="every put asks the master first (KVClient put_slots=False)")
    p.add_argument("--no-local-reads", action="store_true",
                   help="every single get asks the master (KVClient local_reads=False)")
    args = p.parse_args()
    times: dict[str, list[float]] = collections.defaultdict(list)
    value = os.urandom(args.size)
    segment = max(256 << 20, 2 * args.size * args.batch * args.calls)
    with LocalCluster(nodes=1, segment_size=str(segment),
                      secure=not args.insecure, metrics=True) as cluster, \
            KVClient(cluster.master, transports=[args.transport],
                     put_slots=not args.no_slots, local_reads=not args.no_local_reads) as kv:
        for i in range(min(200, args.calls)):   # warm: connections, mappings
            kv.put(f"warm{i}", value)
        time.sleep(0.5)   # the slots asked for by the warm puts are made
        [transport] = kv._transports
        _wrap(kv._master, "put_start_grant", "PutStart (master round trip)", times)
        _wrap(kv._master, "put_end", "PutEnd (master round trip)", times)
        if args.transport == "shm":
            _wrap(transport, "_records", lambda a, kw: f"{a[0].name} (node round trip"
                  + (", PutEnd overlapped)" if a[0].name == "SEAL" else ")"), times)
            _wrap(transport, "write_summed", "copy + CRC-32C", times)
        else:
            _wrap(transport, "write_sealed", lambda a, kw: (
                "WRITE+SEAL into a slot" if kw.get("reserved") else "RESERVE+WRITE+SEAL")
                + " (node round trip, PutEnd overlapped)", times)
            _wrap(transport, "reserve", "RESERVE (node round trip)", times)
        for name in ("locate_answer", "locate"):   # a single get's, a batch's
            _wrap(kv._master, name, "GetReplicas (master round trip)", times)
        _wrap(transport, "read", "READ (node round trip)", times)
        _wrap(transport, "read_local", LOCAL, times)
        _wrap(transport, "read_held", HELD, times)
        _wrap(transport, "read_at", "READ (node round trip)", times)   # a batch's, in place
        puts, gets = [], []
        pids = {"client": None, "master": cluster.master_proc.popen.pid,
                "node": cluster.nodes[0].popen.pid}
        cpu = [_cpu_s(pids)]   # before the puts, after them, after the gets
        # A batch's values are the rows of one array, as an engine's KV blocks are (a copy
        # per run of adjacent rows, not per value).
        rows = np.frombuffer(os.urandom(args.size * args.batch), np.uint8).reshape(args.batch, -1)
        values, out = list(rows), list(np.zeros_like(rows))
        for i in range(args.calls):
            keys = [f"k{i}.{j}" for j in range(args.batch)]
            t = time.perf_counter()
            errors = kv.batch_put(keys, values) if args.batch > 1 else [kv.put(keys[0], value)]
            puts.append(time.perf_counter() - t)
            if any(errors):
                raise SystemExit(f"put failed: {errors[0]}")
        # Each get reads a committed object: a sealed put's commit reaches its node within
        # PUSH_SOON_S (master/manifest_watch.py), and only then its shm index (the node's
        # work on it counted as the puts').
        time.sleep(0.5)
        cpu.append(_cpu_s(pids))
        for i in range(args.calls):
            keys = [f"k{i}.{j}" for j in range(args.batch)]
            t = time.perf_counter()
            if args.batch > 1:
                kv.batch_get_into(keys, out)
            else:
                kv.get(keys[0])
            gets.append(time.perf_counter() - t)
        cpu.append(_cpu_s(pids))
        master = _master_means(cluster.metrics_addresses["master"])
    ms = 1e3
    print(f"{args.transport}, {'plain' if args.insecure else 'secure'}, "
          f"{'no slots, ' if args.no_slots else ''}"
          f"{args.size} B values, {args.calls} calls (p50, ms)")
    print(f"  put {statistics.median(puts) * ms:.3f}   get {statistics.median(gets) * ms:.3f}")
    for op, labels in (("put", [k for k in times if "GetReplicas" not in k
                                      and not k.startswith("READ") and k != LOCAL]),
                       ("get", [LOCAL, HELD, "GetReplicas (master round trip)",
                                "READ (node round trip)",
                                "GetReplicas (master round trip)" + HITS])):
        print(f"  {op} phases, client side:")
        for label in (label for label in labels if times[label]):
            print(f"    {label:58.58s} {statistics.median(times[label]) * ms:.3f}"
                  f"   ({len(times[label])} calls)")
    print("  CPU per call by process (us; polling for answers included, $KVPOOL_SPIN_US):")
    for op, before, after in (("put", *cpu[:2]), ("get", *cpu[1:])):
        print(f"    {op}: " + ", ".join(
            f"{who} {(after[who] - before[who]) / args.calls * 1e6:.0f}" for who in pids))
    print("  master's own time per call (mean):")
    for method in ("PutStart", "PutEnd", "GetReplicas"):
        if method in master:
            print(f"    {method:58s} {master[method] * ms:.3f}")
    return 0


def _cpu_s(pids: dict[str, int | None]) -> dict[str, float]:
    """CPU seconds (user + system, every thread) each process has used: None is this one."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for who, pid in pids.items():
        if pid is None:
            out[who] = time.process_time()
            continue
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[who] = (int(fields[11]) + int(fields[12])) / tick
    return out


if __name__ == "__main__":
    sys.exit(main())
