"""One step's layer-by-layer load and save for the vLLM connector (key scheme ``vllm2``: one
object per block and TP rank, its layers one after another, ``kvpool.client.partial``).

A :class:`LoadJob` runs on the connector's load thread from ``start_load_kv``: one GetReplicas
for every block, then layer by layer (in the object's layer order) a ranged read of that
layer's slice of every object into a staging buffer and a copy into the paged cache;
``wait_for_layer_load(layer)`` waits for that layer alone. A :class:`SaveJob` is made at the
step's first ``save_kv_layer``: each layer's blocks are copied out of the paged cache as soon
as the forward pass has written them, and the save thread, which reserved every object with
one PutStart, writes each layer's slice as its copy lands, then commits with one PutEnd.

Neither ever holds the engine longer than its deadline: a load that has not delivered a layer
by then is cancelled (no copy into the cache starts after that) and all its blocks are
reported as failed, so vLLM recomputes them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.client.connectors.vllm_layers import CopyEvent, CopyStream, LayerLayout, StagingPool
from kvpool.client.partial import PartialGet, PartialPut
from kvpool.common.errors import AlreadyExists, KVPoolError

if TYPE_CHECKING:
    from kvpool.client.connectors.store import LazyStore

log = logging.getLogger("vllm.kvpool")

# How long the save thread waits for a layer's copy before it gives the put up (the engine
# stages every layer by wait_for_save at the latest, so only a dead step gets here).
_STAGE_WAIT_S = 120.0


class LayerSet:
    """The layers' layouts and caches, in the object's order, with each layer's offset."""

    def __init__(self, layouts: Sequence[LayerLayout], caches: Sequence) -> None:
        self.layouts, self.caches = list(layouts), list(caches)
        self.offsets, total = [], 0
        for lay in self.layouts:
            self.offsets.append(total)
            total += lay.block_bytes
        self.block_bytes = total

    def objects(self, staging, n: int):
        """A staging buffer as ``n`` objects: ``(n, block_bytes)``, block-major, so an object
        is one contiguous row (a whole-object read or write is one op)."""
        return staging[:n * self.block_bytes].view(n, self.block_bytes)

    def rows(self, staging, n: int, layer: int):
        """Layer ``layer``'s slice of each of ``n`` objects in staging: ``(n, bytes)``,
        strided (each row contiguous)."""
        start = self.offsets[layer]
        return self.objects(staging, n)[:, start:start + self.layouts[layer].block_bytes]


class LoadJob:
    """Blocks ``block_ids`` (paged ids) loaded from objects ``keys`` (parallel)."""

    def __init__(self, keys: list[str], block_ids: list[int], layers: LayerSet,
                 stream: CopyStream, pool: StagingPool, *, verify: bool, timeout_s: float,
                 requests: int = 1):
        self.keys, self.block_ids, self.requests = keys, block_ids, requests
        self._layers, self._stream, self._pool = layers, stream, pool
        self._verify = verify
        self.deadline = time.monotonic() + timeout_s
        n = len(layers.layouts)
        self._ready = [threading.Event() for _ in range(n)]
        self._events: list[CopyEvent | None] = [None] * n
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._cancelled = False
        self._failed: set[int] = set()   # positions in keys
        self.reasons: set[str] = set()
        self.bytes = 0
        self.started = time.perf_counter()
        self.seconds = 0.0
        self.waited_s = 0.0   # what wait_layer held the engine, all layers together

    def run(self, store: LazyStore) -> None:
        """The load thread's work."""
        staging = None
        try:
            kv = store.client()
            if kv is None:
                self._fail_all("StoreUnavailable")
                return
            try:
                got = PartialGet(kv, self.keys, verify=self._verify)
            except KVPoolError as e:
                store.failed(e)
                self._fail_all(type(e).__name__)
                return
            size = self._layers.block_bytes
            for j, r in enumerate(got.results):
                if r is None and got.size(j) != size:
                    got.results[j] = KVPoolError(f"{self.keys[j]!r}: {got.size(j)} bytes, "
                                                 f"expected {size}")
            live = [j for j, r in enumerate(got.results) if r is None]
            staging = self._pool.take(max(1, len(live) * size))
            def by_key(rows) -> list:   # got.read takes a buffer (or None) per key
                out: list = [None] * len(self.keys)
                for k, j in enumerate(live):
                    out[j] = rows[k] if got.results[j] is None else None
                return out

            if not got.piecewise:   # whole objects (tcp, RDMA), then layer by layer in place
                got.read(0, by_key(self._layers.objects(staging, len(live))))
            for layer, lay in enumerate(self._layers.layouts):
                rows = self._layers.rows(staging, len(live), layer)
                if got.piecewise:
                    got.read(self._layers.offsets[layer], by_key(rows))
                kept = [k for k, j in enumerate(live) if got.results[j] is None]
                self._copy_in(layer, lay, rows, [live[k] for k in kept], kept)
                self.bytes += len(kept) * lay.block_bytes
            got.finish()
            for j, r in enumerate(got.results):
                if r is not None:
                    self._failed.add(j)
                    self.reasons.add(type(r).__name__)
        except Exception as e:   # a load must never take the engine down
            log.exception("kvpool_load_crashed")
            self._fail_all(type(e).__name__)
        finally:
            for ev in self._ready:
                ev.set()
            self.seconds = time.perf_counter() - self.started
            self._done.set()
            if staging is not None:
                self._pool.give_back(staging)

    def _copy_in(self, layer: int, lay: LayerLayout, rows, positions: list[int],
                 kept: list[int]) -> None:
        with self._lock:
            if self._cancelled:
                return
            if positions:
                import torch
                cache = self._layers.caches[layer]
                ids = torch.tensor([self.block_ids[j] for j in positions], dtype=torch.long,
                                   device=cache.device)
                src = rows if len(kept) == len(rows) else rows[torch.tensor(kept)]
                ev = self._stream.submit(lambda: lay.scatter(cache, ids, src),
                                         after_compute=False)
                ev.synchronize()   # the staging rows are reused for the next step
                self._events[layer] = ev
            self._ready[layer].set()

    def _fail_all(self, reason: str) -> None:
        self._failed = set(range(len(self.keys)))
        self.reasons.add(reason)

    def wait_layer(self, layer: int) -> None:
        """Return once ``layer`` is in the paged cache (or the load gave up on it)."""
        t0 = time.perf_counter()
        try:
            if not self._ready[layer].wait(max(0.0, self.deadline - time.monotonic())):
                self.cancel()
                return
            if (ev := self._events[layer]) is not None:
                ev.order_compute()
        finally:
            self.waited_s += time.perf_counter() - t0

    def wait_all(self) -> None:
        for layer in range(len(self._ready)):
            self.wait_layer(layer)

    def cancel(self) -> None:
        """No copy into the paged cache starts after this; every block counts as failed."""
        with self._lock:
            if not self._cancelled and not self._done.is_set():
                self._cancelled = True
                self._fail_all("Timeout")
            self._stream.fence()

    def failed_blocks(self) -> set[int]:
        """The paged ids of the blocks that did not load (waiting, up to the deadline, for
        the load to end)."""
        if not self._done.wait(max(0.0, self.deadline - time.monotonic())):
            self.cancel()
        return {self.block_ids[j] for j in self._failed}


class SaveJob:
    """Blocks ``block_ids`` stored as objects ``keys`` (parallel; ``parents`` the key each
    extends), layer by layer."""

    def __init__(self, keys: list[str], parents: list[str | None], block_ids: list[int],
                 layers: LayerSet, stream: CopyStream, pool: StagingPool):
        self.keys, self.parents, self.block_ids = keys, parents, block_ids
        self._layers, self._stream, self._pool = layers, stream, pool
        n = len(layers.layouts)
        self._ready = [threading.Event() for _ in range(n)]
        self._events: list[CopyEvent | None] = [None] * n
        self._staging = pool.take(max(1, len(keys) * layers.block_bytes))
        import torch
        self._ids = {}
        for cache in layers.caches:
            if cache.device not in self._ids:
                self._ids[cache.device] = torch.tensor(block_ids, dtype=torch.long,
                                                       device=cache.device)
        self.stored = 0
        self.errors: list[KVPoolError] = []
        self.staged_in_forward = 0   # layers handed over by save_kv_layer, not wait_for_save
        self.reserved_again = False  # the first reservation lapsed during the forward pass
        # seconds spent reserving; waiting for the forward pass's layers and writing each;
        # committing
        self.phases = {"reserve": 0.0, "layers": 0.0, "commit": 0.0}

    def stage(self, layer: int, *, in_forward: bool = False) -> None:
        """Copy ``layer``'s blocks out of the paged cache (the forward pass has written them):
        on the copy stream, or on CPU when the save thread gets to it."""
        if self._ready[layer].is_set():
            return
        self.staged_in_forward += in_forward
        lay, cache = self._layers.layouts[layer], self._layers.caches[layer]
        rows, ids = self._layers.rows(self._staging, len(self.keys), layer), self._ids[cache.device]
        self._events[layer] = self._stream.submit(lambda: lay.gather(cache, ids, rows),
                                                  after_compute=True)
        self._ready[layer].set()

    def stage_all(self) -> None:
        for layer in range(len(self._ready)):
            self.stage(layer)

    def run(self, store: LazyStore) -> None:
        """The save thread's work: reserve, write each layer as it is staged, commit."""
        put = None
        t0 = time.perf_counter()
        try:
            kv = store.client()
            if kv is not None:
                try:
                    put = PartialPut(kv, self.keys, [self._layers.block_bytes] * len(self.keys),
                                     parents=self.parents)
                except KVPoolError as e:
                    store.failed(e)
            n = len(self.keys)
            again = False
            t1 = time.perf_counter()
            self.phases["reserve"] = t1 - t0
            for layer in range(len(self._ready)):
                if not self._ready[layer].wait(_STAGE_WAIT_S):
                    raise TimeoutError(f"layer {layer} never staged")
                self._events[layer].synchronize()
                if put is not None and put.expired:
                    # A forward pass longer than the master's put timeout (a long prompt on
                    # a CPU): the reservation lapses. Staging holds every layer, so the
                    # objects are reserved again and written at once after the last layer.
                    put.abort()
                    put, again = None, True
                if put is not None and put.piecewise and any(r is None for r in put.results):
                    rows = self._layers.rows(self._staging, n, layer)
                    put.write(self._layers.offsets[layer], [rows[j] for j in range(n)])
            if again and (kv := store.client()) is not None:
                put = PartialPut(kv, self.keys, [self._layers.block_bytes] * n,
                                 parents=self.parents)
                self.reserved_again = True
            if put is not None and (again or not put.piecewise):
                # Whole objects, every layer staged (tcp, RDMA; or reserved again).
                objects = self._layers.objects(self._staging, n)
                put.write(0, [objects[j] for j in range(n)])
            t2 = time.perf_counter()
            self.phases["layers"] = t2 - t1
            if put is not None:
                results = put.commit()
                self.phases["commit"] = time.perf_counter() - t2
                self.errors = [r for r in results
                               if r is not None and not isinstance(r, AlreadyExists)]
                self.stored = sum(r is None for r in results) * self._layers.block_bytes
        except KVPoolError as e:
            store.failed(e)
            self.errors = [e]
        except Exception as e:   # a save must never take the engine down
            log.exception("kvpool_save_crashed")
            self.errors = [KVPoolError(str(e))]
            if put is not None:
                # Failing that, the master reclaims the reservation at the put timeout.
                with contextlib.suppress(Exception):
                    put.abort()
        finally:
            for ev in self._events:
                if ev is not None:
                    # Nothing may still copy into the staging buffer once it is given back
                    # (a copy that failed was logged above).
                    with contextlib.suppress(Exception):
                        ev.synchronize()
            self._pool.give_back(self._staging)
