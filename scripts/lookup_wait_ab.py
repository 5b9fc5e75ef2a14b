"""How a client waits for a batch lookup's answer, A/B in one run (issue 19: 300k lookup
objects/s from one client): a local secure master with ``--objects`` indexed, one client
making 256-key lookups call after call, its waits alternating per block of calls between
napping until the answer is due (net/sockets.py ``Spinner.wait(kind)``, what the lookup port's
calls do) and sleeping on the socket once the spin missed (``Spinner.wait()``, the way before).
Blocks of both in random order, round after round, against the same master and index, so that
a drifting load weighs on both alike. Each call's keys are made from their hashes in the timed
loop, as an engine's (and the bench's) are.

    python3 scripts/lookup_wait_ab.py [--objects 1000000] [--rounds 20] [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from kvpool.rpc import lookup
from kvpool.rpc.master_client import MasterClient
from kvpool.tools.argtypes import count_type
from kvpool.tools.bench_kvpool import virtual_node
from kvpool.tools.cluster import LocalCluster

_BATCH = 256
_SETTLE_CALLS = 20   # untimed at the start of each block: the nap's estimate, the back-off


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=count_type, default=1_000_000,
                   help="objects indexed first")
    p.add_argument("--rounds", type=count_type, default=20,
                   help="rounds of one block of each")
    p.add_argument("--calls", type=count_type, default=200, help="timed calls per block")
    args = p.parse_args()
    napping = lookup._Connection.receive

    def sleeping(conn, kind=None):   # the wait told no kind: spin, back off, sleep
        return napping(conn, None)

    waits = {"nap": napping, "sleep": sleeping}
    rates: dict[str, list[float]] = {name: [] for name in waits}
    with tempfile.TemporaryDirectory() as logs:
        cluster = LocalCluster(nodes=0, log_dir=logs, secure=True)
        address = cluster.start()
        try:
            keys = [os.urandom(32).hex() for _ in range(args.objects)]
            with MasterClient(address, timeout_s=60.0) as mc, \
                    virtual_node(address, args.objects * (2 << 20), True) as keep_alive:
                for i in range(0, args.objects, _BATCH):
                    keep_alive()
                    part = keys[i:i + _BATCH]
                    mc.put_start(part, [2 << 20] * len(part))
                    mc.put_end(part)
                rng = random.Random(0)
                for r in range(args.rounds):
                    for name in rng.sample(list(waits), len(waits)):
                        lookup._Connection.receive = waits[name]
                        # As the bench's: the hashes made afresh, then the keys from them.
                        hashes = [bytes.fromhex(k) for k in
                                  rng.sample(keys, (_SETTLE_CALLS + args.calls) * _BATCH)]
                        calls = [hashes[i:i + _BATCH] for i in range(0, len(hashes), _BATCH)]
                        for batch in calls[:_SETTLE_CALLS]:
                            keep_alive()
                            mc.locate([h.hex() for h in batch])
                        t0 = time.perf_counter()
                        for batch in calls[_SETTLE_CALLS:]:
                            keep_alive()
                            mc.locate([h.hex() for h in batch])
                        rates[name].append(args.calls * _BATCH / (time.perf_counter() - t0))
                    print(f"round {r + 1}: " + ", ".join(
                        f"{n} {rates[n][-1]:,.0f}" for n in waits), flush=True)
        finally:
            lookup._Connection.receive = napping
            cluster.stop()
    nap, sleep = (statistics.median(rates[n]) for n in waits)
    ahead = sum(a > b for a, b in zip(rates["nap"], rates["sleep"]))
    print(f"lookups/s, medians of {args.rounds} blocks of {args.calls} calls: "
          f"nap {nap:,.0f}, sleep {sleep:,.0f} (nap / sleep {nap / sleep:.2f}); "
          f"nap ahead in {ahead} of {args.rounds} rounds")


if __name__ == "__main__":
    main()
