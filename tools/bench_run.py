"""The ``kvpool bench`` run: start what it needs, time every workload, report, stop everything.

Order matters on a small machine: the baselines run first (nothing else of ours is busy), then
kvpool per transport on one local cluster, then the master figures on a fresh cluster of their
own (so the RSS growth counts only the indexed objects).
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from kvpool.common.config import format_size
from kvpool.common.errors import KVPoolError
from kvpool.tools import bench_kvpool as w
from kvpool.tools.bench_report import (PLAIN, Figure, across, build_report, format_table,
                                       write_plots)

# The data-path cluster's segment: a removed batch that was read stays allocated until its read
# lease runs out, so every repeat's batch (and the next workload's first) is allocated at once.
# A segment that holds them all lets the repeats run back to back, as the baselines' do: a
# repeat that first waits out the lease of the one before (_settle_s) starts on idle cores and
# processes, and pays for waking them (a put of the prompt batch ~10% more here). That takes
# (repeats + 2) batches, unless more than this share of the memory available: then 4 of them.
_SEGMENT_MEMORY_SHARE = 0.5
_SEGMENT_MIN_BATCHES = 4
_LEASE_S = 1.0
_SMALL_MASTER_VALUE_BYTES = 64   # on an existing cluster's real nodes
# Calls per repeat of the small batch: one call takes a few ms, so a repeat of one call would
# be a median of a handful of samples, at the mercy of a single scheduler hiccup.
_SMALL_CALLS = 4
# How long the shm clients may take to fault their mappings of the segment in (untimed): the
# memcpy baseline's destination and Mooncake's registered segment are faulted in before timing.
_PREFAULT_S = 120.0


@dataclass(frozen=True)
class BenchConfig:
    quick: bool
    transports: tuple[str, ...]
    sizes: tuple[int, ...]
    prompt_blocks: int
    block_bytes: int
    small_blocks: int
    small_bytes: int
    repeats: int
    single_calls: int
    master_objects: int          # 0 = skip the master figures
    master_batch: int
    master_lookups: int
    master_clients: int = 2      # processes calling at once for the *_concurrent figures
    redis: bool = True
    peers: tuple[str, ...] = ()
    metrics: bool = False        # kvpool's processes serve /metrics (their cost measured)
    data_tls: bool = False       # the secure cluster's node serves tcp over TLS (its cost)
    insecure: bool = False       # the local cluster without credentials (security's cost)
    # kvpool's figures on a secure and a plain local cluster, alternated (security's cost in
    # one run): the plain cluster's figures are system PLAIN.
    compare_insecure: bool = False
    cluster_pairs: int = 2       # with compare_insecure: pairs of clusters, orders alternated

    def shapes(self) -> list[w.Shape]:
        return ([w.Shape("single", s, 1, self.single_calls) for s in self.sizes]
                + [w.Shape("prompt", self.block_bytes, self.prompt_blocks, 1),
                   w.Shape("small", self.small_bytes, self.small_blocks, _SMALL_CALLS)])


def _say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_bench(config: BenchConfig, *, master: str | None = None, json_path: str | None = None,
              plots_dir: str | None = None) -> int:
    """Measure everything ``config`` asks for; print the table; write JSON and plots."""
    started = time.monotonic()
    figures: list[Figure] = []
    skipped: dict[str, str] = {}
    data = {shape: w.random_rows(shape.objects_per_call, shape.value_bytes, seed=i)
            for i, shape in enumerate(config.shapes())}
    run_id = secrets.token_hex(4)
    master_figures = None
    environment = _environment()
    try:
        # Each step stops what it started before the next begins (memory and CPU are shared).
        # memcpy is timed first and again after kvpool's figures, its repeats pooled: on a
        # shared machine the load drifts, and the limit should not be timed at one moment only.
        # Raw tcp likewise: both limits are the median of repeats before and after kvpool's.
        _say("baseline: memcpy")
        memcpy = {shape: w.memcpy_latencies(shape, config.repeats, src)
                  for shape, src in data.items()}
        raw_tcp = _raw_tcp(config, data)
        _redis(config, data, figures, skipped, run_id, environment)
        _peers(config, data, figures, skipped, run_id)
        _kvpool(config, data, figures, skipped, master, run_id)
        figures[:0] = [w.memcpy_figure(shape, memcpy[shape] + w.memcpy_latencies(
            shape, config.repeats, src)) for shape, src in data.items()]
        again = _raw_tcp(config, data)
        figures[len(data):len(data)] = [
            f for shape, lat in raw_tcp.items()
            for f in w.raw_tcp_figures(shape, {op: lat[op] + again[shape][op] for op in lat})]
        if config.master_objects:
            master_figures = _master(config, master)
        else:
            skipped["master"] = "--no-master-bench"
    except (w.BenchError, KVPoolError, OSError, RuntimeError) as e:
        print(f"kvpool bench: error: {e}", file=sys.stderr)
        return 1
    environment["elapsed_s"] = round(time.monotonic() - started, 1)
    report = build_report(figures, master_figures, config=asdict(config),
                          environment=environment, skipped=skipped)
    print(format_table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
        _say(f"wrote {json_path}")
    plots = Path(plots_dir) if plots_dir else (Path(json_path).parent if json_path else None)
    if plots is not None:
        try:
            for p in write_plots(report, plots):
                _say(f"wrote {p}")
        except ImportError:
            _say("matplotlib is not installed: no plots (pip install 'kvpool[bench]')")
    return 0


def _environment() -> dict:
    return {"python": platform.python_version(), "numpy": np.__version__,
            "cpus": os.cpu_count(), "kernel": platform.release(),
            "machine": platform.machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                 time.gmtime())}


def _redis(config: BenchConfig, data: dict, figures: list, skipped: dict, run_id: str,
           environment: dict) -> None:
    """The Redis baseline's figures (not the small batch), or why it was skipped."""
    from kvpool.tools.bench_peers import PeerUnavailable, RedisPeer
    if not config.redis:
        skipped["redis"] = "--no-redis"
        return
    try:
        redis = RedisPeer().__enter__()
    except PeerUnavailable as e:
        skipped["redis"] = str(e)
        _say(f"baseline: redis skipped: {e}")
        return
    with redis:
        environment["redis_hiredis"] = redis.hiredis
        _say(f"baseline: redis (pipelined, hiredis={redis.hiredis})")
        for shape, src in data.items():
            if shape.workload == "small" or (shape.objects_per_call == 1
                                             and _REDIS_BESIDE in config.transports):
                continue   # (single calls: timed in turns with kvpool's, _peers_in_turns)
            figures.extend(w.redis_figures(redis, shape, config.repeats, src,
                                           f"bench-{run_id}-{shape.workload}"))


def _raw_tcp(config: BenchConfig, data: dict) -> dict:
    """Raw loopback tcp latencies per shape (not the small batch: raw tcp has no batches)."""
    from kvpool.tools.bench_peers import RawTCPPeer
    _say("baseline: raw loopback tcp (two processes)")
    with RawTCPPeer() as peer:
        return {shape: w.raw_tcp_latencies(peer, shape, config.repeats, src)
                for shape, src in data.items() if shape.workload != "small"}


# Why --compare-insecure times each system on several clusters (--cluster-pairs), each kind
# started first in turn, each figure the median of the clusters' (bench_report.across): on
# this kind of VM two identical clusters differ for as long as they run. Two plain ones
# started together put a 512 MiB prompt over shm 1.4-2x apart (the copies into one segment's
# memory slower: which pages a segment gets matters; the slower one followed the start order,
# and flipped after a restart), and two secure ones in one bench run gave single-call p50s
# 0.70-1.33 x each other.
def _kvpool(config: BenchConfig, data: dict, figures: list, skipped: dict, master: str | None,
            run_id: str) -> None:
    from kvpool.tools.cluster import LocalCluster
    pairs: dict = {}
    if master is not None:
        _kvpool_on(config, data, pairs, skipped, {"kvpool": master}, run_id)
    else:
        kinds = {"kvpool": not config.insecure}
        orders = [kinds]
        if config.compare_insecure:   # each kind started first in turn (see above)
            kinds = {"kvpool": True, PLAIN: False}
            orders = [kinds if i % 2 == 0 else dict(reversed(kinds.items()))
                      for i in range(config.cluster_pairs)]
        largest = max(s.value_bytes * s.objects_per_call * s.calls for s in data)
        segment = largest * (config.repeats + 2)
        if segment * len(kinds) > _SEGMENT_MEMORY_SHARE * _available_memory_bytes():
            segment = largest * _SEGMENT_MIN_BATCHES
        segment = max(64 << 20, segment)
        for pair, order in enumerate(orders):
            with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as logs:
                clusters = {}
                try:
                    for system, secure in order.items():
                        tls = config.data_tls and secure
                        _say(f"starting a local cluster"
                             f"{' without credentials' if not secure else ''}: master + 1 "
                             f"store node ({format_size(segment)}"
                             f"{', its tcp data port over TLS' if tls else ''})")
                        clusters[system] = LocalCluster(
                            nodes=1, segment_size=str(segment),
                            master_args=["--lease-ttl", f"{_LEASE_S}s"],
                            node_args=["--data-tls"] if tls else [],
                            log_dir=f"{logs}/{system}", metrics=config.metrics, secure=secure)
                        clusters[system].start()
                    _kvpool_on(config, data, pairs, skipped,
                               {system: clusters[system].master for system in kinds},
                               f"{run_id}-{pair}", segment)
                finally:
                    for c in clusters.values():
                        c.stop()
    for each in pairs.values():   # a figure per system and op, across the clusters
        figures.extend(across([f for fs in each for f in fs if f.key == first.key])
                       for first in each[0])


def _available_memory_bytes() -> int:
    """MemAvailable (Linux); unknown elsewhere: as if plenty."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _settle_s(config: BenchConfig, shape: w.Shape, segment: int | None) -> float:
    """How long each repeat of ``shape`` waits after removing its keys: past the read lease
    of our own cluster (plus a master tick), so that their space is free again, when its
    repeats and the next workload's first batch might not all fit in its ``segment`` at
    once; 0 on someone else's cluster (None)."""
    volume = shape.value_bytes * shape.objects_per_call * shape.calls
    if segment is None or volume * (config.repeats + 2) <= segment:
        return 0.0
    return _LEASE_S + 0.2


def _kvpool_on(config: BenchConfig, data: dict, pairs: dict, skipped: dict,
               masters: dict[str, str], run_id: str, segment: int | None = None) -> None:
    """kvpool's figures on each of ``masters`` (system -> address), their calls alternated
    (tools/bench_kvpool.py kvpool_figures), so that a drifting load weighs on them alike,
    added to ``pairs`` ((transport, shape) -> a list of figures per pair of clusters); with
    several masters, each system's client is in a process of its own (SpawnedClient)."""
    for transport in config.transports:
        clients, peers = {}, {}
        try:
            for system, master in masters.items():
                clients[system] = w.connect(master, transport, spawned=len(masters) > 1)
            if not all(c.reachable(f"bench-{run_id}-{transport}-probe")
                       for c in clients.values()):
                skipped[f"kvpool-{transport}"] = f"no store node is reachable over {transport}"
                continue
            if transport == "shm":
                _say("kvpool shm: faulting the client's mappings of the segment in (untimed)")
                if not all([c.prefaulted(_PREFAULT_S) for c in clients.values()]):
                    _say(f"kvpool shm: still faulting in after {_PREFAULT_S:.0f} s; "
                         "timing anyway")
            peers = _peers_in_turns(config, data, transport, skipped)
            for shape, src in data.items():
                _say(f"{' and '.join(clients)} {transport}: {shape.workload} "
                     f"{shape.objects_per_call} x {format_size(shape.value_bytes)}")
                beside = {name: c for name, c in peers.items()
                          if name != "redis" or shape.objects_per_call == 1}
                pairs.setdefault((transport, shape), []).append(w.kvpool_figures(
                    {**clients, **beside}, shape, config.repeats, src,
                    f"bench-{run_id}-{transport}-{shape.workload}-{shape.value_bytes}",
                    _settle_s(config, shape, segment)))
        except KVPoolError as e:
            if clients.keys() == masters.keys():
                raise
            skipped[f"kvpool-{transport}"] = str(e)   # e.g. rdma without pyverbs or a device
            _say(f"kvpool {transport}: skipped: {e}")
        finally:
            for c in [*clients.values(), *peers.values()]:
                c.close()


# kvpool's transport -> the Mooncake path whose calls take turns with kvpool's: its same-host
# path beside shm, its own tcp transport beside tcp (labels as in ``skipped``).
_PEERS_IN_TURNS = {"shm": ("mooncake-local", True), "tcp": ("mooncake", False)}
# The transport Redis's single calls take turns beside (its 64 KiB GET is shm's target).
_REDIS_BESIDE = "shm"


def _peers_in_turns(config: BenchConfig, data: dict, transport: str, skipped: dict) -> dict:
    """The clients whose calls take turns with kvpool's over ``transport`` (each in a process
    of its own): Mooncake's path beside it (``--peers mooncake``), and beside shm Redis's
    single calls; so that each ratio to a peer is of calls made under the same load: timed
    minutes apart, they swung with it (shm prompt puts against Mooncake's same-host path:
    0.75-1.05 in four runs, each system's three calls timed apart)."""
    peers = {}
    if transport == _REDIS_BESIDE and config.redis and "redis" not in skipped \
            and any(shape.objects_per_call == 1 for shape in data):
        _say("baseline: redis, its single calls in turns with kvpool's")
        peers["redis"] = w.SpawnedClient("tcp", w.redis_client)
    if "mooncake" not in config.peers or transport not in _PEERS_IN_TURNS:
        return peers
    label, local = _PEERS_IN_TURNS[transport]
    if label in skipped:
        return peers
    volume = max(s.value_bytes * s.objects_per_call * s.calls for s in data)
    _say(f"peer: Mooncake Store ({label}), its calls in turns with kvpool's")
    try:
        peers["mooncake"] = w.SpawnedClient("local" if local else "tcp", w.mooncake_client,
                                            max(1 << 30, 2 * volume), local)
    except w.BenchError as e:
        skipped[label] = str(e)
        _say(f"peer: {label} skipped: {e}")
    except BaseException:
        for c in peers.values():   # Redis's, started above
            c.close()
        raise
    return peers


def _master(config: BenchConfig, master: str | None) -> dict:
    from kvpool.tools.cluster import LocalCluster
    lookups = min(config.master_lookups, config.master_objects)
    if master is not None:   # someone's cluster: tiny values on its real nodes, then removed
        _say(f"master: indexing {config.master_objects:,} objects of "
             f"{_SMALL_MASTER_VALUE_BYTES} bytes in batches of {config.master_batch}")
        return w.master_figures(master, None, config.master_objects, config.master_batch,
                                lookups, config.repeats, _SMALL_MASTER_VALUE_BYTES,
                                clients=config.master_clients)
    # A fresh master without store nodes, so its RSS growth is the index alone; the objects are
    # prompt blocks of their real size in a segment that no node has to back.
    _say(f"master: indexing {config.master_objects:,} objects of "
         f"{format_size(config.block_bytes)} in batches of {config.master_batch}")
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as logs:
        cluster = LocalCluster(nodes=0, log_dir=logs, metrics=config.metrics,
                               secure=not config.insecure)
        try:
            address = cluster.start()
            return w.master_figures(address, cluster.master_proc.popen.pid,
                                    config.master_objects, config.master_batch, lookups,
                                    config.repeats, config.block_bytes, virtual_segment=True,
                                    clients=config.master_clients)
        finally:
            cluster.stop()


def _peers(config: BenchConfig, data: dict, figures: list, skipped: dict, run_id: str) -> None:
    """The ``--peers`` systems' figures (before kvpool's: no gRPC channel is open yet when
    they start their processes), or why each was skipped; a path beside a transport kvpool
    is timed on is timed in turns with kvpool's instead (_peers_in_turns)."""
    from kvpool.tools.bench_peers import PeerUnavailable
    for name in config.peers:
        if name != "mooncake":
            skipped[name] = "unknown peer (known: mooncake)"
            continue
        from kvpool.tools.bench_mooncake import MooncakePeer, why_unavailable
        volume = max(s.value_bytes * s.objects_per_call * s.calls for s in data)
        in_turns = {label for t, (label, _) in _PEERS_IN_TURNS.items()
                    if t in config.transports}
        # Its tcp transport (a holder process keeps the values), then its same-host path (the
        # bench's client keeps them: a local memcpy), one after the other.
        for local, label, what in ((False, name, "tcp, zero-copy batch calls"),
                                   (True, f"{name}-local", "same-host: local segment, memcpy")):
            if label in in_turns:   # timed beside kvpool's (_peers_in_turns), if it can run
                if why := why_unavailable():
                    skipped[label] = why
                    _say(f"peer: {label} skipped: {why}")
                continue
            try:
                peer = MooncakePeer(segment_bytes=max(1 << 30, 2 * volume),
                                    local=local).__enter__()
            except PeerUnavailable as e:
                skipped[label] = str(e)
                _say(f"peer: {label} skipped: {e}")
                continue
            with peer:
                _say(f"peer: Mooncake Store ({what})")
                for shape, src in data.items():
                    figures.extend(w.mooncake_figures(
                        peer, shape, config.repeats, src,
                        f"bench-{run_id}-{peer.transport}-{shape.workload}"))
