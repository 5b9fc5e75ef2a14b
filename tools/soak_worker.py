"""One ``kvpool soak`` client process: put / get / remove at random until a deadline, checking
every byte it reads against the bytes its key implies, and recording what it knows.

Values are derived from (seed, key, size), so any process can tell the expected bytes of any
key without a copy. What the worker writes at the end (JSON) is what the auditor needs:

- ``live``: keys whose put committed and that this worker did not see gone since, each with
  the time its put started and the replicas (node id, tcp endpoint) the master gave it;
- ``missing``: committed keys a later get or remove found absent (evicted, or lost), with
  their put records;
- ``removed``: keys whose remove succeeded (they must never come back), with when the remove
  returned; a key whose remove
  failed (unknown outcome) is checked no more;
- ``attempted``: every key a put was tried for (the cluster must hold no other object).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass

import numpy as np
from kvpool.client.kv_client import KVClient
from kvpool.client.transport.tcp import TCPTransport
from kvpool.common.errors import KVPoolError, NoSpace, ObjectNotFound
from kvpool.rpc.master_client import MasterClient

# Counters shared with the launcher (a multiprocessing Array, N_COUNTERS per worker), read for
# the progress lines while the run goes on.
OPS, BYTES, WRONG, ERRORS = range(4)
N_COUNTERS = 4
# Gets and removes pick among this many most recent live keys: older ones are mostly evicted.
RECENT = 256


def expected_value(seed: int, key: str, size: int) -> bytes:
    """The bytes stored under ``key`` in a soak with ``seed``: pseudo-random, key-specific."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little"))).bytes(size)


def wrong_bytes(got: bytes, want: bytes) -> int:
    """How many bytes of ``got`` differ from ``want`` (a length difference counts in full)."""
    n = min(len(got), len(want))
    a, b = np.frombuffer(got, np.uint8, n), np.frombuffer(want, np.uint8, n)
    diff = int(np.count_nonzero(a != b))
    return diff + abs(len(got) - len(want))


def key_size(seed: int, key: str, min_size: int, max_size: int) -> int:
    """The value size of ``key`` (also derived, so the auditor needs no record of it)."""
    digest = hashlib.blake2b(f"size:{seed}:{key}".encode(), digest_size=8).digest()
    return min_size + int.from_bytes(digest, "little") % (max_size - min_size + 1)


@dataclass
class WorkerConfig:
    worker: int
    master: str
    seed: int
    duration_s: float
    max_replicas: int
    min_size: int
    max_size: int
    out_path: str
    op_timeout_s: float = 5.0
    tcp_only: bool = False


class _Recent:
    """The live keys with O(1) add, remove and a random pick among the most recent."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.pos: dict[str, int] = {}

    def add(self, key: str) -> None:
        self.pos[key] = len(self.keys)
        self.keys.append(key)

    def discard(self, key: str) -> None:
        i = self.pos.pop(key, None)
        if i is None:
            return
        last = self.keys.pop()
        if i < len(self.keys):
            self.keys[i], self.pos[last] = last, i

    def pick(self, rng: random.Random) -> str | None:
        if not self.keys:
            return None
        return self.keys[max(0, len(self.keys) - 1 - rng.randrange(RECENT))]


def run_worker(cfg: WorkerConfig, counters) -> None:
    """The process body: loop until the deadline, then write the record to ``cfg.out_path``."""
    rng = random.Random(cfg.seed * 1000 + cfg.worker)
    base = cfg.worker * N_COUNTERS
    transports = [TCPTransport(timeout_s=cfg.op_timeout_s)] if cfg.tcp_only else None
    kv = KVClient(cfg.master, transports=transports, timeout_s=cfg.op_timeout_s)
    master = MasterClient(cfg.master, timeout_s=cfg.op_timeout_s)
    live: dict[str, dict] = {}
    recent = _Recent()
    missing: dict[str, dict] = {}
    removed: dict[str, float] = {}
    attempted: list[str] = []
    counts = {"put": 0, "put_nospace": 0, "put_failed": 0, "get": 0, "get_hit": 0,
              "get_miss": 0, "get_failed": 0, "remove": 0, "remove_failed": 0,
              "bytes_written": 0, "bytes_read": 0, "wrong_bytes": 0}
    n = 0
    deadline = time.monotonic() + cfg.duration_s
    try:
        while time.monotonic() < deadline:
            roll = rng.random()
            if roll < 0.45 or not recent.keys:
                key = f"w{cfg.worker}-{n}"
                n += 1
                _put(kv, master, cfg, rng, key, live, recent, attempted, counts)
            elif roll < 0.9:
                key = recent.pick(rng)
                _get(kv, cfg, rng, key, live, recent, missing, counts)
            else:
                key = recent.pick(rng)
                _remove(kv, key, live, recent, missing, removed, counts)
            counters[base + OPS] += 1
            counters[base + BYTES] = counts["bytes_written"] + counts["bytes_read"]
            counters[base + WRONG] = counts["wrong_bytes"]
            counters[base + ERRORS] = (counts["put_failed"] + counts["get_failed"]
                                       + counts["remove_failed"])
    finally:
        kv.close()
        master.close()
    with open(cfg.out_path, "w") as f:
        json.dump({"worker": cfg.worker, "counts": counts, "live": live, "missing": missing,
                   "removed": removed, "attempted": attempted}, f)


def _put(kv: KVClient, master: MasterClient, cfg: WorkerConfig, rng: random.Random, key: str,
         live: dict, recent: _Recent, attempted: list, counts: dict) -> None:
    size = key_size(cfg.seed, key, cfg.min_size, cfg.max_size)
    replicas = rng.randint(1, cfg.max_replicas)
    value = expected_value(cfg.seed, key, size)
    attempted.append(key)
    started = time.monotonic()
    try:
        kv.put(key, value, replicas=replicas)
    except NoSpace:
        counts["put_nospace"] += 1   # back-pressure: allowed, and nothing is stored
        return
    except KVPoolError:
        counts["put_failed"] += 1    # e.g. a replica's node died mid-write: not committed
        return
    counts["put"] += 1
    counts["bytes_written"] += size * replicas
    # Where the master put it, as node incarnations: a restarted node has a new tcp endpoint.
    where: list[list[str]] = []
    try:
        found = master.locate([key]).views()
        if not isinstance(found[0], KVPoolError):
            where = [[r.node.node_id, r.node.tcp_endpoint] for r in found[0].replicas]
    except KVPoolError:
        pass
    live[key] = {"t0": started, "size": size, "replicas": where}
    recent.add(key)


def _get(kv: KVClient, cfg: WorkerConfig, rng: random.Random, key: str, live: dict,
         recent: _Recent, missing: dict, counts: dict) -> None:
    counts["get"] += 1
    try:
        got = kv.get(key, verify=rng.random() < 0.5)
    except ObjectNotFound:
        counts["get_miss"] += 1
        _gone(key, live, recent, missing)
        return
    except KVPoolError:
        counts["get_failed"] += 1   # no replica reachable right now; never wrong bytes
        return
    counts["get_hit"] += 1
    counts["bytes_read"] += len(got)
    counts["wrong_bytes"] += wrong_bytes(got, expected_value(cfg.seed, key, live[key]["size"]))


def _gone(key: str, live: dict, recent: _Recent, missing: dict,
          asked_at: float | None = None) -> None:
    """A committed key found absent: its put record moves to ``missing`` for the auditor,
    with when the remove that found it absent was called (``asked_at``; a get's is now)."""
    recent.discard(key)
    record = live.pop(key, None)
    if record is not None:
        now = time.monotonic()
        missing[key] = {**record, "asked_at": now if asked_at is None else asked_at,
                        "missing_at": now}


def _remove(kv: KVClient, key: str, live: dict, recent: _Recent, missing: dict,
            removed: dict, counts: dict) -> None:
    asked_at = time.monotonic()
    try:
        kv.remove(key)
    except ObjectNotFound:
        # Also the answer to a remove that a master killed mid-call had carried out: the
        # client retries on the restarted master, which finds the key gone (the auditor
        # tells the two apart by the kill times).
        _gone(key, live, recent, missing, asked_at)
        return
    except KVPoolError:
        counts["remove_failed"] += 1   # unknown outcome: the key is no longer checked
        recent.discard(key)
        live.pop(key, None)
        return
    counts["remove"] += 1
    recent.discard(key)
    live.pop(key, None)
    removed[key] = time.monotonic()
