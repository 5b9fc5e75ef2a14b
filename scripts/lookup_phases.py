"""Where a batched lookup's time goes in the master (issue 19: 300k lookup objects/s): the real
``MasterState`` and ``MasterServicer`` in this process, ``--objects`` indexed, then GetReplicas
of ``--batch`` random keys call after call, each phase timed by wrapping the unit that does it.

The master's clock is simulated, moving ``--interval-us`` per call (a master answering 256 keys
every 1.28 ms serves 200k objects/s), so read leases run out as they would under that load:
each call's timing starts after ``lease_ttl_s`` of such calls, when as many leases end as
begin. (`kvpool bench`'s lookup phase is shorter than a lease: its master never expires one.)
No sockets, framing or event loop: what is timed is the master's own work.

    python3 scripts/lookup_phases.py [--objects 1000000] [--batch 256] [--calls 2000] [--unpacked]
"""

from __future__ import annotations

import argparse
import os
import random
import time

from kvpool.common.config import MasterConfig
from kvpool.common.types import NodeEndpoints, SegmentInfo
from kvpool.master.servicer import MasterServicer
from kvpool.master.state import MasterState
from kvpool.protos.kvpool.v1 import master_pb2 as pb
from kvpool.tools.master_cmd import gc_for_a_large_index


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _timed(spent: dict[str, float], obj, name: str, label: str) -> None:
    """Time ``obj.name`` (an instance's method) under ``label`` from now on."""
    method = getattr(obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
    setattr(obj, name, timed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--calls", type=int, default=2000, help="timed calls (after the warm-up)")
    p.add_argument("--interval-us", type=float, default=1280.0,
                   help="simulated time between two calls (default: 200k objects/s)")
    p.add_argument("--unpacked", action="store_true",
                   help="ask for the answer in repeated fields, as a single get does (default: "
                        "packed columns, as MasterClient.locate asks)")
    args = p.parse_args()
    clock = _Clock()
    state = MasterState(MasterConfig(), clock=clock)
    state.mount_segment(NodeEndpoints("n", "", "127.0.0.1:9"), SegmentInfo("n/0", 1 << 50))
    keys = [os.urandom(32).hex() for _ in range(args.objects)]   # sha256-like block keys
    print(f"indexing {args.objects:,} objects ...", flush=True)
    for i in range(0, len(keys), 256):
        part = keys[i:i + 256]
        state.put_start_extents(part, [2 << 20] * len(part))
        state.put_end(part)
    servicer = MasterServicer(state)
    # The master's collector settings: at CPython's defaults a collection every few calls
    # added ~35% to the handler's time here, and made alternated timings swing with it.
    gc_for_a_large_index()
    rng = random.Random(0)

    def requests(n: int) -> list:   # decoded as the lookup port does: fresh strs
        return [pb.KeysRequest.FromString(pb.KeysRequest(
            keys=rng.sample(keys, args.batch), packed=not args.unpacked).SerializeToString())
            for _ in range(n)]

    step = args.interval_us / 1e6
    warm = int(state.config.lease_ttl_s / step) + 1
    print(f"warming up: {warm:,} calls (one lease time) ...", flush=True)
    for request in requests(warm):
        servicer.get_replicas(request)
        clock.now += step
    spent: dict[str, float] = {}
    leasing = state._leasing   # noqa: SLF001 (a diagnostic)
    _timed(spent, leasing, "expire", "leases ending (Leases.expire)")
    _timed(spent, leasing, "begin", "leases beginning (Leases.begin, expire included)")
    _timed(spent, state._index, "columns", "answer columns (ObjectIndex.columns)")  # noqa: SLF001
    _timed(spent, servicer._grants, "mint", "read grants (GrantMinter.mint)")  # noqa: SLF001
    _timed(spent, state, "locate_columns", "MasterState.locate_columns")
    todo = requests(args.calls)
    t0 = time.perf_counter()
    for request in todo:
        servicer.get_replicas(request)
        clock.now += step
    total = time.perf_counter() - t0
    index = state._objects   # noqa: SLF001
    walks = [list(r.keys) for r in requests(args.calls)]
    t0 = time.perf_counter()
    for walk in walks:
        list(map(index.get, walk))
    spent["index walk (dict.get per key, timed apart)"] = time.perf_counter() - t0
    per = 1e6 / args.calls
    print(f"GetReplicas of {args.batch} keys over {args.objects:,} objects, "
          f"{len(leasing):,} leases running (us per call):")
    print(f"  {'the whole handler (MasterServicer.get_replicas)':56s} {total * per:8.1f}")
    for label, seconds in spent.items():
        print(f"  {label:56s} {seconds * per:8.1f}")
    print(f"  => {args.batch / total * args.calls:,.0f} objects/s on this core, "
          "before framing, sealing and the event loop")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
