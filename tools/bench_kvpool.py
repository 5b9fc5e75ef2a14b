"""The workloads ``kvpool bench`` times: kvpool's data path, its master, and the baselines.

Each function returns :class:`~kvpool.tools.bench_report.Figure` values (or the master's
figures as a dict). Buffers are allocated and filled before timing starts; only the calls are
timed. kvpool's reads are checked byte for byte once per workload, so a fast wrong answer never
counts as a result.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import queue
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from kvpool.common.errors import KVPoolError
from kvpool.tools.bench_report import Figure, summarize


class BenchError(RuntimeError):
    """A benchmark step failed (an error from kvpool, or bytes that came back wrong)."""


@dataclass(frozen=True)
class Shape:
    """A workload's shape: ``objects_per_call`` values of ``value_bytes``, ``calls`` per repeat."""

    workload: str        # prompt | small | single
    value_bytes: int
    objects_per_call: int
    calls: int


def random_rows(objects: int, value_bytes: int, seed: int = 0) -> np.ndarray:
    """``objects`` rows of ``value_bytes`` random bytes (distinct rows catch mixed-up reads)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(objects, value_bytes), dtype=np.uint8)


def _keys(prefix: str, repeat: int, shape: Shape) -> list[list[str]]:
    """Fresh keys for one repeat: a list per call."""
    return [[f"{prefix}/{repeat}/{c}/{j}" for j in range(shape.objects_per_call)]
            for c in range(shape.calls)]


def _timed(fn: Callable[..., object], *args: object) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t0, result


# ---------------------------------------------------------------- baselines


def memcpy_latencies(shape: Shape, repeats: int, src: np.ndarray) -> list[list[float]]:
    """Per-repeat call latencies of the memcpy baseline (see :func:`memcpy_figure`)."""
    from kvpool.tools.bench_peers import memcpy_copy
    dst = np.empty_like(src)
    memcpy_copy(dst, src)   # fault the destination's pages in before timing, as kvpool's are
    return [[_timed(memcpy_copy, dst, src)[0] for _ in range(shape.calls)]
            for _ in range(repeats)]


def memcpy_figure(shape: Shape, latencies: list[list[float]]) -> Figure:
    return summarize("memcpy", "-", shape.workload, "copy", shape.value_bytes,
                     shape.objects_per_call, latencies)


def raw_tcp_latencies(peer, shape: Shape, repeats: int, src: np.ndarray
                      ) -> dict[str, list[list[float]]]:
    """Per-op ("put", "get") per-repeat call latencies of the raw tcp baseline."""
    dst = np.empty_like(src)
    src_rows, dst_rows = [memoryview(r) for r in src], [memoryview(r) for r in dst]
    put, get = [], []
    for _ in range(repeats):
        put.append([_timed(peer.put, src_rows)[0] for _ in range(shape.calls)])
        get.append([_timed(peer.get, dst_rows)[0] for _ in range(shape.calls)])
    return {"put": put, "get": get}


def raw_tcp_figures(shape: Shape, latencies: dict[str, list[list[float]]]) -> list[Figure]:
    return [summarize("raw_tcp", "tcp", shape.workload, op, shape.value_bytes,
                      shape.objects_per_call, lat) for op, lat in latencies.items()]


def redis_figures(peer, shape: Shape, repeats: int, src: np.ndarray, prefix: str
                  ) -> list[Figure]:
    """Redis's pipelined put and get of the same rows (:class:`RedisClient`), fresh keys per
    repeat; checked byte for byte once."""
    return kvpool_figures({"redis": RedisClient(peer)}, shape, repeats, src, prefix)


def mooncake_figures(peer, shape: Shape, repeats: int, src: np.ndarray, prefix: str
                     ) -> list[Figure]:
    """Mooncake Store's batched put and get of the same rows (tools/bench_mooncake.py), fresh
    keys per repeat, through registered buffers; checked byte for byte once. The figures'
    transport is the peer's: tcp, or local (its same-host path)."""
    try:
        return kvpool_figures({"mooncake": PeerClient(peer)}, shape, repeats, src, prefix)
    finally:
        peer.unregister_all()


class _Rows:
    """A client of :func:`kvpool_figures`: the rows of the workload it puts (``src``, one per
    key of a call) and reads into (``dst``), and the loop that times its calls."""

    name = ""
    src = dst = np.zeros((0, 0), np.uint8)

    def put(self, keys: list[str]) -> float:
        raise NotImplementedError

    def get(self, keys: list[str]) -> float:
        raise NotImplementedError

    def calls(self, op: str, keys: list[list[str]], timed: list[bool], check: bool
              ) -> list[float]:
        """Make ``op`` ("put" or "get") once per key list, in order; the latencies of those
        ``timed``. ``check``: the bytes read must be those put (after a get)."""
        call = self.put if op == "put" else self.get
        latencies = []
        for k, timing in zip(keys, timed):
            t = call(k)
            if timing:
                latencies.append(t)
        if check and not np.array_equal(self.src, self.dst):
            raise BenchError(f"{self.name} get returned bytes that differ from those put")
        return latencies


class PeerClient(_Rows):
    """A peer's client where :func:`kvpool_figures` takes a system's: Mooncake Store's
    (tools/bench_mooncake.py MooncakePeer), putting and getting the rows of buffers it
    registered. Beside kvpool's clients, its single calls take turns with theirs."""

    name = "mooncake"

    def __init__(self, peer) -> None:
        self.peer, self.transport = peer, peer.transport

    def load(self, src: np.ndarray) -> None:
        self.peer.unregister_all()
        self.src, self.dst = src, np.zeros_like(src)
        self.peer.register(self.src)
        self.peer.register(self.dst)

    def put(self, keys: list[str]) -> float:
        t, codes = _timed(self.peer.put, keys, self.src)
        if any(codes):
            raise BenchError(f"mooncake put failed: codes {sorted(set(codes))}")
        return t

    def get(self, keys: list[str]) -> float:
        t, got = _timed(self.peer.get, keys, self.dst)
        if any(n != self.src.shape[1] for n in got):
            raise BenchError(f"mooncake get failed: results {sorted(set(got))[:4]}")
        return t

    def remove(self, keys: list[str]) -> None:
        self.peer.delete(keys)

    def close(self) -> None:
        self.peer.close()


class RedisClient(_Rows):
    """Redis where :func:`kvpool_figures` takes a system's client (tools/bench_peers.py
    RedisPeer, started where this lives): its single calls take turns with kvpool's over shm,
    which the 64 KiB get target compares with Redis's."""

    name, transport = "redis", "tcp"

    def __init__(self, peer) -> None:
        self.peer = peer

    def load(self, src: np.ndarray) -> None:
        self.src, self.dst = src, np.zeros_like(src)
        self.rows = [memoryview(r) for r in src]

    def put(self, keys: list[str]) -> float:
        return _timed(self.peer.put, keys, self.rows)[0]

    def get(self, keys: list[str]) -> float:
        t, got = _timed(self.peer.get, keys)   # bytes, as redis-py returns them (untimed copy)
        if any(v is None or len(v) != self.src.shape[1] for v in got):
            raise BenchError("redis returned a wrong value")
        for row, value in zip(self.dst, got):
            row[:] = np.frombuffer(value, np.uint8)
        return t

    def remove(self, keys: list[str]) -> None:
        self.peer.delete(keys)

    def close(self) -> None:
        self.peer.close()


def redis_client() -> RedisClient:
    """A started Redis's :class:`RedisClient` (for a :class:`SpawnedClient`)."""
    from kvpool.tools.bench_peers import RedisPeer
    return RedisClient(RedisPeer().__enter__())


def mooncake_client(segment_bytes: int, local: bool) -> PeerClient:
    """A started Mooncake Store peer's :class:`PeerClient` (for a :class:`SpawnedClient`)."""
    from kvpool.tools.bench_mooncake import MooncakePeer
    return PeerClient(MooncakePeer(segment_bytes, local=local).__enter__())


# ---------------------------------------------------------------- kvpool data path


class SystemClient(_Rows):
    """One system's client in :func:`kvpool_figures`, and the rows of the workload it times:
    its calls are made and timed where it lives (in this process, or in a
    :class:`SpawnedClient`'s)."""

    def __init__(self, kv, transport: str) -> None:
        self.kv, self.transport, self.name = kv, transport, transport

    def reachable(self, key: str) -> bool:
        """A put and a get (which map the segment, for writing and for reading, on shm)."""
        try:
            self.kv.put(key, b"probe")
            self.kv.get(key)
        except KVPoolError:
            return False
        self.kv.remove(key)
        return True

    def prefaulted(self, timeout_s: float) -> bool:
        """Whether the shm client's mappings have their page tables within ``timeout_s``
        (client/transport/shm.py, the prefaulter), as a client that has run a while has them."""
        from kvpool.client.transport.shm import wait_prefaulted
        return wait_prefaulted(timeout_s)

    def load(self, src: np.ndarray) -> None:
        """The rows to put (one per key of a call) and a destination for reading them."""
        self.src, self.dst = src, np.zeros_like(src)
        self.dst.fill(0)   # fault the destination's pages in before timing, as memcpy's are
        self.src_rows, self.dst_rows = list(src), list(self.dst)

    def put(self, keys: list[str]) -> float:
        return self._call("put", keys, self.kv.put, self.src_rows[0], self.kv.batch_put,
                          self.src_rows)

    def get(self, keys: list[str]) -> float:   # batches: one array, a row per key
        return self._call("get", keys, self.kv.get_into, self.dst_rows[0],
                          self.kv.batch_get_into, self.dst)

    def _call(self, op: str, keys: list[str], single, row, batch, rows) -> float:
        """One call's time: ``single(key, row)`` for one key, else ``batch(keys, rows)``."""
        one = len(keys) == 1
        t, res = _timed(single, keys[0], row) if one else _timed(batch, keys, rows)
        _check([res] if one else res, f"{self.transport} {op}")
        return t

    def remove(self, keys: list[str]) -> None:
        _check(self.kv.batch_remove(keys), "remove")

    def close(self) -> None:
        self.kv.close()


def connect(master: str, transport: str, spawned: bool = False
            ) -> SystemClient | SpawnedClient:
    """A client of ``master`` over ``transport`` only, here or (``spawned``) in a process of
    its own."""
    if spawned:
        return SpawnedClient(transport, connect, master, transport)
    from kvpool.client import KVClient
    return SystemClient(KVClient(master, transports=[transport]), transport)


class SpawnedClient:
    """A :class:`SystemClient` in a process of its own (spawned: a forked gRPC channel is not
    safe), each method call a message on a pipe. Two systems timed side by side then share no
    interpreter: in one process, one client's helper threads (the shm put's checksum, the
    prefaulter) wait for the GIL behind the other's calls, and the single-call figures swung
    0.6-1.8 x between two identical clusters."""

    def __init__(self, transport: str, make: Callable[..., object], *args: object,
                 timeout_s: float = 600.0) -> None:
        """The client ``make(*args)`` returns in the child (a module's function: it is
        pickled); ``transport``: the transport its figures are of."""
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        self.transport = transport
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_client, args=(child, make, args), daemon=True)
        self._proc.start()
        child.close()
        self._timeout_s = timeout_s
        try:
            self._answer()
        except BaseException:
            self._proc.join(timeout=10)
            raise

    def __getattr__(self, name: str) -> Callable[..., object]:
        if name.startswith("_"):   # not one of SystemClient's calls (nor set yet)
            raise AttributeError(name)
        return functools.partial(self._call, name)

    def _call(self, name: str, *args: object) -> object:
        """The child's :class:`SystemClient` ``name(*args)``."""
        try:
            self._conn.send((name, args))
        except OSError:   # its end of the pipe is gone
            raise self._gone() from None
        return self._answer()

    def _gone(self) -> BenchError:
        self._proc.join(timeout=1.0)
        return BenchError(f"the bench's client process (pid {self._proc.pid}) "
                          f"{'died' if not self._proc.is_alive() else 'stopped answering'}")

    def _answer(self) -> object:
        deadline = time.monotonic() + self._timeout_s
        try:
            while not self._conn.poll(0.5):
                if not self._proc.is_alive() or time.monotonic() > deadline:
                    raise self._gone()
            error, value = self._conn.recv()
        except (OSError, EOFError):
            raise self._gone() from None
        if error is not None:
            raise (KVPoolError if error == "kvpool" else BenchError)(value)
        return value

    def close(self) -> None:
        self._timeout_s = min(self._timeout_s, 10.0)   # one that stopped answering: killed
        try:
            if self._proc.is_alive():
                with contextlib.suppress(BenchError):   # it died meanwhile
                    self._call("close")
        finally:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
            self._conn.close()


def _serve_client(conn, make: Callable[..., object], args: tuple) -> None:
    """A :class:`SpawnedClient`'s process: the client ``make(*args)`` (a
    :class:`SystemClient` or a :class:`PeerClient`) answers each call with (None, result)
    or (what failed, its message), until closed or its parent is gone."""
    def failed(e: BaseException) -> tuple[str, str]:
        return ("kvpool" if isinstance(e, KVPoolError) else "bench",
                f"{e}" if isinstance(e, (KVPoolError, BenchError)) else f"{type(e).__name__}: {e}")
    try:
        client = make(*args)
    except Exception as e:   # noqa: BLE001  (reported to the parent, which raises it)
        conn.send(failed(e))
        return
    conn.send((None, None))
    while True:
        try:
            name, args = conn.recv()
        except EOFError:
            name, args = "close", ()
        try:
            conn.send((None, getattr(client, name)(*args)))
        except (BrokenPipeError, EOFError):
            client.close()
            return
        except Exception as e:   # noqa: BLE001
            conn.send(failed(e))
        if name == "close":
            return


def kvpool_figures(clients: Mapping[str, SystemClient | PeerClient | SpawnedClient],
                   shape: Shape, repeats: int, src: np.ndarray, prefix: str,
                   settle_s: float = 0.0) -> list[Figure]:
    """Batched (or single-value) put then get_into of the same bytes, fresh keys per repeat;
    ``settle_s``: a pause (untimed) after each repeat's removal, for its space to be freed.
    ``clients``: the figures' system -> its client (the figures' transport is the client's).
    With several (security's cost: a secure and a plain cluster; a peer's single calls
    beside kvpool's), each call is made on each in turn, the order swapped from call to
    call (across repeats too: a prompt is one call per repeat), so that all are timed under
    the same load. Single calls go in turns of ``TURN_CALLS`` per system instead, the first of
    each turn untimed: a call made while the other cluster's servers still poll after their
    last answer ($KVPOOL_SPIN_US) shares two cores with them, and one made after its own
    servers slept through the other's turn wakes them; neither is a call of a client making
    call after call, which the single-call figures are (without the turns, 64 KiB puts over
    shm took 0.23-0.28 ms on both clusters, 0.14-0.15 ms on each alone)."""
    for client in clients.values():
        client.load(src)
    single = shape.objects_per_call == 1
    timed: dict[str, dict[str, list[list[float]]]] = {op: {s: [] for s in clients}
                                                      for op in ("put", "get")}
    calls = {"put": 0, "get": 0}
    for r in range(repeats):
        keys = _keys(prefix, r, shape)
        for op in ("put", "get"):
            lat: dict[str, list[float]] = {s: [] for s in clients}
            turns = _turns(len(keys), list(clients), single, calls, op)
            for system, run in itertools.groupby(turns, key=lambda turn: turn[0]):
                run = list(run)
                lat[system] += clients[system].calls(
                    op, [keys[i] for _, i, _ in run], [timing for _, _, timing in run],
                    op == "get" and r == 0 and run[0][1] == 0)
            for system in clients:
                timed[op][system].append(lat[system])
        for client in clients.values():
            client.remove([x for ks in keys for x in ks])
        time.sleep(settle_s)
    return [summarize(system, client.transport, shape.workload, op, shape.value_bytes,
                      shape.objects_per_call, timed[op][system])
            for system, client in clients.items() for op in ("put", "get")]


#: With several systems, single calls go in turns of this many per system (the first untimed).
TURN_CALLS = 10


def _turns(calls_made: int, systems: list[str], single: bool, calls: dict, op: str):
    """(system, index of the call's keys, timed) of each call of :func:`kvpool_figures`, in
    the order they are made."""
    if single and len(systems) > 1:
        for start in range(0, calls_made, TURN_CALLS):
            calls[op] += 1
            end = min(start + TURN_CALLS, calls_made)
            for system in systems if calls[op] % 2 else systems[::-1]:
                for i in range(start, end):   # (a turn of one call is timed)
                    yield system, i, i > start or end - start == 1
        return
    for i in range(calls_made):
        calls[op] += 1
        for system in systems if calls[op] % 2 else systems[::-1]:
            yield system, i, True


def _check(results: Sequence, what: str) -> None:
    for r in results:
        if isinstance(r, KVPoolError):
            raise BenchError(f"{what} failed: {r}")


# ---------------------------------------------------------------- master


def master_figures(address: str, master_pid: int | None, objects: int, batch: int,
                   lookups: int, repeats: int, value_bytes: int = 64,
                   virtual_segment: bool = False, clients: int = 1) -> dict:
    """Batched PutStart+PutEnd and GetReplicas rates, and RSS growth per indexed object.

    Keys are 64 hex characters (a sha256 block hash, as engines use). ``objects`` are indexed in
    ``repeats`` equal chunks; each chunk's rate is one repeat. RSS is the master process's
    (``master_pid``; None when the master is not ours to inspect).

    These rates are one client's, each call waiting for the last: the master idles while
    that client encodes and decodes. With ``clients`` > 1, ``clients`` processes then also
    look up ``lookups`` keys and put ``lookups`` new ones at once (``*_concurrent``): what
    the master serves when it is kept busy, as a fleet keeps it.

    ``virtual_segment`` (only for a master of our own: placement would put anyone's objects
    there): mount a segment that no store node backs, large enough for every object at its
    real size (a million 2 MiB blocks), and heartbeat for it; the master never touches bytes.
    """
    from kvpool.rpc.master_client import MasterClient
    keys = [os.urandom(32).hex() for _ in range(objects)]
    sizes = [value_bytes] * batch
    put_rates = []
    with MasterClient(address, timeout_s=60.0) as mc, \
            virtual_node(address, objects * value_bytes, virtual_segment) as keep_alive:
        rss_before = _rss_bytes(master_pid)
        chunk = -(-objects // repeats)
        for lo in range(0, objects, chunk):
            part = keys[lo:lo + chunk]
            t0 = time.perf_counter()
            for i in range(0, len(part), batch):
                keep_alive()
                ks = part[i:i + batch]
                placed, _ = mc.put_start(ks, sizes[:len(ks)])
                _check(placed, "master PutStart")
                _check(mc.put_end(ks), "master PutEnd")
            put_rates.append(len(part) / (time.perf_counter() - t0))
        rss_after = _rss_bytes(master_pid)
        rng = random.Random(0)
        lookup_rates = []
        for _ in range(repeats):
            # An engine looks up the hashes of blocks it has just hashed: each call's keys are
            # made from their hashes here, in the timed loop, as the engine would make them
            # (rather than picked from a million strs made long ago, cold in the caches).
            hashes = [bytes.fromhex(k) for k in rng.sample(keys, min(lookups, len(keys)))]
            t0 = time.perf_counter()
            for i in range(0, len(hashes), batch):
                keep_alive()
                # In columns, as KVClient's reads ask (Located.views() would time the building
                # of an ObjectView per key here, in the client, not the master's lookup).
                located = mc.locate([h.hex() for h in hashes[i:i + batch]])
                if not located.found().all():
                    raise BenchError("master GetReplicas did not find every indexed key")
            lookup_rates.append(len(hashes) / (time.perf_counter() - t0))
        concurrent = {}
        if clients > 1:
            sample = rng.sample(keys, min(lookups, len(keys)))
            fresh = [os.urandom(32).hex() for _ in range(len(sample))]
            concurrent = {
                "clients": clients,
                "lookup_objects_per_s_concurrent": round(_concurrently(
                    address, "lookup", sample, batch, value_bytes, clients, keep_alive)),
                "put_objects_per_s_concurrent": round(_concurrently(
                    address, "put", fresh, batch, value_bytes, clients, keep_alive))}
            if master_pid is None:
                keys += fresh
        if master_pid is None:   # not our master: leave it as we found it
            for i in range(0, len(keys), batch):
                mc.remove(keys[i:i + batch])
    per_object = None
    if rss_before is not None and rss_after is not None:
        per_object = round((rss_after - rss_before) / objects, 1)
    return {"objects": objects, "batch": batch, "value_bytes": value_bytes,
            "put_objects_per_s": round(_median(put_rates)),
            "lookup_objects_per_s": round(_median(lookup_rates)),
            "bytes_per_object": per_object, **concurrent}


def _concurrently(address: str, op: str, keys: list[str], batch: int, value_bytes: int,
                  clients: int, keep_alive: Callable[[], None]) -> float:
    """Objects per second of ``op`` ("put" or "lookup") over ``keys``, shared out among
    ``clients`` processes (spawned: a forked gRPC channel is not safe) that start together,
    each with its own connection; timed from the start to the last one's end."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Barrier(clients + 1), ctx.Event()
    results = ctx.Queue()
    share = -(-len(keys) // clients)
    procs = [ctx.Process(target=_master_client, daemon=True,
                         args=(address, op, keys[i * share:(i + 1) * share], batch,
                               value_bytes, ready, go, results))
             for i in range(clients)]
    for p in procs:
        p.start()
    try:
        ready.wait(timeout=120)
        t0 = time.perf_counter()
        go.set()
        outcomes = []
        while len(outcomes) < clients:
            keep_alive()
            with contextlib.suppress(queue.Empty):
                outcomes.append(results.get(timeout=0.5))
            if len(outcomes) < clients and not any(p.is_alive() for p in procs):
                raise BenchError(f"master {op} clients died: {outcomes}")
        elapsed = time.perf_counter() - t0
        failed = [o for o in outcomes if o is not None]
        if failed:
            raise BenchError(f"master {op} from {clients} clients: {failed[0]}")
        return len(keys) / elapsed
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _master_client(address: str, op: str, keys: list[str], batch: int, value_bytes: int,
                   ready, go, results) -> None:
    """One of :func:`_concurrently`'s processes: connect, wait for the others, run, report
    None or what went wrong."""
    from kvpool.rpc.master_client import MasterClient
    try:
        with MasterClient(address, timeout_s=60.0) as mc:
            mc.exists(keys[:1])   # connected (and the lookup port learnt) before the start
            ready.wait(timeout=120)
            go.wait(timeout=120)
            sizes = [value_bytes] * batch
            for i in range(0, len(keys), batch):
                ks = keys[i:i + batch]
                if op == "put":
                    placed, _ = mc.put_start(ks, sizes[:len(ks)])
                    _check(placed, "master PutStart")
                    _check(mc.put_end(ks), "master PutEnd")
                elif not mc.locate(ks).found().all():
                    raise BenchError("master GetReplicas did not find every indexed key")
        results.put(None)
    except Exception as e:   # noqa: BLE001  (reported to the parent, which raises it)
        results.put(f"{type(e).__name__}: {e}")


@contextlib.contextmanager
def virtual_node(address: str, total_bytes: int, mount: bool) -> Iterator[Callable[[], None]]:
    """With ``mount``: mount a segment of ``2 x total_bytes`` (below the eviction watermark)
    for a node that does not exist, as that node (a secure local cluster issues it a node
    certificate: only a node mounts); yield a function that heartbeats for it at most once a
    second. Without: a function that does nothing."""
    if not mount:
        yield lambda: None
        return
    from kvpool.common.types import NodeEndpoints, SegmentInfo
    from kvpool.rpc.master_client import MasterClient
    token = os.urandom(4).hex()
    node = NodeEndpoints(node_id=f"bench-virtual-{token}", boot_id="", tcp_endpoint="0.0.0.0:9")
    with MasterClient(address, timeout_s=60.0, role="node", identity=node.node_id) as mc:
        mc.mount_segment(node, SegmentInfo(f"bench-virtual-{token}/0", 2 * total_bytes))
        last = time.monotonic()

        def keep_alive() -> None:
            nonlocal last
            if time.monotonic() - last > 1.0:
                mc.heartbeat(node.node_id)
                last = time.monotonic()
        yield keep_alive


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
