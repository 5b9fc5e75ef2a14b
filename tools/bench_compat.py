"""``kvpool bench --compat``: the Mooncake-API compat layer (kvpool.compat.mooncake) beside
kvpool's native batch calls on the same workload, and beside Mooncake Store's own client.

On one local cluster (a master and one store node, in other processes than this client), per
transport (shm, tcp) and per shape (a prompt batch of large blocks, a batch of small ones):

- native: ``KVClient.batch_put(keys, rows)`` / ``batch_get_into(keys, rows)`` of a 2-D array;
- compat: ``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` of the same rows by
  address (as SGLang's and LMCache's Mooncake backends call them);
- mooncake: Mooncake Store's client, the same calls, over its tcp transport
  (tools/bench_mooncake.py's peer), where it is installed.

The systems take turns within every repeat (native, compat, mooncake, then again), so a noisy
neighbour slows them alike; each figure is the median over the repeats, fresh keys each time,
checked byte for byte once. The ratios are medians of per-repeat ratios (calls made back to
back). Target: compat within 10% of native (``compat_vs_native`` >= 0.9).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from kvpool.client import KVClient
from kvpool.compat.mooncake import MooncakeDistributedStore
from kvpool.tools.cluster import LocalCluster

TARGET = 0.9   # compat's throughput over native's
_SETTLE_S = 3.0   # twice the bench cluster's lease and quarantine


@dataclass(frozen=True)
class Shape:
    name: str
    blocks: int
    block_bytes: int

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes


SHAPES = (Shape("prompt", 64, 1 << 20), Shape("small", 512, 16 << 10))


def _median_gbps(samples: list[float], nbytes: int) -> float:
    return nbytes / statistics.median(samples) / 1e9


def _timed(call: Callable[[], list], what: str) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds of one call (the client's own work: what a
    layer over the client adds shows there, above the noise of other processes)."""
    started, cpu = time.perf_counter(), time.process_time()
    results = call()
    took, cpu_took = time.perf_counter() - started, time.process_time() - cpu
    bad = [r for r in results if r is not None and not (type(r) is int and r >= 0)]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} keys failed, e.g. {bad[0]!r}")
    return took, cpu_took


def _rows(array: np.ndarray) -> list[int]:
    return [array.ctypes.data + i * array.shape[1] for i in range(array.shape[0])]


def bench_shape(master: str, transport: str, shape: Shape, repeats: int, peer=None) -> dict:
    """Put and get GB/s of native, compat (and the Mooncake peer's, over its tcp) for one
    transport and shape."""
    src = np.random.default_rng(7).integers(0, 256, (shape.blocks, shape.block_bytes),
                                            dtype=np.uint8)
    dst = {name: np.zeros_like(src) for name in ("native", "compat", "mooncake")}
    sizes = [shape.block_bytes] * shape.blocks
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    with KVClient(master, transports=[transport]) as kv:
        store = MooncakeDistributedStore(transports=[transport])
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master) != 0:
            raise RuntimeError(f"the compat store could not set up on {master}")
        try:
            store.register_buffer(src.ctypes.data, src.nbytes)
            store.register_buffer(dst["compat"].ctypes.data, src.nbytes)
            if peer is not None:
                peer.register(src)
                peer.register(dst["mooncake"])
            src_ptrs, dst_ptrs = _rows(src), _rows(dst["compat"])
            for r in range(repeats):
                keys = {n: [f"{n}-{transport}-{shape.name}-{r}-{i}" for i in range(shape.blocks)]
                        for n in dst}
                rounds = [
                    ("native", lambda k=keys["native"]: kv.batch_put(k, src),
                     lambda k=keys["native"]: kv.batch_get_into(k, dst["native"]),
                     lambda k=keys["native"]: kv.batch_remove(k)),
                    ("compat", lambda k=keys["compat"]: store.batch_put_from(k, src_ptrs, sizes),
                     lambda k=keys["compat"]: store.batch_get_into(k, dst_ptrs, sizes),
                     lambda k=keys["compat"]: store.batch_remove(k))]
                if peer is not None:
                    rounds.append(("mooncake", lambda k=keys["mooncake"]: peer.put(k, src),
                                   lambda k=keys["mooncake"]: peer.get(k, dst["mooncake"]),
                                   lambda k=keys["mooncake"]: peer.delete(k)))
                if r % 2:   # alternate who goes first
                    rounds.reverse()
                for name, put, get, remove in rounds:
                    for op, call in (("put", put), ("get", get)):
                        wall, used = _timed(call, f"{name} {op}")
                        times.setdefault(f"{name} {op}", []).append(wall)
                        cpu.setdefault(f"{name} {op}", []).append(used)
                    if r == 0 and not np.array_equal(dst[name], src):
                        raise RuntimeError(f"{name}: the bytes read back differ")
                    remove()
        finally:
            if peer is not None:
                peer.unregister_all()
            store.close()
    gbps = {k: _median_gbps(v, shape.nbytes) for k, v in times.items()}
    return {"transport": transport, "shape": shape.name, "blocks": shape.blocks,
            "block_bytes": shape.block_bytes, "gbps": gbps, "seconds": times,
            "client_cpu_seconds": cpu,
            "compat_vs_native": {op: _paired(times, "compat", "native", op)
                                 for op in ("put", "get")},
            "client_cpu_compat_over_native": {op: 1 / _paired(cpu, "compat", "native", op)
                                              for op in ("put", "get")},
            "compat_vs_mooncake": {op: _paired(times, "compat", "mooncake", op)
                                   for op in ("put", "get")} if peer is not None else None}


def _paired(times: dict[str, list[float]], a: str, b: str, op: str) -> float:
    """``a``'s throughput over ``b``'s: the median of the ratios of calls made back to back in
    one repeat (on a busy host, a ratio of medians mixes calls from different moments)."""
    return statistics.median(tb / ta for ta, tb in zip(times[f"{a} {op}"], times[f"{b} {op}"]))


def run_compat_bench(*, master: str | None = None, repeats: int = 9,
                     transports: tuple[str, ...] = ("shm", "tcp"), mooncake: bool = True,
                     json_path: str | None = None, shapes: tuple[Shape, ...] = SHAPES) -> int:
    """Run, print the table, write ``json_path``; 0 when compat is within 10% of native."""
    from kvpool.tools.bench_peers import PeerUnavailable
    biggest = max(s.nbytes for s in shapes)
    results, skipped = [], {}
    peer = None
    cluster = None
    try:
        if mooncake:
            from kvpool.tools.bench_mooncake import MooncakePeer
            try:   # started before any gRPC channel of ours exists (it spawns processes)
                # (Mooncake's smallest segment is 16 MiB.)
                peer = MooncakePeer(max(16 << 20, (repeats + 2) * biggest)).__enter__()
            except PeerUnavailable as e:
                skipped["mooncake"] = str(e)
        if master is None:
            # A removed object's space is reused once its readers' leases and its quarantine
            # are over: room for every repeat's batches of one shape, and short leases and
            # quarantine so that the next shape finds it free again.
            cluster = LocalCluster(nodes=1, segment_size=str((2 * repeats + 2) * biggest),
                                   master_args=["--quarantine", f"{_SETTLE_S / 2}s",
                                                "--lease-ttl", f"{_SETTLE_S / 2}s"])
            master = cluster.start()
        for transport in transports:
            for shape in shapes:
                if results:
                    time.sleep(_SETTLE_S)
                results.append(bench_shape(master, transport, shape, repeats,
                                           peer if transport == "tcp" else None))
    finally:
        if cluster is not None:
            cluster.stop()
        if peer is not None:
            peer.close()
    ok = all(min(r["compat_vs_native"].values()) >= TARGET for r in results)
    _print(results, skipped, ok)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"target_compat_vs_native": TARGET, "met": ok, "repeats": repeats,
                       "results": results, "skipped": skipped}, f, indent=2)
    return 0 if ok else 1


def _print(results: list[dict], skipped: dict, ok: bool) -> None:
    print(f"{'transport':<9} {'shape':<16} {'op':<4} {'native':>8} {'compat':>8} "
          f"{'mooncake':>9} {'compat/native':>14} {'compat/mooncake':>16} {'client CPU':>11}")
    print(f"{'':<31}(median GB/s)             (median of paired throughput ratios)"
          "   (compat/native)")
    for r in results:
        shape = f"{r['shape']} {r['blocks']}x{r['block_bytes'] >> 10}KiB"
        for op in ("put", "get"):
            g = r["gbps"]
            mc = g.get(f"mooncake {op}")
            vs_mc = r["compat_vs_mooncake"][op] if r["compat_vs_mooncake"] else None
            print(f"{r['transport']:<9} {shape:<16} {op:<4} {g[f'native {op}']:>8.2f} "
                  f"{g[f'compat {op}']:>8.2f} {'-' if mc is None else f'{mc:.2f}':>9} "
                  f"{r['compat_vs_native'][op]:>14.2f} "
                  f"{'-' if vs_mc is None else f'{vs_mc:.2f}':>16} "
                  f"{r['client_cpu_compat_over_native'][op]:>11.2f}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    print(f"compat within 10% of native on every line: {'yes' if ok else 'NO'}")
