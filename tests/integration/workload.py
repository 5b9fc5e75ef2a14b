"""Run as a separate process by the integration tests: ``python workload.py put|get MASTER ...``.

Object i of a run holds ``value(seed, i)``, so a reader in another process can check every byte
without the writer's help.
"""

from __future__ import annotations

import random
import sys
import time


def value(seed: int, i: int, max_size: int) -> bytes:
    rng = random.Random(seed * 1_000_003 + i)
    return rng.randbytes(rng.randrange(1, max_size + 1))


def main() -> int:
    from kvpool.client import KVClient
    from kvpool.rpc.master_client import MasterClient
    mode, master = sys.argv[1], sys.argv[2]
    if mode == "put-start-and-hang":   # a client that dies between PutStart and PutEnd
        mc = MasterClient(master)
        results, _ = mc.put_start([sys.argv[3]], [int(sys.argv[4])])
        print("started" if isinstance(results[0], tuple) else f"failed {results[0]}", flush=True)
        time.sleep(3600)
        return 0
    seed, n, max_size = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    transports = sys.argv[6].split(",") if len(sys.argv) > 6 else None
    keys = [f"obj-{seed}-{i}" for i in range(n)]
    with KVClient(master=master, transports=transports) as kv:
        bad = 0
        for lo in range(0, n, 50):
            chunk = range(lo, min(n, lo + 50))
            if mode == "put":
                res = kv.batch_put([keys[i] for i in chunk], [value(seed, i, max_size) for i in chunk])
                bad += sum(r is not None for r in res)
                for i, r in zip(chunk, res):
                    if r is not None:
                        print(f"put {keys[i]}: {type(r).__name__}: {r}", file=sys.stderr)
            else:
                got = kv.batch_get([keys[i] for i in chunk])
                for i, g in zip(chunk, got):
                    if g != value(seed, i, max_size):
                        bad += 1
                        print(f"get {keys[i]}: {g if not isinstance(g, bytes) else 'WRONG BYTES'}",
                              file=sys.stderr)
    print(f"{mode} ok={n - bad} bad={bad}", flush=True)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
