"""Run by the RDMA tests as a separate process: ``python rdma_workload.py put MASTER SEED N SIZE``.

Puts N objects of SIZE bytes over rdma only, from one registered arena (zero-copy writes).
Object i holds ``value(seed, i, size)``, so a reader in another process can check every byte.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def value(seed: int, i: int, size: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng([seed, i]).bytes(size), dtype=np.uint8)


def main() -> int:
    from kvpool.client import KVClient
    _, mode, master, seed, n, size = sys.argv
    seed, n, size = int(seed), int(n), int(size)
    assert mode == "put"
    batch = 16
    with KVClient(master=master, transports=["rdma"]) as kv:
        arena = np.empty(batch * size, dtype=np.uint8)
        kv.register_buffer(arena)
        bad = 0
        busy_s = 0.0
        for lo in range(0, n, batch):
            idx = range(lo, min(n, lo + batch))
            slots = [arena[k * size:(k + 1) * size] for k in range(len(idx))]
            for i, slot in zip(idx, slots):
                slot[:] = value(seed, i, size)
            start = time.monotonic()
            results = kv.batch_put([f"rdma-{seed}-{i}" for i in idx], slots)
            busy_s += time.monotonic() - start
            for i, r in zip(idx, results):
                if r is not None:
                    bad += 1
                    print(f"put rdma-{seed}-{i}: {type(r).__name__}: {r}", file=sys.stderr)
    print(f"put ok={n - bad} bad={bad} MiB/s={n * size / (1 << 20) / busy_s:.1f}", flush=True)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
