"""What the master's frozen generation holds that no one refers to: the cycles a request still
had alive at a generation-1 collection (which froze them: tools/master_cmd.py
``gc_for_a_large_index``) and dropped later, which no collection will ever free.

One local cluster with small segments, clients in threads putting, reading, removing,
putting what is stored (AlreadyExists), reading what is not (ObjectNotFound), filling the
segment (NoSpace), over shm and tcp, singly and in batches, for ``--seconds`` (with
--no-errors: only calls that succeed); then the master, on SIGUSR1, collects its young
generations as usual, unfreezes everything and runs a full collection: what that frees is what
froze and leaked. It prints the master's frozen count, that count, the leaked objects' types
and the code of the frames among them (where the cycles were made).

    python3 scripts/gc_leak.py [--seconds 60] [--clients 4] [--no-errors]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvpool.client import KVClient
from kvpool.common.errors import KVPoolError
from kvpool.tools.argtypes import count_type, duration_type
from kvpool.tools.cluster import LocalCluster

# Run in the master (sitecustomize): on SIGUSR1, write the report to $KVPOOL_GC_REPORT.
_HOOK = '''
import os, signal, sys
if sys.argv[1:2] == ["master"] and os.environ.get("KVPOOL_GC_REPORT"):
    def _report(*_):
        import collections, gc, json
        gc.collect(1)
        frozen = gc.get_freeze_count()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.unfreeze()
        leaked = gc.collect()
        kinds = collections.Counter(type(o).__name__ for o in gc.garbage).most_common(12)
        frames = collections.Counter(  # where the leaked cycles were made
            "/".join(o.f_code.co_filename.rsplit("/", 2)[-2:]) + ":" + o.f_code.co_name
            for o in gc.garbage if type(o).__name__ == "frame").most_common(12)
        with open(os.environ["KVPOOL_GC_REPORT"], "w") as f:
            json.dump({"frozen": frozen, "leaked": leaked, "kinds": kinds,
                       "frames": frames}, f)
    signal.signal(signal.SIGUSR1, _report)
'''


def _work(master: str, transport: str, stop: threading.Event, seed: int,
          counts: dict[str, int], errors: bool) -> None:
    value = os.urandom(48 << 10)
    with KVClient(master, transports=[transport]) as c:
        i = 0
        while not stop.is_set():
            i += 1
            keys = [f"gc{seed}-{i}-{j}" for j in range(8)]
            results = [c.batch_put(keys, [value] * 8), c.batch_get(keys)]
            if errors:
                results += [c.batch_get(["absent"]), c.batch_put(keys[:2], [value] * 2)]
            for r in results:
                for x in r:
                    counts["errors" if isinstance(x, KVPoolError) else "ok"] += 1
            try:
                c.put(f"gc{seed}-{i}-single", value)
                c.get(f"gc{seed}-{i}-single")
                if errors:
                    c.get(f"gc{seed}-{i}-nothing")
            except KVPoolError:
                counts["errors"] += 1
            if not errors or i % 3 == 0:   # else the segment fills: NoSpace
                c.batch_remove([*keys, f"gc{seed}-{i}-single"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=duration_type, default=60.0,
                   help="how long the clients run (60, 60s, 2m; default: 60s)")
    p.add_argument("--clients", type=count_type, default=4,
                   help="client threads, half over shm, half over tcp (default: 4)")
    p.add_argument("--no-errors", action="store_true",
                   help="only calls that succeed (and remove what they put: nothing evicted)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpool-gc-") as tmp:
        Path(tmp, "sitecustomize.py").write_text(_HOOK)
        report = Path(tmp, "report.json")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [tmp, *filter(None, [os.environ.get("PYTHONPATH")])])
        os.environ["KVPOOL_GC_REPORT"] = str(report)
        size = "1GiB" if args.no_errors else "64MiB"
        with LocalCluster(nodes=1, segment_size=size) as cluster:
            stop = threading.Event()
            counts: dict[str, int] = {"ok": 0, "errors": 0}
            threads = [threading.Thread(target=_work, args=(cluster.master, t, stop, n, counts,
                                                         not args.no_errors))
                       for n, t in enumerate((["shm", "tcp"] * args.clients)[:args.clients])]
            for t in threads:
                t.start()
            time.sleep(args.seconds)
            stop.set()
            for t in threads:
                t.join()
            os.kill(cluster.master_proc.popen.pid, signal.SIGUSR1)
            deadline = time.monotonic() + 120
            while not report.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)
            got = json.loads(report.read_text())
        print(f"calls' results: {counts['ok']:,} ok, {counts['errors']:,} errors")
        print(f"master: {got['frozen']:,} objects frozen; {got['leaked']:,} of them leaked "
              f"(freed by a full collection after unfreezing)")
        for kind, n in got["kinds"]:
            print(f"  {n:>8,}  {kind}")
        for where, n in got["frames"]:
            print(f"  {n:>8,}  frames of {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
