"""What a columnar object index would cost per batched lookup, beside the dict the master
keeps today: the measurement behind issue 19's next step for 300k lookups/s (DESIGN.md, "The
master's memory per object").

The master's index is a dict of ``ObjectEntry`` objects, and a 256-key GetReplicas walks it key
by key: each key is a chain of dependent cache and TLB misses (the dict's slot, its entry, the
stored key's characters, the object) that the interpreter cannot overlap. A columnar index
keeps an open-addressing table of key fingerprints and the objects' fields in numpy arrays, so
a batch is a few gathers whose misses the CPU overlaps. This probe builds both over the same
keys (64 hex characters, as engines use) and times a batch either way: the dict with the
fields read as ``locate_columns`` reads them, the columns with the same fields gathered, an
access stamp and a lease written.

    python3 scripts/columnar_lookup_probe.py [--objects 1000000] [--batch 256] [--calls 400]

The columns verify a hit by a second, salted fingerprint (two 64-bit SipHash values under
this process's secret), not by the key's characters; a real index would have to say why that
is enough, or compare the keys too.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np
from kvpool.master.index import ObjectEntry

_SALT = os.urandom(8).hex()


def _fingerprints(keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    first = np.fromiter(map(hash, keys), np.int64, len(keys))
    first[first == 0] = 1   # 0 marks an empty slot
    second = np.fromiter((hash(_SALT + k) for k in keys), np.int64, len(keys))
    return first, second


class ColumnarIndex:
    """Rows of fields, and a table (linear probing) from fingerprint to row."""

    def __init__(self, keys: list[str]) -> None:
        n = len(keys)
        self.mask = (1 << max(4, (2 * n - 1).bit_length())) - 1
        self.slot_fp = np.zeros(self.mask + 1, np.int64)
        self.slot_row = np.zeros(self.mask + 1, np.int32)
        self.fp, self.fp2 = _fingerprints(keys)
        for row, h in enumerate(self.fp.tolist()):   # once, at build: no need to be fast
            s = h & self.mask
            while self.slot_fp[s]:
                s = (s + 1) & self.mask
            self.slot_fp[s], self.slot_row[s] = h, row
        self.size = np.full(n, 2 << 20, np.int64)
        self.version = np.arange(n, dtype=np.int64)
        self.segment = np.zeros(n, np.int32)
        self.offset = np.arange(n, dtype=np.int64) * 4096
        self.seal = np.arange(n, dtype=np.int64)
        self.stamp = np.zeros(n, np.int64)
        self.lease_end = np.zeros(n, np.float64)

    def rows(self, keys: list[str]) -> np.ndarray:
        """Each key's row, -1 where it is not indexed."""
        fp, fp2 = _fingerprints(keys)
        out = np.full(len(keys), -1, np.int64)
        todo = np.arange(len(keys))
        slot = fp & self.mask
        while len(todo):
            s = slot[todo]
            stored = self.slot_fp[s]
            row = self.slot_row[s]
            hit = (stored == fp[todo]) & (self.fp2[row] == fp2[todo])
            out[todo[hit]] = row[hit]
            todo = todo[~hit & (stored != 0)]   # a collision: probe on
            slot[todo] = (slot[todo] + 1) & self.mask
        return out

    def locate(self, keys: list[str], stamp: int, lease_end: float) -> list[list]:
        rows = self.rows(keys)
        if (rows < 0).any():
            raise SystemExit("a key indexed was not found")
        self.stamp[rows] = stamp
        self.lease_end[rows] = np.maximum(self.lease_end[rows], lease_end)
        return [c[rows].tolist() for c in (self.size, self.version, self.segment,
                                            self.offset, self.seal)]


def _dict_locate(index: dict[str, ObjectEntry], keys: list[str]) -> list[list]:
    found = list(map(index.get, keys))
    return [[o.size for o in found], [o.version for o in found],
            [o.segment_id for o in found], [o.offset for o in found],
            [o.seal for o in found]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    keys = [os.urandom(32).hex() for _ in range(args.objects)]
    print(f"indexing {args.objects:,} keys both ways ...", flush=True)
    index = {k: ObjectEntry(k, 2 << 20, i, "node0/0", i * 4096, i) for i, k in enumerate(keys)}
    columns = ColumnarIndex(keys)
    rng = random.Random(0)
    for r in range(args.rounds):
        # Fresh strs, as a request decodes them (their hashes not cached yet).
        batches = [[(k + " ")[:-1] for k in rng.sample(keys, args.batch)]
                   for _ in range(args.calls)]
        t0 = time.perf_counter()
        for b in batches:
            _dict_locate(index, b)
        dict_ms = (time.perf_counter() - t0) / args.calls * 1e3
        batches = [[(k + " ")[:-1] for k in rng.sample(keys, args.batch)]
                   for _ in range(args.calls)]
        t0 = time.perf_counter()
        for b in batches:
            columns.locate(b, r, time.time() + 5)
        col_ms = (time.perf_counter() - t0) / args.calls * 1e3
        print(f"round {r + 1}: {args.batch} keys a call: dict {dict_ms:.3f} ms, "
              f"columns {col_ms:.3f} ms ({dict_ms / col_ms:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
