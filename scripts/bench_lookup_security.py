"""What security costs a lookup: GetReplicas of one key over the master's lookup port (frames
sealed under a session, as a secure cluster serves it, against plain frames) and over gRPC
(mutual TLS against plain), on two local clusters measured in interleaved rounds so that a busy
host slows both alike. Prints the p50 and p99 of each, in microseconds, and the ratios.

    python3 scripts/bench_lookup_security.py [--rounds 5] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvpool.client import KVClient
from kvpool.net import lookup_port
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.rpc.master_client import MasterClient
from kvpool.tools.cluster import LocalCluster


def _timed(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    clusters = {"secure": LocalCluster(nodes=1, segment_size="64MiB"),
                "plain": LocalCluster(nodes=1, segment_size="64MiB", secure=False)}
    samples: dict[str, list[float]] = {}
    try:
        clients = {}
        for name, c in clusters.items():
            c.start()
            with KVClient(c.master) as kv:
                kv.put("probe", b"x" * 4096)
            clients[name] = MasterClient(c.master)
            clients[name].locate(["probe"])   # learns the lookup port
            assert clients[name]._lookups.channel is not None, name
        request = pb.KeysRequest(keys=["probe"])
        for _ in range(args.rounds):
            for name, mc in clients.items():
                channel = mc._lookups.channel
                port = _timed(lambda ch=channel: ch.call(lookup_port.GET_REPLICAS, request,
                                                         pb.GetReplicasResponse), args.calls)
                grpc_ = _timed(lambda m=mc: m._call("GetReplicas", request), args.calls // 4)
                samples.setdefault(f"{name} lookup port", []).extend(port)
                samples.setdefault(f"{name} gRPC", []).extend(grpc_)
        for mc in clients.values():
            mc.close()
    finally:
        for c in clusters.values():
            c.stop()
    p50 = {}
    for name, xs in samples.items():
        xs.sort()
        p50[name] = statistics.median(xs) * 1e6
        print(f"{name:>20}: p50 {p50[name]:7.1f} us  p99 {xs[int(len(xs) * 0.99)] * 1e6:7.1f} us"
              f"  ({len(xs)} calls)")
    for via in ("lookup port", "gRPC"):
        s, q = p50[f"secure {via}"], p50[f"plain {via}"]
        print(f"{via}: secure/plain p50 {s / q:.2f}, plain/secure {q / s:.2f}")


if __name__ == "__main__":
    main()
