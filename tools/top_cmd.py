"""``kvpool top``: a live view of the cluster, refreshed in place from the master's Stats."""

from __future__ import annotations

import argparse
import sys
import time

from kvpool.common.config import format_size
from kvpool.tools.argtypes import count_type, duration_type, master_arg
from kvpool.tools.stat_cmd import tier_rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Show the cluster live: nodes, usage per tier, hit rate, operations and "
                     "bytes per second (rates over the last interval), redrawn in place until "
                     "Ctrl-C. Not on a terminal (piped), each view is printed after the last.")
    master_arg(p)
    p.add_argument("--interval", type=duration_type, default=2.0, metavar="DURATION",
                   help="time between two views (default: 2s)")
    p.add_argument("--count", type=count_type, metavar="N",
                   help="stop after N views (default: run until Ctrl-C)")


def run(args: argparse.Namespace) -> int:
    from kvpool.rpc.master_client import MasterClient
    tty = sys.stdout.isatty()
    mc = MasterClient(args.master, timeout_s=5.0, retries=1)
    try:
        before, shown = None, 0
        while True:
            now = (time.monotonic(), mc.stats())
            text = render(args.master, now, before)
            # On a terminal: home the cursor, draw, clear what the last view left below.
            print("\x1b[H" + text.replace("\n", "\x1b[K\n") + "\x1b[J" if tty else text,
                  end="" if tty else "\n", flush=True)
            before, shown = now, shown + 1
            if args.count and shown >= args.count:
                return 0
            time.sleep(args.interval)
    finally:
        mc.close()


def render(master: str, now: tuple[float, object], before: tuple[float, object] | None) -> str:
    """One view: the cluster's figures at ``now`` (monotonic time, StatsResponse), with rates
    since ``before`` (None for the first view: rates shown as "-")."""
    t, s = now

    def rate(field: str) -> float | None:
        if before is None or t <= before[0]:
            return None
        return (getattr(s, field) - getattr(before[1], field)) / (t - before[0])

    def per_s(value: float | None, unit: str = "") -> str:
        return "-" if value is None else f"{value:,.0f}{unit}/s"

    def bytes_per_s(value: float | None) -> str:
        return "-" if value is None else f"{format_size(int(value))}/s"

    lookups = s.hits + s.misses
    looked = rate("hits"), rate("misses")
    window = (f"{looked[0] / (looked[0] + looked[1]):.1%}" if None not in looked
              and looked[0] + looked[1] > 0 else "-")
    lines = [
        f"kvpool top  master {master}  {time.strftime('%H:%M:%S')}",
        f"nodes {s.nodes}  segments {len(s.segments)}  objects {s.objects:,} "
        f"(+{s.pending_objects:,} pending)",
        f"hit rate {window} now, {s.hits / lookups:.1%} overall" if lookups else
        "hit rate - (no lookups yet)",
        f"gets {per_s(rate('hits'), ' keys')} ({bytes_per_s(rate('hit_bytes'))}), "
        f"misses {per_s(rate('misses'), ' keys')}, puts {per_s(rate('committed'), ' keys')} "
        f"({bytes_per_s(rate('committed_bytes'))})",
        f"evictions {per_s(rate('evictions'))}, demotions {per_s(rate('demotions'))}, "
        f"promotions {per_s(rate('promotions'))}",
        "",
        f"{'node':<24} {'tier':<5} {'size':>10} {'used':>10} {'use%':>6} {'objects':>10}",
    ]
    rows = tier_rows(s.segments)
    for node_id, tier, size, used, objects in rows:
        lines.append(f"{node_id:<24} {tier:<5} {format_size(size):>10} {format_size(used):>10} "
                     f"{used / size:>6.1%} {objects:>10,}")
    if not rows:
        lines.append("(no store node mounted)")
    return "\n".join(lines)
