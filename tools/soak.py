"""``kvpool soak``: a local cluster under load and faults, then an audit that must come out clean.

Several client processes put, get and remove values (4 KiB - 64 KiB by default, 1 or 2
replicas) into segments small enough that eviction runs all the time, while store nodes are
killed -9 and restarted at random (the master too, with --master-kill-interval: its index is
then rebuilt from what the nodes re-announce). Every byte a client reads is checked against the bytes its
key implies (derived from the key and the seed). At the end the auditor checks:

- wrong bytes: zero, in every read during the run and in a final read of every live object;
- lost objects: zero. An object is lost if its put committed, no remove of it succeeded (nor
  answered "not found" across a master kill: the killed master may have removed it), the
  master never evicted it (the master logs each eviction), one of its replicas was on a node
  process that was never killed (still running at the end), and yet it is gone or unreadable;
- resurrected objects: zero removed keys may exist again, nor keys a get found absent -- except
  in the seconds after a master restart, when a miss only means "not re-announced yet" (counted
  as misses while the master recovered; those objects are audited as live);
- leaked bytes: zero. Per segment, the master's allocated bytes equal the aligned sizes of the
  objects indexed there (Stats with audit), and every quarantined range is released in time;
- phantom objects: zero. The master holds exactly the objects the clients can account for.

It prints progress lines while it runs and a summary table at the end; the exit code is 1 on
any violation (the logs of the cluster are kept then, and their folder is printed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.tools.argtypes import count_type, duration_or_off_type, duration_type, size_type

NODE_TTL_S = 2.0
SETTLE_S = NODE_TTL_S + 1.5   # after the load: dead incarnations dropped, puts reclaimed
# A restarted master knows an object again only once its nodes re-announce it (their next
# heartbeat, then the announcement: ~1 s here); a get in that window is a cache miss, not a
# loss, and the object is back afterwards. Such misses are counted apart and the object is
# audited as live.
RECOVERY_S = NODE_TTL_S
MASTER_ARGS = ["--log-level", "debug", "--node-ttl", f"{NODE_TTL_S}s", "--lease-ttl", "1s",
               "--quarantine", "1s", "--put-timeout", "3s"]
NODE_ARGS = ["--heartbeat-interval", "200ms", "--no-rdma", "--scrub-interval", "2s"]
PROGRESS_EVERY_S = 5.0
_EVICTED = re.compile(r"object_evicted\b.*?\bkey=(\S+)")


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.description = __doc__.split("\n\n", 1)[1]
    s.formatter_class = argparse.RawDescriptionHelpFormatter
    s.epilog = ("Examples:\n  kvpool soak                      (60 s, 3 clients, 3 nodes)\n"
                "  kvpool soak --duration 5m --clients 4 --seed 7")
    s.add_argument("--duration", type=duration_type, default=60.0, metavar="DURATION",
                   help="how long the clients run (default: 60s)")
    s.add_argument("--clients", type=count_type, default=3, help="client processes (default: 3)")
    s.add_argument("--nodes", type=lambda t: count_type(t, minimum=2), default=3,
                   help="store nodes, at least 2; one at a time is killed (default: 3)")
    s.add_argument("--seed", type=int, default=0,
                   help="seed of values, ops and faults (default: 0)")
    s.add_argument("--segment-size", type=size_type, default=4 << 20, metavar="SIZE",
                   help="DRAM segment per node; small, so eviction runs constantly "
                        "(default: 4MiB)")
    s.add_argument("--kill-interval", type=duration_or_off_type, default=5.0, metavar="DURATION",
                   help="mean time between two node kills (-9); 0 = never (default: 5s)")
    s.add_argument("--master-kill-interval", type=duration_or_off_type, default=0.0,
                   metavar="DURATION", help="mean time between two kills (-9) and restarts of "
                   "the master, which rebuilds its index from the nodes; 0 = never (default: 0)")
    s.add_argument("--max-replicas", type=count_type, default=2,
                   help="each put asks for 1..this many replicas (default: 2)")
    s.add_argument("--min-size", type=size_type, default=4 << 10, metavar="SIZE",
                   help="smallest value (default: 4KiB)")
    s.add_argument("--max-size", type=size_type, default=64 << 10, metavar="SIZE",
                   help="largest value (default: 64KiB)")
    s.add_argument("--json", metavar="FILE", help="also write the figures and violations as JSON")
    s.add_argument("--log-dir", metavar="DIR", help="keep the cluster's logs here (default: a "
                   "temporary folder, kept only if the audit fails)")


def run(args: argparse.Namespace) -> int:
    """Run the soak ``args`` describe; print progress and the summary; 0 if the audit is clean."""
    if args.min_size > args.max_size:
        print("kvpool soak: --min-size is larger than --max-size", flush=True)
        return 2
    if args.max_replicas > args.nodes:
        print(f"kvpool soak: --max-replicas {args.max_replicas} is more than the "
              f"{args.nodes} nodes", flush=True)
        return 2
    report = Soak(args).run()
    print(report.table(), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2))
    return 1 if report.violations() else 0


@dataclass
class Report:
    duration_s: float = 0.0
    counts: dict = field(default_factory=dict)
    wrong_bytes: int = 0
    final_checked: int = 0
    lost: list = field(default_factory=list)
    resurrected: list = field(default_factory=list)
    leaked_bytes: int = 0
    stuck_quarantine_bytes: int = 0
    phantom_objects: int = 0
    evictions: int = 0
    dropped_with_node: int = 0
    recovery_misses: int = 0
    calls_cut_by_kills: int = 0
    node_kills: int = 0
    master_kills: int = 0
    hung_clients: int = 0
    log_dir: str = ""

    def violations(self) -> list[str]:
        out = []
        if self.wrong_bytes:
            out.append(f"{self.wrong_bytes} wrong bytes read")
        if self.lost:
            out.append(f"{len(self.lost)} objects lost with a surviving replica "
                       f"(e.g. {self.lost[:5]})")
        if self.resurrected:
            out.append(f"{len(self.resurrected)} removed objects came back "
                       f"(e.g. {self.resurrected[:5]})")
        if self.leaked_bytes:
            out.append(f"{self.leaked_bytes} bytes allocated to no indexed object")
        if self.stuck_quarantine_bytes:
            out.append(f"{self.stuck_quarantine_bytes} quarantined bytes never released")
        if self.phantom_objects:
            out.append(f"{self.phantom_objects} objects indexed that no client accounts for")
        if self.hung_clients:
            out.append(f"{self.hung_clients} client processes hung past their deadline")
        return out

    def as_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("lost", "resurrected")}
        d.update(lost=len(self.lost), resurrected=len(self.resurrected),
                 lost_keys=self.lost[:100], resurrected_keys=self.resurrected[:100],
                 violations=self.violations())
        return d

    def table(self) -> str:
        c = self.counts
        ops = c.get("put", 0) + c.get("put_nospace", 0) + c.get("put_failed", 0) \
            + c.get("get", 0) + c.get("remove", 0) + c.get("remove_failed", 0)
        rows = [
            ("duration", f"{self.duration_s:.1f} s"),
            ("ops", f"{ops} ({ops / max(self.duration_s, 1e-9):.0f}/s)"),
            ("puts ok / no space / failed",
             f"{c.get('put', 0)} / {c.get('put_nospace', 0)} / {c.get('put_failed', 0)}"),
            ("gets hit / miss / failed",
             f"{c.get('get_hit', 0)} / {c.get('get_miss', 0)} / {c.get('get_failed', 0)}"),
            ("removes ok / failed", f"{c.get('remove', 0)} / {c.get('remove_failed', 0)}"),
            ("bytes written / read", (f"{c.get('bytes_written', 0) / 2**20:.1f} MiB / "
                                      f"{c.get('bytes_read', 0) / 2**20:.1f} MiB")),
            ("evictions (master)", str(self.evictions)),
            ("node kills + restarts", str(self.node_kills)),
            ("master kills + restarts", str(self.master_kills)),
            ("objects dropped with their nodes", str(self.dropped_with_node)),
            ("misses while the master recovered", str(self.recovery_misses)),
            ("not-found answers to calls a master kill cut", str(self.calls_cut_by_kills)),
            ("live objects re-read at the end", str(self.final_checked)),
            ("wrong bytes", str(self.wrong_bytes)),
            ("lost objects", str(len(self.lost))),
            ("removed objects back", str(len(self.resurrected))),
            ("leaked bytes", str(self.leaked_bytes)),
            ("stuck quarantine bytes", str(self.stuck_quarantine_bytes)),
            ("phantom objects", str(self.phantom_objects)),
            ("hung clients", str(self.hung_clients)),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["", "soak summary", "-" * (width + 20)]
        lines += [f"{k:<{width}}  {v}" for k, v in rows]
        bad = self.violations()
        lines.append("-" * (width + 20))
        lines.append("VIOLATIONS: " + "; ".join(bad) if bad else "audit: clean")
        if bad and self.log_dir:
            lines.append(f"cluster logs: {self.log_dir}")
        return "\n".join(lines)


class Soak:
    """One soak run: cluster, clients, faults, audit. Everything started is stopped by run()."""

    def __init__(self, args: argparse.Namespace, out=print):
        self.args = args
        self.out = out
        self.rng = random.Random(args.seed)
        self.report = Report()
        # Node incarnations: name -> (Proc, tcp endpoint). A restart is a new incarnation.
        self.running: dict = {}
        self.kill_times: list[float] = []
        self.recovery_windows: list[tuple[float, float]] = []   # master restarts
        self.t0 = time.monotonic()   # the clients' start: fault lines and lost keys say when

    def run(self) -> Report:
        from kvpool.tools.cluster import LocalCluster
        a = self.args
        own_logs = a.log_dir is None
        log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="kvpool-soak-"))
        work = Path(tempfile.mkdtemp(prefix="kvpool-soak-results-"))
        self.report.log_dir = str(log_dir)
        self.cluster = LocalCluster(nodes=0, segment_size=str(a.segment_size),
                                    master_args=MASTER_ARGS, node_args=NODE_ARGS,
                                    log_dir=log_dir)
        workers = []
        try:
            self.cluster.start()
            for i in range(a.nodes):
                self._start_node(f"node{i}")
            self.out(f"soak: master {self.cluster.master}, {a.nodes} nodes x "
                     f"{a.segment_size >> 10} KiB, {a.clients} clients, {a.duration:.0f} s, "
                     f"seed {a.seed}", flush=True)
            workers, counters = self._start_workers(work)
            started = self.t0 = time.monotonic()
            self._fault_loop(started + a.duration, counters)
            self._join(workers, started + a.duration + 30.0)
            self.report.duration_s = time.monotonic() - started
            self._audit(work, log_dir)
        finally:
            for p in workers:
                if p.is_alive():
                    p.kill()
                    p.join()
            self.cluster.stop()
            shutil.rmtree(work, ignore_errors=True)
        if own_logs and not self.report.violations():
            shutil.rmtree(log_dir, ignore_errors=True)
        return self.report

    # -- cluster and faults ---------------------------------------------------------------

    def _start_node(self, name: str) -> None:
        proc = self.cluster.add_node(name)
        endpoint = re.search(r"tcp=(\S+)", proc.ready)
        self.running[name] = (proc, endpoint.group(1) if endpoint else "")

    def _kill_node(self, name: str) -> None:
        proc, _ = self.running.pop(name)
        proc.kill()
        if proc.popen.stdout:
            proc.popen.stdout.close()
        self.cluster.nodes.remove(proc)
        self.kill_times.append(time.monotonic())   # after the kill: never too early
        self.report.node_kills += 1

    def _next(self, interval: float, end: float) -> float:
        return time.monotonic() + interval * self.rng.uniform(0.5, 1.5) if interval else end

    def _fault_loop(self, end: float, counters) -> None:
        interval = self.args.kill_interval
        next_kill = self._next(interval, end)
        next_master_kill = self._next(self.args.master_kill_interval, end)
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        while (now := time.monotonic()) < end:
            if now >= next_progress:
                self._progress(end, counters)
                next_progress = now + PROGRESS_EVERY_S
            if now >= next_master_kill:
                started = time.monotonic()
                self.cluster.restart_master()
                self.recovery_windows.append((started, time.monotonic() + RECOVERY_S))
                self.report.master_kills += 1
                self._say(f"killed the master (-9) and restarted it in "
                          f"{time.monotonic() - started:.1f} s")
                next_master_kill = self._next(self.args.master_kill_interval, end)
                continue
            if now >= next_kill:
                victim = self.rng.choice(sorted(self.running))
                self._kill_node(victim)
                down_s = self.rng.uniform(0.2, 2 * NODE_TTL_S)
                self._say(f"killed {victim} (-9), restarting it in {down_s:.1f} s")
                time.sleep(min(down_s, max(0.0, end - time.monotonic())))
                self._start_node(victim)
                next_kill = self._next(interval, end)
                continue
            time.sleep(0.1)

    def _say(self, what: str) -> None:
        self.out(f"soak: at {time.monotonic() - self.t0:.1f} s, {what}", flush=True)

    def _progress(self, end: float, counters) -> None:
        from kvpool.tools.soak_worker import BYTES, ERRORS, N_COUNTERS, OPS, WRONG
        n = self.args.clients
        total = [sum(counters[w * N_COUNTERS + k] for w in range(n)) for k in range(N_COUNTERS)]
        self.out(f"soak: {max(0.0, end - time.monotonic()):.0f} s left, {total[OPS]} ops, "
                 f"{total[BYTES] / 2**20:.0f} MiB moved, {total[ERRORS]} failed ops, "
                 f"{total[WRONG]} wrong bytes, {self.report.node_kills} node kills, "
                 f"{self.report.master_kills} master kills", flush=True)

    # -- clients --------------------------------------------------------------------------

    def _start_workers(self, work: Path):
        from kvpool.tools.soak_worker import N_COUNTERS, WorkerConfig, run_worker
        a = self.args
        # spawn: never fork a process that may hold gRPC channels
        ctx = multiprocessing.get_context("spawn")
        counters = ctx.Array("q", a.clients * N_COUNTERS, lock=False)
        workers = []
        for i in range(a.clients):
            cfg = WorkerConfig(worker=i, master=self.cluster.master, seed=a.seed,
                               duration_s=a.duration, max_replicas=a.max_replicas,
                               min_size=a.min_size, max_size=a.max_size,
                               out_path=str(work / f"worker{i}.json"),
                               tcp_only=i % 2 == 1)   # half the clients read via tcp, half shm
            p = ctx.Process(target=run_worker, args=(cfg, counters), name=f"soak-client-{i}",
                            daemon=True)
            p.start()
            workers.append(p)
        return workers, counters

    def _join(self, workers, deadline: float) -> None:
        for p in workers:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                self.report.hung_clients += 1
                p.kill()
                p.join()

    # -- audit ----------------------------------------------------------------------------

    def _audit(self, work: Path, log_dir: Path) -> None:
        from kvpool.client.kv_client import KVClient
        from kvpool.rpc.master_client import MasterClient
        results = [json.loads(p.read_text()) for p in sorted(work.glob("worker*.json"))]
        counts: dict[str, int] = {}
        for r in results:
            for k, v in r["counts"].items():
                counts[k] = counts.get(k, 0) + v
        self.report.counts = counts
        self.report.wrong_bytes = counts.get("wrong_bytes", 0)
        self.out(f"soak: clients done; settling {SETTLE_S:.1f} s, then auditing", flush=True)
        time.sleep(SETTLE_S)
        evicted = set(_EVICTED.findall((log_dir / "master.log").read_text(errors="replace")))
        alive = {(name, endpoint) for name, (_, endpoint) in self.running.items()}
        live = {k: v for r in results for k, v in r["live"].items()}
        missing = {k: v for r in results for k, v in r["missing"].items()}
        back, cut = triage_misses(missing, self.recovery_windows)
        live |= back
        self.report.recovery_misses, self.report.calls_cut_by_kills = len(back), cut
        removed = {k: t for r in results for k, t in r["removed"].items()}
        attempted = [k for r in results for k in r["attempted"]]
        # As the cluster's admin: the audit (Stats with audit) is an admin's call.
        mc = MasterClient(self.cluster.master, timeout_s=30.0, role="admin")
        kv = KVClient(self.cluster.master, timeout_s=30.0)
        try:
            exists = dict(zip(attempted, _chunked(mc.exists, attempted)))
            gone = {k: v for k, v in live.items() if not exists[k]} | missing
            for key, record in gone.items():
                if key in evicted:
                    continue
                if any(tuple(r) in alive for r in record["replicas"]):
                    where = ", ".join(f"{n} {e}" + ("" if (n, e) in alive else " (killed)")
                                      for n, e in record["replicas"])
                    self.report.lost.append(f"{key} (put at {record['t0'] - self.t0:.1f} s "
                                            f"on {where})")
                elif not record["replicas"] and not any(t >= record["t0"]
                                                        for t in self.kill_times):
                    # Gone before it could be located, with no node killed since its put.
                    self.report.lost.append(f"{key} (gone right after its put)")
                else:
                    self.report.dropped_with_node += 1
            self._reread(kv, [k for k in live if exists[k]], live)
            # Removed, or seen gone by a get: neither may exist again.
            self.report.resurrected = [
                f"{k} (removed at {t - self.t0:.1f} s)" for k, t in removed.items() if exists.get(k)
            ] + [f"{k} (a get missed it at {r['missing_at'] - self.t0:.1f} s)"
                 for k, r in missing.items() if exists.get(k)]
            self._check_space(mc, sum(exists.values()))
        finally:
            kv.close()
            mc.close()
        self.report.evictions = len(evicted)

    def _reread(self, kv, keys: list[str], live: dict) -> None:
        """Read every live object once more: each must be readable, byte for byte."""
        from kvpool.common.errors import KVPoolError
        from kvpool.tools.soak_worker import expected_value, wrong_bytes
        for i in range(0, len(keys), 256):
            chunk = keys[i:i + 256]
            for key, got in zip(chunk, kv.batch_get(chunk, verify=True)):
                if isinstance(got, KVPoolError):
                    self.report.lost.append(f"{key} (unreadable: {got})")
                    continue
                self.report.wrong_bytes += wrong_bytes(
                    got, expected_value(self.args.seed, key, live[key]["size"]))
                self.report.final_checked += 1

    def _check_space(self, mc, known_objects: int) -> None:
        """Allocator accounting against the index, and quarantine drained."""
        deadline = time.monotonic() + 10.0
        while True:
            s = mc.stats(audit=True)
            quarantined = sum(g.quarantined_bytes for g in s.segments)
            if (quarantined == 0 and s.pending_objects == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        self.report.leaked_bytes = sum(abs(g.used_bytes - g.indexed_bytes) for g in s.segments)
        self.report.stuck_quarantine_bytes = quarantined
        self.report.phantom_objects = s.objects + s.pending_objects - known_objects


def triage_misses(missing: dict, recovery_windows: list[tuple[float, float]]
                  ) -> tuple[dict, int]:
    """Take out of ``missing`` (key -> put record, with when the call that found it absent
    was made and answered) what is no loss. A remove the master was killed during: its retry
    was answered by the successor, whose "not found" may mean the killed master carried the
    remove out; outcome unknown, as for a failed remove, so no longer checked (counted). A
    miss while a restarted master recovered: not re-announced yet, so audited as live
    (returned). A get's call time is its answer's, so only removes are cut by a kill."""
    back, cut = {}, 0
    for key, record in list(missing.items()):
        if any(record["asked_at"] <= a <= record["missing_at"] for a, _ in recovery_windows):
            del missing[key]
            cut += 1
        elif any(a <= record["missing_at"] <= b for a, b in recovery_windows):
            back[key] = missing.pop(key)
    return back, cut


def _chunked(call, keys: list[str], size: int = 4096) -> list:
    out: list = []
    for i in range(0, len(keys), size):
        out += call(keys[i:i + size])
    return out

