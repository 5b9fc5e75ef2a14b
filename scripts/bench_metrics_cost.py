"""What metrics cost: the same small workload, in alternating rounds, against two local clusters
running side by side on this machine, one with metrics and one without.

    python3 scripts/bench_metrics_cost.py [--rounds 20]
    python3 scripts/bench_metrics_cost.py --control              # A/A: the measurement's floor
    python3 scripts/bench_metrics_cost.py --baseline-tree DIR    # vs another checkout's servers

Side "on": every process serves --metrics-port and a scraper reads each /metrics once a second
(Prometheus' default is every 15 s). Side "off": no metrics port. With ``--baseline-tree DIR`` the
"off" cluster's processes run from DIR's kvpool instead (a directory holding a ``kvpool`` that
is another checkout), also without metrics: what this checkout's counting costs against it.
The clients are this checkout's, without client metrics.

Each round runs, on each side in turn (the order alternates), single 64 KiB puts and gets over
shm and over tcp (p50 of each) and batches of 256 x 4 KiB puts and lookups (objects/s). Two
clusters at once and alternating rounds put both sides under the same machine load, so the
per-round ratios on/off hold still where whole bench runs differ by 10-30% on a shared 2-core
machine. Printed: each figure's median per side and the median (and quartiles) of its per-round
ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpool.client.kv_client import KVClient
from kvpool.tools.cluster import LocalCluster

SINGLE = 64 << 10
BATCH, BATCH_VALUE = 256, 4 << 10


@contextlib.contextmanager
def _pythonpath(path: str | None):
    """The children started inside see ``path`` first on PYTHONPATH (LocalCluster passes its
    environment on)."""
    old = os.environ.get("PYTHONPATH")
    if path is not None:
        os.environ["PYTHONPATH"] = path
    try:
        yield
    finally:
        if path is not None:
            if old is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = old


# A process of its own, so that scraping takes no GIL time from the clients being timed.
_SCRAPER = """
import sys, time, urllib.request
while True:
    time.sleep(1.0)
    for a in sys.argv[1:]:
        with urllib.request.urlopen(f"http://{a}/metrics", timeout=5) as r:
            r.read()
"""


def interceptor_cost_us(calls: int = 20000) -> float:
    """Microseconds the master's RpcMetrics interceptor adds to one unary call: a call through
    its wrapper against the same handler called directly, on one event loop (no gRPC, no
    network: the interceptor's own work, which a put pays twice, PutStart and PutEnd)."""
    import asyncio
    import types

    import grpc
    from kvpool.master.metrics import RpcMetrics
    from prometheus_client import CollectorRegistry

    class _Context:   # what the wrapper reads of a grpc.aio context
        def code(self):
            return None

    async def handler(request, context):
        return request

    async def run() -> float:
        plain = grpc.unary_unary_rpc_method_handler(handler)
        details = types.SimpleNamespace(method="/kvpool.v1.Master/PutStart",
                                        invocation_metadata=())

        async def continuation(_):
            return plain
        timed = (await RpcMetrics(CollectorRegistry()).intercept_service(
            continuation, details)).unary_unary
        ctx, best = _Context(), {}
        for fn in (handler, timed) * 5:   # best of 5, alternating
            t = time.perf_counter()
            for _ in range(calls):
                await fn(b"", ctx)
            best[fn] = min(best.get(fn, 1e9), (time.perf_counter() - t) / calls)
        return (best[timed] - best[handler]) * 1e6
    return asyncio.run(run())


def _p50(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def _round(clients: dict[str, KVClient], tag: str, calls: int) -> dict[str, float]:
    """One round on one cluster: figure -> value (ms for p50s, objects/s for batches)."""
    out: dict[str, float] = {}
    single = os.urandom(SINGLE)
    for transport, kv in clients.items():
        puts, gets = [], []
        for i in range(calls):
            key = f"bench/{tag}/{transport}/{i}"
            t = time.perf_counter()
            kv.put(key, single)
            puts.append(time.perf_counter() - t)
            t = time.perf_counter()
            kv.get(key)
            gets.append(time.perf_counter() - t)
        out[f"{transport} put 64KiB p50 ms"] = _p50(puts)
        out[f"{transport} get 64KiB p50 ms"] = _p50(gets)
        kv.batch_remove([f"bench/{tag}/{transport}/{i}" for i in range(calls)])
    kv = clients["shm"]
    keys = [f"bench/{tag}/batch/{i}" for i in range(BATCH)]
    values = [os.urandom(BATCH_VALUE)] * BATCH
    t = time.perf_counter()
    assert not any(kv.batch_put(keys, values))
    out["batch put objects/s"] = BATCH / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(10):
        kv.batch_exists(keys)
    out["batch exists objects/s"] = 10 * BATCH / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(10):
        kv.batch_get(keys)
    out["batch get objects/s"] = 10 * BATCH / (time.perf_counter() - t)
    kv.batch_remove(keys)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20, help="rounds per side (default: 20)")
    p.add_argument("--calls", type=int, default=100,
                   help="single puts and gets per transport per round (default: 100)")
    p.add_argument("--control", action="store_true",
                   help="an A/A run: no metrics on either side (what two identical clusters "
                        "differ by: the measurement's floor)")
    p.add_argument("--baseline-tree", metavar="DIR",
                   help="run the 'off' cluster from DIR/kvpool (another checkout) instead")
    args = p.parse_args()
    baseline = None
    if args.baseline_tree:
        root = Path(args.baseline_tree).resolve()
        if not (root / "kvpool" / "tools" / "cli.py").exists():
            p.error(f"{root}/kvpool is not a kvpool checkout")
        baseline = str(root)
    off_name = "baseline" if baseline else "off"
    print(f"the master's gRPC interceptor: {interceptor_cost_us():.1f} us per call", flush=True)
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-bench-")))
        on = stack.enter_context(LocalCluster(nodes=1, segment_size="1GiB",
                                              metrics=not args.control, log_dir=logs / "on"))
        with _pythonpath(baseline):
            off = stack.enter_context(LocalCluster(nodes=1, segment_size="1GiB",
                                                   log_dir=logs / off_name))
        scraper = subprocess.Popen([sys.executable, "-c", _SCRAPER,
                                    *on.metrics_addresses.values()])   # none in --control
        stack.callback(scraper.wait)
        stack.callback(scraper.kill)
        on_name = "this (no metrics)" if args.control else "on"
        sides = {on_name: on, off_name: off}
        clients = {side: {t: stack.enter_context(KVClient(c.master, transports=[t]))
                          for t in ("shm", "tcp")} for side, c in sides.items()}
        figures: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                for k, v in _round(clients[side], f"{side}{r}", args.calls).items():
                    figures[side].setdefault(k, []).append(v)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\n| figure | {off_name} (median) | {on_name} (median) | {on_name}/{off_name} per "
          "round: median [quartiles] |\n|---|---|---|---|")
    for k in figures[on_name]:
        ratios = sorted(a / b for a, b in zip(figures[on_name][k], figures[off_name][k]))
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"| {k} | {statistics.median(figures[off_name][k]):.4g} | "
              f"{statistics.median(figures[on_name][k]):.4g} | {statistics.median(ratios):.3f} "
              f"[{q1:.3f}-{q3:.3f}] |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
